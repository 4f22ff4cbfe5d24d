"""Atomic, complete run checkpoints under RUN_DIR/checkpoints/.

Layout of one checkpoint, `step_000000042/`:
  learner/          DeepSpeed checkpoint of every rank (policy, optimizer, LR scheduler,
                    learner version, the ranks' torch RNG states)
  controller.json   `ControllerState`: step, data position, counters, wandb run id,
                    reference identity, the resolved config
  COMPLETE          written last; its presence is what makes the checkpoint loadable

Atomicity (invariant): a checkpoint is written under `.partial-step_N/` and renamed to
`step_N/` only after COMPLETE is on disk, so `step_N/` never holds half a checkpoint; a
process killed mid-write leaves only a `.partial-*` directory, which readers ignore and the
next write removes. The newest `keep` complete checkpoints are kept.

Periodic Hugging Face exports (`hf_every`) live beside them, as RUN_DIR/hf/step_000000042/
(the same files as final/). Same atomicity: written under `hf/.partial-step_N/` and renamed,
so a `step_N/` directory is always a whole, loadable model.

Nothing else needs saving for an exact resume: vLLM sampling seeds are a pure function of
(seed, data position) (actors/seeds.py), the learner has no dropout, and the
prompt stream is a pure function of (seed, position) (cluster/train/prompts.py).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

MARKER = "COMPLETE"
LEARNER_TAG = "learner"
HF_DIR = "hf"
_NAME = re.compile(r"^step_(\d+)$")


@dataclass
class ControllerState:
    """What the controller needs, besides the learner's own checkpoint, to continue a run."""

    step: int                 # optimizer steps taken == learner policy version
    prompt_position: int      # prompts before this index have been trained on
    nonfinite_total: int = 0
    nonfinite_run: int = 0
    dropped_stale: int = 0
    worker_restarts: int = 0
    learner_restarts: int = 0
    learner_steps_lost: int = 0   # steps trained, then redone from a checkpoint by a restart
    env_samples: int = 0          # multi-turn: the samples the environment served, and
    env_failures: int = 0         # those it failed (task.environment.max_failure_share's count)
    wandb_id: str | None = None
    reference_sha256: str = ""  # identity of the initial policy = KL reference
    config: dict = field(default_factory=dict)


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def complete_checkpoints(root: str | Path) -> list[Path]:
    """Loadable checkpoints under `root`, oldest first (half-written ones are skipped)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _NAME.match(p.name)) and (p / MARKER).is_file()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    done = complete_checkpoints(checkpoint_root(run_dir))
    return done[-1] if done else None


def write_checkpoint(run_dir: str | Path, state: ControllerState,
                     save_learner: Callable[[Path, str], None], keep: int) -> Path:
    """Write a checkpoint of `state` (and, through `save_learner(directory, tag)`, the
    learner's) atomically; keep the newest `keep`. Returns the checkpoint directory."""
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{state.step:09d}"
    if (final / MARKER).is_file():
        return final  # this step is already saved (e.g. a stop right after a periodic save)
    for stale in root.glob(".partial-*"):  # left by a process killed mid-write
        remove_tree(stale, run_dir, ignore_errors=True)
    partial = root / f".partial-{final.name}"
    partial.mkdir()
    save_learner(partial, LEARNER_TAG)
    _write_durably(partial / "controller.json", json.dumps(asdict(state), indent=1))
    _write_durably(partial / MARKER, f"{state.step}\n")
    if final.exists():  # a directory without MARKER cannot be from this module; never trust it
        remove_tree(final, run_dir)
    os.rename(partial, final)
    _fsync_dir(root)
    for old in complete_checkpoints(root)[:-keep]:
        remove_tree(old, run_dir, ignore_errors=True)
    return final


def hf_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / HF_DIR


def hf_exports(run_dir: str | Path) -> list[Path]:
    """The periodic Hugging Face exports RUN_DIR/hf/step_N/, oldest first (half-written
    `.partial-*` ones are skipped)."""
    root = hf_root(run_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def write_hf_export(run_dir: str | Path, step: int, save_hf: Callable[[Path], object],
                    keep: int | None) -> Path:
    """Export the policy at `step` through `save_hf(directory)` (the learner's final/ export)
    to RUN_DIR/hf/step_N/, atomically; keep the newest `keep` (None: all). Returns it."""
    root = hf_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:09d}"
    if final.is_dir():  # already exported: a refused (NaN) step left the weights as they were
        return final
    for stale in root.glob(".partial-*"):  # left by a process killed mid-write
        remove_tree(stale, run_dir, ignore_errors=True)
    partial = root / f".partial-{final.name}"
    save_hf(partial)
    os.rename(partial, final)
    if keep is not None:
        for old in hf_exports(run_dir)[:-keep]:
            remove_tree(old, run_dir, ignore_errors=True)
    return final


def drop_hf_exports_after(run_dir: str | Path, step: int) -> None:
    """Delete the exports of steps after `step`: a run resumed from the checkpoint of `step`
    redoes those steps (at max_lag > 0 with other batches), and exports them again."""
    for export in hf_exports(run_dir):
        if int(_NAME.match(export.name).group(1)) > step:
            remove_tree(export, run_dir)


def remove_tree(path: Path, run_dir: str | Path, ignore_errors: bool = False) -> None:
    """Delete the directory `path`, which must lie strictly inside the run directory `run_dir`
    and not be a symbolic link. Every deletion of this module goes through here: the
    invariant is that klrl deletes nothing outside a run's own directory. A run directory is
    `output_dir/<run_name>` with a plain name (cluster/config/names.py), so a violation is a
    bug, raised as AssertionError before anything is deleted."""
    run, target = Path(os.path.abspath(run_dir)), Path(os.path.abspath(path))
    inside = Path(run_dir).name not in ("", ".", "..") and target.is_relative_to(run)
    if not inside or target == run or Path(path).is_symlink():  # not `assert`: never optimised away
        raise AssertionError(f"refusing to delete {path}: not a directory inside the run "
                             f"directory {run_dir}")
    shutil.rmtree(target, ignore_errors=ignore_errors)


def read_checkpoint(path: str | Path) -> ControllerState:
    path = Path(path)
    if not (path / MARKER).is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {MARKER} marker)")
    return ControllerState(**json.loads((path / "controller.json").read_text()))


def model_sha256(model_dir: str | Path) -> str:
    """Content hash of a model directory's weight files: the reference policy's identity.
    (A hub name on a cluster hashes as its name; weights are not fetched here.)"""
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.bin"))
    h = hashlib.sha256()
    if not files:
        h.update(str(model_dir).encode())
    for f in files:
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 24), b""):
                h.update(block)
    return h.hexdigest()


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
