"""What one trainer measured on one workload of `klrl bench --peer`, and the two figures both
sides of the comparison are reduced to by the same code:

- samples/s: the samples of the measured steps over their summed step times. Left out: the
  first `warmup` steps (a fresh process's allocator and kernels warm up; klrl's pipeline also
  fills there) and the last step (klrl's includes the final evaluation). Start-up (Ray, vLLM,
  DeepSpeed; TRL's model and reference loading) is not a step and never counts.
- reward gain per 1k samples: `cluster.train.gains.reward_gain_per_1k`, the
  definition the docs' learning figures use (mean batch reward of the last 10% of steps minus
  the first 10%, per 1,000 samples of the whole run).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from cluster.train.gains import reward_before_after, reward_gain_per_1k


def measured(step_seconds: list[float], warmup: int) -> list[float]:
    """The step times that count for samples/s (module docstring)."""
    return step_seconds[warmup:-1]


@dataclass
class PeerRun:
    """One trainer on one workload. step_seconds[i] and rewards[i] are step i's wall time and
    the mean task reward of the batch it trained on (one step = one batch of samples_per_step
    samples, whatever the trainer calls it)."""

    trainer: str                    # "klrl" or "trl"
    workload: str
    samples_per_step: int
    warmup: int
    step_seconds: list[float]
    rewards: list[float]
    wall_seconds: float             # the whole run, start-up included
    versions: dict[str, str] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)  # what ran (objective, threads, ...)
    learns: bool = True             # False: random weights, the reward is no signal

    def __post_init__(self) -> None:
        if len(self.step_seconds) != len(self.rewards):
            raise ValueError(f"{self.trainer}/{self.workload}: {len(self.step_seconds)} step "
                             f"times but {len(self.rewards)} rewards")
        if len(self.step_seconds) < self.warmup + 2:
            raise ValueError(f"{self.trainer}/{self.workload}: {len(self.step_seconds)} steps "
                             f"leave none to measure after {self.warmup} warm-up steps and "
                             "the last")

    @property
    def steps(self) -> int:
        return len(self.step_seconds)

    @property
    def measured_steps(self) -> int:
        return len(measured(self.step_seconds, self.warmup))

    @property
    def step_seconds_mean(self) -> float:
        return statistics.fmean(measured(self.step_seconds, self.warmup))

    @property
    def samples_per_s(self) -> float:
        return self.samples_per_step / self.step_seconds_mean

    @property
    def reward_gain_per_1k(self) -> float | None:
        return reward_gain_per_1k(self.rewards, self.samples_per_step) if self.learns else None

    def to_dict(self) -> dict[str, Any]:
        before, after = reward_before_after(self.rewards)
        return {
            "trainer": self.trainer, "workload": self.workload, "steps": self.steps,
            "samples_per_step": self.samples_per_step, "warmup_steps": self.warmup,
            "measured_steps": self.measured_steps, "samples_per_s": self.samples_per_s,
            "step_seconds_mean": self.step_seconds_mean,
            "reward_before": before, "reward_after": after,
            "reward_gain_per_1k_samples": self.reward_gain_per_1k,
            "wall_seconds": self.wall_seconds, "versions": self.versions,
            "settings": self.settings,
            "step_seconds": [round(s, 4) for s in self.step_seconds],
            "rewards": [round(r, 4) for r in self.rewards]}
