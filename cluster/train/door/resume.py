"""`--resume`: the run to continue must exist, and the checkpoint it resumes from must be whole
(each of its files there and readable, the damaged one named) before anything is written to
the run directory. What a resumed run may change is `cluster.train.run_meaning.resume_changes`."""
from __future__ import annotations

import json
import zipfile
from dataclasses import fields
from pathlib import Path

from cluster.config.loader import ConfigError
from cluster.train import checkpoint as ckpt
from cluster.train.run_log import config_path


def check_resume_target(path: Path) -> None:
    """`klrl train --resume PATH` with PATH given as a run directory: it must be one."""
    if not path.exists():
        raise ConfigError(f"--resume {path}: no such run directory (nor config file); give the "
                          "directory of a run that started (e.g. runs/NAME), or drop --resume "
                          "to start a new run")
    if path.is_dir() and not config_path(path).is_file():
        raise ConfigError(f"--resume {path}: no config.yaml there (not a run directory)")


def check_run_exists(run_dir: Path) -> None:
    """A run to resume must have been started: its directory exists (a directory without a
    checkpoint is started afresh, `train`)."""
    if not run_dir.is_dir():
        raise ConfigError(f"--resume: {run_dir} holds no run (it never started), so there is "
                          "nothing to continue; check output_dir and run_name, or drop --resume "
                          "to start it")


def check_checkpoint(path: Path) -> ckpt.ControllerState:
    """The checkpoint at `path`, read whole: controller.json a ControllerState, the learner's
    state there with every torch file an intact archive. ConfigError naming the damaged file
    and how to resume without it."""
    def damaged(what: str) -> ConfigError:
        older = [p for p in ckpt.complete_checkpoints(path.parent) if p != path]
        fix = (f"remove {path} to resume from {older[-1].name}, the one before it" if older
               else f"remove {path} to start the run afresh with --resume")
        return ConfigError(f"checkpoint {path} is damaged: {what}; {fix}")

    state_file = path / "controller.json"
    try:
        raw = json.loads(state_file.read_text())
    except FileNotFoundError:
        raise damaged(f"{state_file.name} is missing") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise damaged(f"{state_file.name} is not JSON ({exc})") from None
    names = {f.name for f in fields(ckpt.ControllerState)}
    if not isinstance(raw, dict) or not {"step", "prompt_position"} <= raw.keys() \
            or not raw.keys() <= names:
        raise damaged(f"{state_file.name} is not a controller state (keys step, "
                      "prompt_position, ...)")
    learner = path / ckpt.LEARNER_TAG
    states = sorted(learner.glob("*model_states.pt")) if learner.is_dir() else []
    if not states:
        raise damaged(f"the learner's state is missing (no {ckpt.LEARNER_TAG}/*model_states.pt)")
    for file in sorted(learner.glob("*.pt")):
        if not zipfile.is_zipfile(file):
            raise damaged(f"{ckpt.LEARNER_TAG}/{file.name} is not a torch archive (cut short?)")
    return ckpt.ControllerState(**raw)
