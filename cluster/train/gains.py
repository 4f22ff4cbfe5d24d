"""How much a run's training reward rose per sample: the one definition of "reward gain per 1k
samples" that the docs' learning figures (`klrl figures`) and `klrl bench --peer` both use."""
from __future__ import annotations

import statistics
from collections.abc import Sequence

TAIL = 0.1  # the training reward "before" and "after": means over the first and last 10% of steps


def reward_before_after(rewards: Sequence[float]) -> tuple[float, float]:
    """The training reward "before" and "after" a run: the means of its steps' batch rewards
    over the first and the last TAIL of its steps (at least one step each)."""
    if not rewards:
        raise ValueError("no training steps")
    k = max(1, round(TAIL * len(rewards)))
    return statistics.fmean(rewards[:k]), statistics.fmean(rewards[-k:])


def per_1k(gain: float, samples: int) -> float:
    """A gain per 1,000 training samples (samples: all the run trained on)."""
    return 1000 * gain / samples


def reward_gain_per_1k(rewards: Sequence[float], samples_per_step: int) -> float:
    """Training reward gained per 1,000 samples: after - before (`reward_before_after`) over
    every sample of the run, len(rewards) steps x samples_per_step."""
    before, after = reward_before_after(rewards)
    return per_1k(after - before, len(rewards) * samples_per_step)
