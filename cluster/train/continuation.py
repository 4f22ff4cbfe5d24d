"""Continue this run? The one rule every launcher asks before it starts a run into a run
directory: `klrl train --resume-if-started` (what a Ray job resubmitted by `klrl submit
--max-resubmits` runs), each attempt of a `klrl slurm` job, each run of `klrl sweep` (local or
one Ray job each) and `make results --keep` when it puts kept runs back.

`continuation(run_dir, asked)` reads the run directory (nothing else: no process, no Ray) and
returns a `Continuation`: the `RunState` it found and the `Action` to take, with the checkpoint
a resume continues from and, for a refusal, the reason and the fix.

- ABSENT, nothing of a run (no directory, or one without config.yaml, metrics, a complete
  checkpoint or a final model): START.
- STARTED, a run without a complete checkpoint: RESUME (afresh: `train` sets the earlier logs
  aside).
- CHECKPOINTED, an unfinished run with a complete checkpoint: RESUME from it.
- FINISHED, the final model written (it is written last): SKIP as done; RESUME when asked to
  end later and a checkpoint is there to extend from; REFUSE when there is none.
- CHANGED, a run recorded with settings a continuation may not change
  (`run_meaning.resume_changes`): REFUSE, naming the keys.
- DAMAGED, a checkpoint marked complete whose files are not whole, or a config.yaml that is
  not YAML: REFUSE, naming the file and the fix.

Half-written leftovers that the writers' atomicity makes harmless are passed over and named in
`Continuation.ignored`: a metrics line cut by a crash (every reader skips it; a resume cuts the
log back to its checkpoint), a checkpoint directory without its COMPLETE marker (`.partial-*`,
or `step_N/`: never trusted, checkpoint.py), a final/ without its marker (the run resumes from
its last checkpoint and writes final/ again).

`asked` is the resolved config the run would be started with now, as a plain dict (None: do
not judge settings or a moved end, as `make results --keep` and a sweep's own bookkeeping,
whose runs the sweep checked against its settings first: `sweep.changed_runs`).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import yaml

from cluster.config.loader import ConfigError
from cluster.train import checkpoint as ckpt
from cluster.train.door.paths import resolve_paths
from cluster.train.door.resume import check_checkpoint
from cluster.train.run_log import (
    config_path,
    final_dir,
    has_metrics,
    is_finished,
    metrics_path,
    parse_row,
)
from cluster.train.run_meaning import resume_changes


class RunState(Enum):
    """What a run directory holds (the module docstring's table)."""

    ABSENT = "absent"
    STARTED = "started"
    CHECKPOINTED = "checkpointed"
    FINISHED = "finished"
    CHANGED = "recorded under other settings"
    DAMAGED = "half-written"


class Action(Enum):
    """What a launcher does with the run: `klrl train` without or with --resume, nothing, or
    nothing with the reason said."""

    START = "start"
    RESUME = "resume"
    SKIP = "skip as done"
    REFUSE = "refuse"


@dataclass(frozen=True)
class Continuation:
    """The rule's verdict on one run directory."""

    run_dir: Path
    state: RunState
    action: Action
    checkpoint: Path | None = None  # what RESUME continues from (None: afresh)
    reason: str = ""                # one line: what happens, or (REFUSE) why not and the fix
    ignored: tuple[str, ...] = ()   # half-written leftovers passed over (module docstring)

    @property
    def train_flags(self) -> list[str]:
        """The `klrl train` flags that carry the action out (START and RESUME only)."""
        return ["--resume"] if self.action is Action.RESUME else []

    @property
    def runs(self) -> bool:
        """Whether a launcher starts `klrl train` for it (START or RESUME)."""
        return self.action in (Action.START, Action.RESUME)


def continuation(run_dir: str | Path, asked: dict | None = None) -> Continuation:
    """The verdict on `run_dir` for a run asked for with the resolved config `asked` (a
    `model_dump(mode="json")`; None: settings not judged). Module docstring."""
    run_dir = Path(run_dir)
    ignored = _half_written(run_dir)

    def verdict(state: RunState, action: Action, reason: str,
                checkpoint: Path | None = None) -> Continuation:
        return Continuation(run_dir, state, action, checkpoint, reason, ignored)

    latest = ckpt.latest_checkpoint(run_dir)
    finished = is_finished(run_dir)
    if not (finished or latest or has_metrics(run_dir) or config_path(run_dir).is_file()):
        return verdict(RunState.ABSENT, Action.START, f"{run_dir} holds no run: starting it")
    try:  # read only to judge settings: a sweep's bookkeeping (asked None) needs none
        recorded = _recorded_config(run_dir) if asked is not None else None
    except ConfigError as exc:
        return verdict(RunState.DAMAGED, Action.REFUSE, str(exc))
    if asked is not None and recorded is not None \
            and (changes := resume_changes(recorded, asked)):
        return verdict(RunState.CHANGED, Action.REFUSE,
                       f"{run_dir} holds a run recorded with other settings "
                       f"({'; '.join(map(str, changes))}): it is not continued under these; "
                       "drop those overrides, or give the new settings a run (run_name) of "
                       "their own")
    if finished:
        return _finished(verdict, run_dir, asked, recorded, latest)
    if latest is None:
        return verdict(RunState.STARTED, Action.RESUME,
                       f"{run_dir} holds a run without a complete checkpoint: starting it "
                       "afresh, its earlier logs set aside")
    try:
        check_checkpoint(latest)
    except ConfigError as exc:
        return verdict(RunState.DAMAGED, Action.REFUSE, str(exc))
    return verdict(RunState.CHECKPOINTED, Action.RESUME,
                   f"{run_dir} holds the run: resuming it from {latest.name}", latest)


def _finished(verdict, run_dir: Path, asked: dict | None, recorded: dict | None,
              latest: Path | None) -> Continuation:
    """A finished run: done, unless `asked` moves its end (total_steps, data.epochs: what a
    resume may change) past the checkpoint it can extend from."""
    done = verdict(RunState.FINISHED, Action.SKIP, f"{run_dir} has finished already: nothing "
                                                   "to do")
    if asked is None or (recorded is not None and _end(recorded) == _end(asked)):
        return done
    if latest is None:
        if recorded is not None and asked["total_steps"] > recorded.get("total_steps", 0):
            return verdict(RunState.FINISHED, Action.REFUSE,
                           f"cannot extend {run_dir} to total_steps={asked['total_steps']}: "
                           "it finished and kept no checkpoint (checkpoint_every: 0); start a "
                           f"new run from its final weights (model.path={final_dir(run_dir)})")
        return done
    try:
        step = check_checkpoint(latest).step
    except ConfigError as exc:
        return verdict(RunState.DAMAGED, Action.REFUSE, str(exc))
    if step >= asked["total_steps"]:
        return done
    return verdict(RunState.FINISHED, Action.RESUME,
                   f"{run_dir} finished at step {step}: extending it to total_steps="
                   f"{asked['total_steps']} from {latest.name}", latest)


def _end(config: dict) -> tuple:
    """Where a run ends (run_meaning.RESUME_MAY_CHANGE)."""
    return config.get("total_steps"), (config.get("data") or {}).get("epochs")


def _recorded_config(run_dir: Path) -> dict | None:
    """The config.yaml the run's last start wrote (None: none there); ConfigError when it is
    not a YAML mapping (cut short)."""
    path = config_path(run_dir)
    if not path.is_file():
        return None
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        data = exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is not a config (cut short?: {type(data).__name__}); put "
                          "the run's config back, or move the run directory aside to start it "
                          "anew")
    return data


def _half_written(run_dir: Path) -> tuple[str, ...]:
    """What a crash left half-written in `run_dir` that every reader passes over."""
    found = []
    metrics = metrics_path(run_dir)
    if metrics.is_file():
        with open(metrics, "rb") as f:  # only the tail: the writer cuts at most the last line
            f.seek(max(0, metrics.stat().st_size - 8192))
            tail = f.read().decode(errors="replace").splitlines()
        if tail and tail[-1].strip() and parse_row(tail[-1]) is None:
            found.append(f"{metrics.name}: its last line is cut")
    root = ckpt.checkpoint_root(run_dir)
    if root.is_dir():
        complete = set(ckpt.complete_checkpoints(root))
        found += [f"{root.name}/{p.name}: no {ckpt.MARKER} marker" for p in sorted(root.iterdir())
                  if p.is_dir() and p not in complete]
    final = final_dir(run_dir)
    if final.is_dir() and not is_finished(run_dir):
        found.append(f"{final.name}/: written in part (no config.json)")
    return tuple(found)


def continuation_of(cfg) -> Continuation:
    """The verdict on the run a TrainConfig names (run_name set), asked with its settings as a
    start would resolve them (door/paths.py)."""
    cfg = resolve_paths(cfg)
    return continuation(Path(cfg.output_dir) / cfg.run_name, cfg.model_dump(mode="json"))
