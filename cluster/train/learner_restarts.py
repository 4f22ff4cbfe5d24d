"""Restarting the learner inside a run: which failures a restart heals, its bound
(`faults.max_learner_restarts`), and what each restart cost.

A learner failure (a rank that died, a call that raised in a rank, a call that hung:
cluster/train/deadlines.py) leaves the group broken: its ranks may be blocked in a collective
with the failed one, so the whole group goes. The run's recovery (recovery.py) then does in
the run what `klrl train --resume` does after it: a new group loads the last complete
checkpoint, the rollout workers are given its weights (kept with their engines, their calls in
flight settled, where the transport allows: `WeightTransport.engines_outlive_the_learner`;
started again otherwise), the data position goes back to the checkpoint's (the batches that
were in flight are generated again, from the same prompts and seeds) and the logs are cut back
to its step. So the guarantees of resume hold for a restart: bit-identical at max_lag 0,
nothing skipped or trained twice above it (docs/checkpoints.md).
"""
from __future__ import annotations

from dataclasses import dataclass

from ray.exceptions import RayError

from cluster.train.deadlines import LearnerHung
from cluster.train.error_line import error_line
from cluster.train.stopping import RunStopped


class LearnerRestartsExhausted(RunStopped):
    """The learner failed once more than `faults.max_learner_restarts` allows: the run stops,
    keeping its last complete checkpoint (a broken group cannot write one)."""

    def __init__(self, message: str):
        super().__init__(message, write_checkpoint=False)


def heals(failure: BaseException, learner) -> bool:
    """Whether a learner restart answers `failure`: the learner group broke (a rank died, hung,
    or raised in a call; LearnerGroup.broken) and not on a broken invariant (an AssertionError
    in a rank is a bug in klrl: its traceback is the news, and a replay would repeat it)."""
    return (learner is not None and learner.broken and isinstance(failure, (RayError, LearnerHung))
            and not isinstance(failure, AssertionError))


def failure_line(failure: BaseException, learner) -> str:
    """One line on what failed: the hang's own message, or the failed call and its error."""
    if isinstance(failure, LearnerHung):
        return str(failure).removesuffix("; its last complete checkpoint is kept")
    where = f" ({learner.failure})" if getattr(learner, "failure", None) else ""
    return f"the learner failed{where}: {error_line(failure, 200)}"


@dataclass
class LearnerRestarts:
    """The run's learner restarts and the steps they cost (trained, then redone from the
    checkpoint); both carried in checkpoints, so they count over the whole run."""

    limit: int
    count: int = 0
    steps_lost: int = 0

    def take(self, why: str, step: int, back_to: int) -> None:
        """Count a restart from step `step` back to `back_to`; LearnerRestartsExhausted when
        none is left."""
        if self.count >= self.limit:
            raise LearnerRestartsExhausted(
                f"{why}; all faults.max_learner_restarts={self.limit} learner restarts are used "
                "up, so the run stops here")
        self.count += 1
        self.steps_lost += step - back_to

    def describe(self, back_to_name: str, step: int, back_to: int, seconds: float,
                 workers_kept: bool) -> str:
        lost = step - back_to
        redone = (f"steps {back_to + 1}-{step} are redone" if lost > 1 else
                  f"step {step} is redone" if lost == 1 else "no trained step is lost")
        workers = ("rollout workers kept, rewound to its weights" if workers_kept
                   else "rollout workers started again")
        return (f"learner restarted from {back_to_name} in {seconds:.1f}s "
                f"(restart {self.count}/{self.limit}; {workers}): {redone} ({lost} lost; "
                f"{self.steps_lost} over the run)")

    def metrics(self) -> dict[str, int]:
        return {"faults/learner_restarts": self.count,
                "faults/learner_steps_lost": self.steps_lost}
