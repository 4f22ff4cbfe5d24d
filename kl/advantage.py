"""Advantage estimators over groups of n samples per prompt, and the KL reward inside them.

Baselines (per group of samples of one prompt):
- rloo:      leave-one-out mean of the other samples (unbiased; needs n >= 2)
- grpo:      group mean including the sample (scales the gradient by (n-1)/n) and group std
- drgrpo:    group mean, no std (Dr. GRPO)
- reinforce: no baseline
Scale (`normalize`): none, group (per-group std) or batch (std over the whole batch).

The KL penalty as a per-token reward (reward-to-go R_t = sum_{t'>=t} k_t, beta > 0):
- separate (default): normalise the task part only and add -beta * (R_t - b_K) unnormalised,
  b_K = kl_baseline: the leave-one-out mean of the other samples' sequence KLs whatever the
  task estimator (none with reinforce). b_K never depends on the sample, so the KL part of the
  update is exactly beta times the KL-in-reward gradient, whatever the task rewards and the
  task estimator are (a group mean including the sample would scale it by (n-1)/n).
- normalized: fold the KL into each sample's sequence return G = r - beta * K, then centre and
  normalise G like a task reward and give it to every token (verl's form). Identical responses
  get 0, and with `group` every advantage stays within the group bound (sqrt(n-1) for grpo,
  n/sqrt(n-1) for rloo). Without a std the expected gradient on-policy is grad E[r] - beta g*
  (rloo, reinforce) or (n-1)/n of it (drgrpo). With a std each group's update is divided by
  its own sigma: the effective beta becomes beta / sigma per prompt, with no closed form, and
  on a prompt whose task reward is constant the KL part no longer scales with beta at all.
- centered: the form of the paper authors' code (Shah et al., tba-prime): each token's
  estimate clamped to [-KL_CLAMP, KL_CLAMP], summed over the sequence, centred by the mean of
  those sums over the group (the sample included), and -beta times that added to every
  token's task advantage. No std, no reward-to-go: with K1 and no clamping its expected
  gradient on-policy is (n-1)/n times the KL gradient (the group mean includes the sample).
  Per group its gradient has less variance than separate's reward-to-go on the enumerable toy,
  but more per unit of expected step (docs/kl.md). (Their centring mean used the behaviour
  policy's log-probs and the per-sample sum the current policy's; here both use the current
  policy.)
The folded forms (normalized, centered) replace the task advantage, so off-policy they go
through learner.task_off_policy: tis weights and ppo_clip clips the KL part with the task part.
"""
from __future__ import annotations

from typing import Literal

import torch

AdvantageEstimator = Literal["rloo", "grpo", "drgrpo", "reinforce"]
Normalization = Literal["none", "group", "batch"]
KLInAdvantage = Literal["separate", "normalized", "centered"]
KL_IN_ADVANTAGE: tuple[str, ...] = ("separate", "normalized", "centered")
KL_CLAMP = 10.0  # per-token clamp of the `centered` form, as in the authors' code


def _group_sums(values: torch.Tensor, group_ids: torch.Tensor):
    groups, inverse = torch.unique(group_ids, return_inverse=True)
    sums = torch.zeros(len(groups), dtype=values.dtype, device=values.device).index_add_(0, inverse, values)
    counts = torch.zeros(len(groups), dtype=values.dtype, device=values.device).index_add_(
        0, inverse, torch.ones_like(values))
    return sums[inverse], counts[inverse]


def group_baseline(values: torch.Tensor, group_ids: torch.Tensor, estimator: AdvantageEstimator) -> torch.Tensor:
    """Per-sample baseline [B] from the values [B] of its group."""
    if estimator == "reinforce":
        return torch.zeros_like(values)
    sums, counts = _group_sums(values, group_ids)
    if estimator == "rloo":
        if bool((counts < 2).any()):
            raise ValueError("rloo needs at least 2 samples per group (n_samples_per_prompt >= 2)")
        return (sums - values) / (counts - 1)
    if estimator in ("grpo", "drgrpo"):
        return sums / counts
    raise ValueError(f"unknown advantage estimator {estimator!r}")


def kl_baseline(values: torch.Tensor, group_ids: torch.Tensor, estimator: AdvantageEstimator) -> torch.Tensor:
    """Per-sample baseline [B] of the KL reward (`separate`): the leave-one-out mean of the other
    samples' values in the group whatever the task estimator (0 in a group of one), or no
    baseline with `reinforce`. It never includes the sample itself, so it is independent of
    it: its term has zero expectation on-policy and, importance-weighted, off-policy, and the
    KL part stays exactly beta times the KL gradient with grpo and drgrpo too (a group mean
    including the sample would scale it by (n-1)/n)."""
    if estimator == "reinforce":
        return torch.zeros_like(values)
    if estimator not in ("rloo", "grpo", "drgrpo"):
        raise ValueError(f"unknown advantage estimator {estimator!r}")
    sums, counts = _group_sums(values, group_ids)
    return torch.where(counts > 1, (sums - values) / (counts - 1).clamp_min(1), 0.0)


def group_scale(values: torch.Tensor, group_ids: torch.Tensor, normalize: Normalization, eps: float) -> torch.Tensor:
    """Per-sample divisor [B]: 1, the group's std, or the batch std (population std, + eps)."""
    if normalize == "none":
        return torch.ones_like(values)
    if normalize == "batch":
        return (values.std(unbiased=False) + eps).expand_as(values)
    if normalize == "group":
        sums, counts = _group_sums(values, group_ids)
        sq, _ = _group_sums(values * values, group_ids)
        var = (sq / counts - (sums / counts) ** 2).clamp_min(0.0)
        return var.sqrt() + eps
    raise ValueError(f"unknown normalization {normalize!r}")


def compute_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    estimator: AdvantageEstimator = "rloo",
    normalize: Normalization = "group",
    kl_tokens: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    beta: float = 0.0,
    kl_in_advantage: KLInAdvantage = "separate",
    eps: float = 1e-6,
) -> torch.Tensor:
    """Advantages for a batch of B samples.

    Args:
        rewards: [B] task rewards. group_ids: [B] prompt id of each sample.
        kl_tokens: optional [B, T] per-token KL estimates (detached, e.g. kl.estimate(...)) to
            add as a per-token cost -beta * k_t; then the result is per token, [B, T].
        mask: [B, T] response mask (required with kl_tokens).
    Returns [B] (task only) or [B, T] (with the KL reward; 0 on masked positions).
    """
    rewards = rewards.detach().to(torch.float64)
    if kl_tokens is None or beta == 0.0:
        task = (rewards - group_baseline(rewards, group_ids, estimator)) / group_scale(
            rewards, group_ids, normalize, eps)
        if kl_tokens is None:
            return task
        return task[:, None] * mask.to(task.dtype)
    if mask is None:
        raise ValueError("mask is required with kl_tokens")
    m = mask.bool()
    k = torch.where(m, kl_tokens.detach().to(torch.float64), 0.0)
    to_go = k.flip(-1).cumsum(-1).flip(-1)  # R_t
    seq_kl = k.sum(-1)                        # K_i
    if kl_in_advantage == "separate":
        task = (rewards - group_baseline(rewards, group_ids, estimator)) / group_scale(
            rewards, group_ids, normalize, eps)
        kl_part = -beta * (to_go - kl_baseline(seq_kl, group_ids, estimator)[:, None])
        return torch.where(m, task[:, None] + kl_part, 0.0)
    if kl_in_advantage == "normalized":
        # One sequence-level return per sample, normalised like a task reward and given to
        # every token (verl's form). A per-token return-to-go here would not be centred by a
        # per-sequence baseline: identical responses would keep beta x (KL before t) and be
        # divided by a zero std.
        seq_return = rewards - beta * seq_kl
        adv = (seq_return - group_baseline(seq_return, group_ids, estimator)) / group_scale(
            seq_return, group_ids, normalize, eps)
        return torch.where(m, adv[:, None], 0.0)
    if kl_in_advantage == "centered":
        task = (rewards - group_baseline(rewards, group_ids, estimator)) / group_scale(
            rewards, group_ids, normalize, eps)
        seq_clamped = k.clamp(-KL_CLAMP, KL_CLAMP).sum(-1)  # masked positions are 0 already
        kl_part = -beta * (seq_clamped - group_baseline(seq_clamped, group_ids, "grpo"))
        return torch.where(m, (task + kl_part)[:, None], 0.0)
    raise ValueError(f"kl_in_advantage must be one of {KL_IN_ADVANTAGE}, got {kl_in_advantage!r}")
