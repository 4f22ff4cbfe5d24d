"""Stopping a run early, cleanly: `RunStopped` and the SIGINT/SIGTERM policy.

First SIGINT or SIGTERM: the controller finishes the step it is in, writes a checkpoint and
exits with 128 + the signal number (130, 143), leaving no actor behind. Second signal: stop
at once (KeyboardInterrupt: actors are still killed on the way out, no checkpoint is written;
the previous one remains loadable because checkpoints are atomic).
"""
from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Self

HANDLED = (signal.SIGINT, signal.SIGTERM)


class RunStopped(RuntimeError):
    """The run stops early but cleanly: the controller checkpoints, then re-raises.
    `exit_code` is what `klrl train` exits with; `checkpoint` (the one to resume from, None if
    there is none) and `run_dir` are set by the controller. `write_checkpoint=False`: the
    learner cannot write one (it hung), so `checkpoint` is the last complete one."""

    def __init__(self, message: str, exit_code: int = 1, write_checkpoint: bool = True):
        super().__init__(message)
        self.exit_code, self.write_checkpoint = exit_code, write_checkpoint
        self.checkpoint: Path | None = None
        self.run_dir: Path | None = None


class GracefulStop:
    """Installs the two-signal policy above for the duration of a `with` block (main thread
    only; elsewhere it does nothing). Call the instance to poll: a RunStopped or None."""

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict = {}

    def __enter__(self) -> Self:
        try:
            self._previous = {s: signal.signal(s, self._handle) for s in HANDLED}
        except ValueError:  # not the main thread: signals stay as they are
            self._previous = {}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _handle(self, signum, _frame) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt(f"second signal ({signal.Signals(signum).name}): stopping now")
        self.signum = signum
        print(f"\n{signal.Signals(signum).name}: stopping after this step with a checkpoint "
              "(send it again to stop at once)", file=sys.stderr, flush=True)

    def __call__(self) -> RunStopped | None:
        if self.signum is None:
            return None
        name = signal.Signals(self.signum).name
        return RunStopped(f"stopped by {name}", exit_code=128 + self.signum)
