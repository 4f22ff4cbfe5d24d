"""learner.lr_schedule, one table: its names (`LRSchedule`) and what each does after warm-up
(`LR_SCHEDULES`): whether it decays, and its factor along the decay. learner/schedule.py turns
an entry into the learning rate of each optimizer step (the formulas are in its docstring);
the configs ask the entry whether it decays instead of comparing its name. Torch-free: the
config reads it.

Adding a schedule: its name in `LRSchedule`, its entry in `LR_SCHEDULES` (checked at import to
key exactly the Literal's names), and its formula in learner/schedule.py's docstring.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from kl.registry import literal_names, lookup

LRSchedule = Literal["constant", "linear", "cosine"]


@dataclass(frozen=True)
class LRScheduleForm:
    """One learner.lr_schedule after warm-up.

    decay: (p, m) -> the multiplier of learner.lr at progress p in [0, 1] through the decay
        (0 at step warmup_steps, 1 at the run's last optimizer step) toward m =
        learner.min_lr_ratio; None: no decay, the multiplier stays 1 (and the run's number of
        optimizer steps and min_lr_ratio mean nothing to it).
    """

    decay: Callable[[float, float], float] | None

    @property
    def decays(self) -> bool:
        """Whether it decays after warm-up (then it needs the run's optimizer steps)."""
        return self.decay is not None


LR_SCHEDULES: dict[str, LRScheduleForm] = {
    "constant": LRScheduleForm(None),
    "linear": LRScheduleForm(lambda p, m: 1.0 - (1.0 - m) * p),
    "cosine": LRScheduleForm(lambda p, m: m + (1.0 - m) * 0.5 * (1.0 + math.cos(math.pi * p))),
}
LR_SCHEDULE_NAMES: tuple[str, ...] = literal_names(
    LRSchedule, LR_SCHEDULES, table_name="learner.lr_schedules.LR_SCHEDULES",
    literal_name="LRSchedule", kind="learning-rate schedules")
DECAYING: tuple[str, ...] = tuple(n for n, f in LR_SCHEDULES.items() if f.decays)
STEADY: tuple[str, ...] = tuple(n for n, f in LR_SCHEDULES.items() if not f.decays)


def lr_schedule(name: str) -> LRScheduleForm:
    """The entry of learner.lr_schedule `name` (refused, with the supported listed)."""
    return lookup(LR_SCHEDULES, name, "learner.lr_schedule")
