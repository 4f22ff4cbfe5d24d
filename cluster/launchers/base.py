"""The launcher protocol: what `klrl submit`, `klrl sweep`, `klrl slurm` and a resubmission
ask of whatever starts a run (a local process, a Ray job, a SLURM job), and the request they
hand it.

A launcher starts `klrl COMMAND CONFIG OVERRIDES FLAGS` somewhere (`start`, returning its own
handle), says whether it has ended and with which exit code (`poll`; a launcher that can
resubmit a run whose driver was lost does so there, within its budget, and reports the run as
still going), passes a stop on (`stop`: `klrl train` checkpoints on the first signal) and says
where its output is (`where`). Whether a run is started, resumed, skipped or refused is not a
launcher's choice: its FLAGS come from the one continuation rule (cluster/train/continuation.py),
read where the run is asked for (`RunRequest.for_run`) or, for a resubmission, where it runs
again (`RESUME_IF_STARTED`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

from cluster.train.continuation import Continuation

# What a resubmitted or requeued run adds to `klrl train`: ask the continuation rule again
# where it runs (the lost driver may have started the run, checkpointed or finished it).
RESUME_IF_STARTED = "--resume-if-started"


class SubmitError(Exception):
    """A run that cannot be launched as asked: one line saying why and what to do (exit 2)."""


@dataclass(frozen=True)
class RunRequest:
    """What a launcher starts: `klrl COMMAND CONFIG OVERRIDES FLAGS`, under `name` (the run's or
    sweep's, which names its log, job or script)."""

    name: str
    config: str
    overrides: tuple[str, ...] = ()
    flags: tuple[str, ...] = ()   # the continuation verdict's (--resume), or RESUME_IF_STARTED
    command: Literal["train", "sweep"] = "train"

    @classmethod
    def for_run(cls, name: str, config: str, overrides, verdict: Continuation) -> RunRequest:
        """A training run as the continuation rule's verdict on its directory says."""
        return cls(name, config, tuple(overrides), tuple(verdict.train_flags))

    def args(self) -> list[str]:
        """The `klrl` arguments (after `python -m cluster.cli`)."""
        return [self.command, self.config, *self.overrides, *self.flags]


class Launcher(Protocol):
    """Starts runs somewhere and follows them (module docstring). Handles are the launcher's
    own."""

    def start(self, request: RunRequest) -> Any:
        """Start the run; its handle."""

    def poll(self, handle: Any) -> int | None:
        """None while the run goes on (or was resubmitted); its exit code once it ended."""

    def stop(self, handle: Any, signum: int) -> None:
        """Pass a stop on (the run checkpoints, then exits)."""

    def where(self, handle: Any) -> str:
        """Where the run's output is, for people."""
