"""Engine progress, reported apart from answering probes: how many steps a rollout worker's
engine has taken, and how long the step under way has run (`EngineProgress`).

A worker whose process answers may still have a wedged engine (a GPU kernel that never
returns, a tensor-parallel rank stuck in a collective, a deadlock in the engine): the health
probe sees the process, not the engine. Every engine step of every generation mode goes
through `LLMEngine.step` on the engine thread (batch-level: `LLM.generate`'s own step loop;
continuous: the `ContinuousEngine` loop), so `StepWatch` wraps that one method on the engine
object and records when the step under way began; the worker reports it from its health
thread (`RolloutWorker.engine_progress`), and the controller treats a generate or evaluate
call whose engine has been in one step past `faults.engine_stall_s` as a hung worker
(cluster/train/worker_pool.py). Only time inside a step counts: a worker queueing calls, or
idle, or reloading weights (bounded by `sync.timeout_s` on its own), makes no step and is not
stalled.

`WEDGE_ENV` is a test-only hook: where the environment names a file, the first step that finds
it removes it and blocks its thread forever, wedging the engine of a process that still
answers (tests/test_faults.py). Unset, as in every real run, it costs nothing per step.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

WEDGE_ENV = "KLRL_TEST_WEDGE_ENGINE"


@dataclass(frozen=True)
class EngineProgress:
    """A worker's engine progress as read now: `steps` ended since the engine was built, and
    `step_running_s`, how long the step under way has run (0.0 when none is)."""

    steps: int
    step_running_s: float


class StepWatch:
    """Wraps `engine.step` (vLLM's `LLMEngine`: the instance's attribute, which `LLM.generate`
    and the continuous loop both call) to count steps and time the one under way. Written on
    the engine thread, read from any: each field is one assignment (atomic under the GIL)."""

    def __init__(self, engine):
        self.steps = 0
        self._since: float | None = None  # monotonic start of the step under way
        step, wedge = engine.step, os.environ.get(WEDGE_ENV)

        def watched_step(*args, **kwargs):
            self._since = time.monotonic()
            try:
                if wedge:
                    _wedge_once(wedge)
                return step(*args, **kwargs)
            finally:
                self._since = None
                self.steps += 1

        engine.step = watched_step

    def progress(self) -> EngineProgress:
        since = self._since
        return EngineProgress(self.steps, 0.0 if since is None else time.monotonic() - since)


def _wedge_once(marker: str) -> None:
    """The test hook (module docstring): block forever if this call removes `marker`."""
    try:
        os.remove(marker)  # one step of one worker wins: the others find no file
    except FileNotFoundError:
        return
    threading.Event().wait()
