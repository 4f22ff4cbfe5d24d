"""Dynamic sampling (DAPO) that stays honest under asynchrony (`dynamic_sampling.enabled`).

A prompt group whose samples all got the same task reward has zero task advantage under a
group baseline: it spends a step's samples on nothing but the KL term. `DynamicSampler.fill`
drops such groups and takes the next global batches from the stream until the step holds
`rollout.prompts_per_step` groups with spread, then trains exactly that many:

- **The task's reward, not the shaped one.** Spread is judged on `Rollout.reward`, the
  scorer's reward before overlong shaping (task.overlong) and the KL reward: for a 0/1 task,
  its accuracy. A penalty that differs between equally wrong samples would otherwise keep a
  group the task says nothing about (NeMo-RL #2431).
- **Lag.** Every batch is taken through the controller's `_take_batch` at the current step,
  which drops (and counts) anything older than max_lag; replacements are requested at the
  current weights, so their lag is 0 batch-level and never above max_lag. The kept rollouts'
  lags are logged as for any step (lag/*, recomputed over what trains) and the replacements'
  apart (dynamic_sampling/replacement_lag_max, _mean).
- **Full batches, no carry.** Groups beyond the batch are discarded, as verl does: a carried
  group would age past max_lag and would be lost by a resume, which replays the stream from
  the oldest batch in flight. When `max_batches_per_step` batches (or the data's epochs) are
  used up first, the batch is completed with the earliest zero-spread groups, which still
  carry their KL term (dynamic_sampling/filled_zero_spread).
- **What it costs and biases** (logged each step): the share of groups dropped
  (dynamic_sampling/dropped_share), the extra generation (dynamic_sampling/extra_batches and
  extra_samples: samples generated beyond the batch), and the bias toward prompts of middling
  difficulty: the mean task reward of the trained samples against all generated ones
  (dynamic_sampling/trained_reward_mean, generated_reward_mean). The policy is trained on a
  prompt distribution conditioned on a spread under the current policy, not on the task's.

Under a group baseline a zero-spread group's task term is exactly 0 (its advantages are 0 for
rloo, grpo and drgrpo), so dropping it changes the task gradient of a batch of N sequences
only through N (the constant every term is divided by) and the replacement groups; its KL term
is not 0, and goes with it (tests/test_dynamic_sampling.py).
"""
from __future__ import annotations

from collections.abc import Callable

from actors.records import Rollout
from cluster.train.staleness import token_lag_metrics

# Rewards closer than this count as equal: scorers return floats (learning_signal's rule).
_EQUAL = 1e-9

TakeBatch = Callable[[], "tuple[list[Rollout], dict] | None"]


def has_spread(group: list[Rollout]) -> bool:
    """Whether the group's task rewards (scorer's, unshaped) are not all equal."""
    rewards = [r.reward for r in group]
    return max(rewards) - min(rewards) > _EQUAL


def groups_of(rollouts: list[Rollout]) -> list[list[Rollout]]:
    """The rollouts' prompt groups, in order of first appearance."""
    out: dict[int, list[Rollout]] = {}
    for r in rollouts:
        out.setdefault(r.group_id, []).append(r)
    return list(out.values())


class DynamicSampler:
    """Fills a step's batch with `prompts` groups that have spread (module docstring)."""

    def __init__(self, prompts: int, max_batches: int, updates_per_batch: int = 1):
        self.prompts, self.max_batches = prompts, max_batches
        self.updates = updates_per_batch

    def fill(self, take: TakeBatch, step: int) -> tuple[list[Rollout], dict]:
        """`take()` returns the next global batch (rollouts, its generation metrics) taken at
        `step`, or None when the stream has none; returns the step's rollouts and the metrics
        of the first batch, with lag/* recomputed over what trains and dynamic_sampling/*."""
        first = take()
        if first is None:
            raise RuntimeError("dynamic sampling: no batch to take")
        rollouts, metrics = first
        kept: list[list[Rollout]] = []
        flat: list[list[Rollout]] = []
        generated: list[Rollout] = []
        replacements: list[Rollout] = []
        batches = 0
        while True:
            batches += 1
            generated += rollouts
            for group in groups_of(rollouts):
                (kept if has_spread(group) else flat).append(group)
                if batches > 1 and has_spread(group):
                    replacements += group
            if len(kept) >= self.prompts or batches >= self.max_batches:
                break
            nxt = take()
            if nxt is None:
                break
            rollouts = nxt[0]
        filled = max(0, self.prompts - len(kept))
        trained = kept[:self.prompts] + flat[:filled]
        out = [r for group in trained for r in group]
        seen = len(kept) + len(flat)
        lags = [step - r.policy_version for r in out]
        metrics = metrics | token_lag_metrics(out, step) | {
            "lag/max": max(lags), "lag/mean": sum(lags) / len(lags),
            "lag/max_optimizer_steps": max(lags) * self.updates + self.updates - 1,
            "dynamic_sampling/dropped_share": len(flat) / seen,
            "dynamic_sampling/extra_batches": batches - 1,
            "dynamic_sampling/extra_samples": len(generated) - len(out),
            "dynamic_sampling/filled_zero_spread": filled,
            "dynamic_sampling/trained_reward_mean": sum(r.reward for r in out) / len(out),
            "dynamic_sampling/generated_reward_mean":
                sum(r.reward for r in generated) / len(generated),
        }
        trained_replacements = {id(r) for r in out} & {id(r) for r in replacements}
        if trained_replacements:
            rep = [step - r.policy_version for r in replacements if id(r) in trained_replacements]
            metrics |= {"dynamic_sampling/replacement_lag_max": max(rep),
                        "dynamic_sampling/replacement_lag_mean": sum(rep) / len(rep)}
        return out, metrics
