"""Whether the task gives the policy anything to learn from, step by step.

Under a group baseline (RLOO, GRPO, Dr. GRPO) a prompt group whose samples all got the same
reward has zero task advantage: it teaches nothing, however right or wrong its samples were.
`signal_metrics` logs the share of such groups every step (`reward/zero_spread_groups`, the
first thing a GRPO user checks), and `NoSignalWatch` says so, in the run's log and in wandb,
when the task advantage has been zero for `logging.no_signal_steps` steps in a row (every
reward 0, or every group's rewards equal), with what to check. A run can go on like that for
hundreds of steps with nothing but the KL term moving the policy.
"""
from __future__ import annotations

import torch

# Rewards (and advantages) closer than this count as equal: scorers return floats.
_EQUAL = 1e-9


def signal_metrics(rewards: torch.Tensor, group_ids: torch.Tensor) -> dict:
    """reward/zero_spread_groups: the share of the batch's prompt groups of two or more samples
    whose rewards are all equal (none logged when no group has two samples)."""
    spreads = [float(rewards[group_ids == g].max() - rewards[group_ids == g].min())
               for g in group_ids.unique() if int((group_ids == g).sum()) >= 2]
    if not spreads:
        return {}
    return {"reward/zero_spread_groups": sum(s <= _EQUAL for s in spreads) / len(spreads)}


class NoSignalWatch:
    """Counts the steps in a row whose task advantages are all zero; at `steps` of them (0:
    never) `update` returns the warning, once per such stretch."""

    def __init__(self, steps: int):
        self.steps, self.run, self.first = steps, 0, None

    def update(self, step: int, rewards: torch.Tensor, advantages: torch.Tensor) -> str | None:
        if not self.steps or bool((advantages.abs() > _EQUAL).any()):
            self.run = 0
            return None
        self.run += 1
        self.first = step if self.run == 1 else self.first
        if self.run != self.steps:
            return None
        where = f"no learning signal for {self.steps} steps in a row (steps {self.first}-{step})"
        if bool((rewards.abs() <= _EQUAL).all()):
            return (f"{where}: every reward was 0. Check that the scorer rewards a right answer "
                    "(task.reward; the completions in samples.jsonl), that completions are not "
                    "cut short (rollout.max_new_tokens against rollout/response_tokens_max), "
                    "and that the model solves some prompts at all (klrl eval)")
        return (f"{where}: within every prompt group the rewards were equal (mean "
                f"{float(rewards.mean()):.3f}; reward/zero_spread_groups 1), so the group "
                "baseline leaves a zero advantage. Check whether the prompts are all solved or "
                "all failed (samples.jsonl), that samples differ (rollout.temperature, "
                "rollout.samples_per_prompt), and that the scorer can give different rewards")
