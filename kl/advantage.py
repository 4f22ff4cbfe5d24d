"""Advantage estimators over groups of n samples per prompt, and the KL reward inside them.

Baselines (per group of samples of one prompt):
- rloo:      leave-one-out mean of the other samples (unbiased; needs n >= 2)
- grpo:      group mean including the sample (scales the gradient by (n-1)/n) and group std
- drgrpo:    group mean, no std (Dr. GRPO)
- reinforce: no baseline
Scale (`normalize`): none, group (per-group std) or batch (std over the whole batch).
Each estimator is an entry of ADVANTAGE_ESTIMATORS (its Baseline, the fewest samples per group
it accepts and the normalisation its name means), each normalisation one of NORMALIZATIONS and
each form of the KL reward below one of KL_IN_ADVANTAGE_FORMS, in kl.registry's form: the
configs, the learner and the exact tables ask these entries, so each rule has one home.

The KL penalty as a per-token reward (reward-to-go R_t = sum_{t'>=t} k_t, beta > 0):
- separate (default): normalise the task part only and add -beta * (R_t - b_K) unnormalised,
  b_K = kl_baseline: the leave-one-out mean of the other samples' sequence KLs whatever the
  task estimator (none with reinforce). b_K never depends on the sample, so the KL part of the
  update is exactly beta times the KL-in-reward gradient, whatever the task rewards and the
  task estimator are (a group mean including the sample would scale it by (n-1)/n).
- normalized: fold the KL into each sample's sequence return G = r - beta * K, then centre and
  normalise G like a task reward and give it to every token (verl's form). Identical responses
  get 0, and with `group` every advantage stays within the group bound (sqrt(n-1) for grpo,
  n/sqrt(n-1) for rloo). Without a std the expected gradient on-policy is grad E[r] minus beta
  times the reward placement's gradient of the estimator (g* with k1; k2 and k3 keep their
  reward-placement bias), with rloo or reinforce, or (n-1)/n of it (drgrpo). With a std
  each group's update is divided by its own sigma: the effective beta becomes beta / sigma
  per prompt, with no closed form, and on a prompt whose task reward is constant the KL part
  no longer scales with beta at all.
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

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kl.registry import literal_names, lookup
from kl.traits import (
    ADVANTAGE_ESTIMATOR_TRAITS,
    KL_IN_ADVANTAGE_TRAITS,
    NORMALIZATION_TRAITS,
    AdvantageEstimator,
    AdvantageEstimatorTraits,
    KLInAdvantage,
    KLInAdvantageTraits,
    Normalization,
    NormalizationTraits,
    check_group_size,
)

KL_CLAMP = 10.0  # per-token clamp of the `centered` form, as in the authors' code


def _group_sums(values: torch.Tensor, group_ids: torch.Tensor):
    groups, inverse = torch.unique(group_ids, return_inverse=True)
    sums = torch.zeros(len(groups), dtype=values.dtype, device=values.device).index_add_(
        0, inverse, values)
    counts = torch.zeros(len(groups), dtype=values.dtype, device=values.device).index_add_(
        0, inverse, torch.ones_like(values))
    return sums[inverse], counts[inverse]


# ---- baselines ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Baseline:
    """A per-sample baseline computed from the values of the sample's prompt group.

    of: (values [B], group_ids [B]) -> the baseline [B].
    expected_scale: n -> the factor subtracting it puts on the expected gradient in a group of
        n (1 when it never depends on the sample itself).
    group_std_bound: n -> the most |A| can be once the centred values are divided by their
        group's std (n >= 2); None: nothing bounds it.
    """

    of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    expected_scale: Callable[[int], float]
    group_std_bound: Callable[[int], float] | None


def _leave_one_out_mean(values: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    sums, counts = _group_sums(values, group_ids)
    return (sums - values) / (counts - 1)


def _group_mean(values: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    sums, counts = _group_sums(values, group_ids)
    return sums / counts


LEAVE_ONE_OUT = Baseline(_leave_one_out_mean, lambda n: 1.0, lambda n: n / math.sqrt(n - 1))
# The mean includes the sample, so it scales the expected gradient by (n-1)/n.
GROUP_MEAN = Baseline(_group_mean, lambda n: (n - 1) / n, lambda n: math.sqrt(n - 1))
NO_BASELINE = Baseline(lambda values, group_ids: torch.zeros_like(values), lambda n: 1.0, None)


# ---- normalisations -----------------------------------------------------------------------

@dataclass(frozen=True)
class Scale:
    """One advantage.normalize: the divisor of each centred value.

    of: (values [B], group_ids [B], eps) -> the divisor [B].
    traits: what it is (kl.traits, their one home: within_group, meaning).
    """

    of: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    traits: NormalizationTraits

    @property
    def within_group(self) -> bool:
        return self.traits.within_group

    @property
    def meaning(self) -> str:
        return self.traits.meaning


def _group_std(values: torch.Tensor, group_ids: torch.Tensor, eps: float) -> torch.Tensor:
    sums, counts = _group_sums(values, group_ids)
    sq, _ = _group_sums(values * values, group_ids)
    var = (sq / counts - (sums / counts) ** 2).clamp_min(0.0)
    return var.sqrt() + eps


NORMALIZATIONS: dict[str, Scale] = {
    "none": Scale(lambda values, group_ids, eps: torch.ones_like(values),
                  NORMALIZATION_TRAITS["none"]),
    "group": Scale(_group_std, NORMALIZATION_TRAITS["group"]),
    "batch": Scale(lambda values, group_ids, eps: (values.std(unbiased=False) + eps).expand_as(
        values), NORMALIZATION_TRAITS["batch"]),
}
literal_names(Normalization, NORMALIZATIONS, table_name="kl.advantage.NORMALIZATIONS",
              literal_name="Normalization", kind="normalisations")


# ---- advantage estimators -----------------------------------------------------------------

@dataclass(frozen=True)
class AdvantageEstimatorSpec:
    """One advantage.estimator: its baseline, and what it requires (its traits, whose one home
    is kl.traits: the fewest samples per group and why, the normalisation its name means).

    baseline: subtracted from each sample's value (its task reward; with `normalized` its
        return r - beta K).
    """

    baseline: Baseline
    traits: AdvantageEstimatorTraits

    def __post_init__(self) -> None:
        if self.traits.centres != (self.baseline is not NO_BASELINE):
            raise ImportError("an advantage estimator centres exactly when it has a baseline")

    @property
    def centres(self) -> bool:
        """Whether it subtracts a baseline at all (then the KL reward gets one too)."""
        return self.traits.centres

    @property
    def min_group_size(self) -> int:
        return self.traits.min_group_size

    @property
    def normalize(self) -> str | None:
        return self.traits.normalize


_BASELINES = {"rloo": LEAVE_ONE_OUT, "grpo": GROUP_MEAN, "drgrpo": GROUP_MEAN,
              "reinforce": NO_BASELINE}
ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimatorSpec] = {
    name: AdvantageEstimatorSpec(_BASELINES[name], traits)
    for name, traits in ADVANTAGE_ESTIMATOR_TRAITS.items()}
literal_names(AdvantageEstimator, ADVANTAGE_ESTIMATORS,
              table_name="kl.advantage.ADVANTAGE_ESTIMATORS", literal_name="AdvantageEstimator",
              kind="advantage estimators")


def advantage_estimator(name: str) -> AdvantageEstimatorSpec:
    """The table entry of advantage estimator `name` (refused, with the supported listed)."""
    return lookup(ADVANTAGE_ESTIMATORS, name, "advantage estimator")


def group_baseline(values: torch.Tensor, group_ids: torch.Tensor,
                   estimator: AdvantageEstimator) -> torch.Tensor:
    """Per-sample baseline [B] from the values [B] of its group."""
    spec = advantage_estimator(estimator)
    if spec.min_group_size > 1:
        smallest = int(torch.unique(group_ids, return_counts=True)[1].min())
        check_group_size(estimator, smallest, f"a group of {smallest}")
    return spec.baseline.of(values, group_ids)


def kl_baseline(values: torch.Tensor, group_ids: torch.Tensor,
                estimator: AdvantageEstimator) -> torch.Tensor:
    """Per-sample baseline [B] of the KL reward (`separate`): the leave-one-out mean of the other
    samples' values in the group whatever the task estimator (0 in a group of one), or no
    baseline with an estimator that subtracts none (reinforce). It never includes the sample
    itself, so it is independent of it: its term has zero expectation on-policy and,
    importance-weighted, off-policy, and the KL part stays exactly beta times the KL gradient
    with grpo and drgrpo too (a group mean including the sample would scale it by (n-1)/n)."""
    if not advantage_estimator(estimator).centres:
        return torch.zeros_like(values)
    sums, counts = _group_sums(values, group_ids)
    return torch.where(counts > 1, (sums - values) / (counts - 1).clamp_min(1), 0.0)


def group_scale(values: torch.Tensor, group_ids: torch.Tensor, normalize: Normalization,
                eps: float) -> torch.Tensor:
    """Per-sample divisor [B]: 1, the group's std, or the batch std (population std, + eps)."""
    return lookup(NORMALIZATIONS, normalize, "normalize").of(values, group_ids, eps)


# ---- the KL reward inside the advantage ---------------------------------------------------

@dataclass(frozen=True)
class Grouping:
    """How one batch's values become advantages: minus the estimator's baseline over each
    group, divided by the normalisation's scale."""

    group_ids: torch.Tensor
    estimator: str
    normalize: str
    eps: float

    def advantages(self, values: torch.Tensor) -> torch.Tensor:
        return (values - group_baseline(values, self.group_ids, self.estimator)) / group_scale(
            values, self.group_ids, self.normalize, self.eps)


@dataclass(frozen=True)
class KLInAdvantageForm:
    """One kl.kl_in_advantage: how the per-token KL estimates enter the advantage.

    advantages: (grouping, rewards [B], k [B, T] estimates with 0 on masked positions, mask
        [B, T] bool, beta) -> per-token advantages [B, T], 0 on masked positions.
    traits: what it is (kl.traits, their one home: `folds`, `normalises_kl`).
    kl_centring: the baseline its KL part is centred by where that is not the task estimator's
        own (centered: the group mean, the sample included); None: folded, the estimator's
        own (normalized), or not folded, kl_baseline (separate: leave-one-out, expected scale
        1).
    """

    advantages: Callable[[Grouping, torch.Tensor, torch.Tensor, torch.Tensor, float],
                         torch.Tensor]
    traits: KLInAdvantageTraits
    kl_centring: Baseline | None = None

    @property
    def folds(self) -> bool:
        """It replaces the task advantage with one that holds the KL reward."""
        return self.traits.folds

    @property
    def normalises_kl(self) -> bool:
        """Its KL part is divided by advantage.normalize's scale with the task reward."""
        return self.traits.normalises_kl


def _separate(g: Grouping, rewards, k, m, beta) -> torch.Tensor:
    task = g.advantages(rewards)
    to_go = k.flip(-1).cumsum(-1).flip(-1)  # R_t
    seq_kl = k.sum(-1)                        # K_i
    kl_part = -beta * (to_go - kl_baseline(seq_kl, g.group_ids, g.estimator)[:, None])
    return torch.where(m, task[:, None] + kl_part, 0.0)


def _normalized(g: Grouping, rewards, k, m, beta) -> torch.Tensor:
    # One sequence-level return per sample, normalised like a task reward and given to every
    # token (verl's form). A per-token return-to-go here would not be centred by a per-sequence
    # baseline: identical responses would keep beta x (KL before t) and be divided by a zero std.
    adv = g.advantages(rewards - beta * k.sum(-1))
    return torch.where(m, adv[:, None], 0.0)


_CENTERED_CENTRING = GROUP_MEAN  # centered's KL part: minus the group mean, sample included


def _centered(g: Grouping, rewards, k, m, beta) -> torch.Tensor:
    task = g.advantages(rewards)
    seq_clamped = k.clamp(-KL_CLAMP, KL_CLAMP).sum(-1)  # masked positions are 0 already
    kl_part = -beta * (seq_clamped - _CENTERED_CENTRING.of(seq_clamped, g.group_ids))
    return torch.where(m, (task + kl_part)[:, None], 0.0)


_FORM_ADVANTAGES = {"separate": _separate, "normalized": _normalized, "centered": _centered}
_FORM_CENTRINGS = {"centered": _CENTERED_CENTRING}
KL_IN_ADVANTAGE_FORMS: dict[str, KLInAdvantageForm] = {
    name: KLInAdvantageForm(_FORM_ADVANTAGES[name], traits, _FORM_CENTRINGS.get(name))
    for name, traits in KL_IN_ADVANTAGE_TRAITS.items()}
literal_names(KLInAdvantage, KL_IN_ADVANTAGE_FORMS,
              table_name="kl.advantage.KL_IN_ADVANTAGE_FORMS", literal_name="KLInAdvantage",
              kind="forms")


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
    grouping = Grouping(group_ids, estimator, normalize, eps)
    if kl_tokens is None or beta == 0.0:
        task = grouping.advantages(rewards)
        if kl_tokens is None:
            return task
        return task[:, None] * mask.to(task.dtype)
    if mask is None:
        raise ValueError("mask is required with kl_tokens")
    form = lookup(KL_IN_ADVANTAGE_FORMS, kl_in_advantage, "kl_in_advantage")
    m = mask.bool()
    k = torch.where(m, kl_tokens.detach().to(torch.float64), 0.0)
    return form.advantages(grouping, rewards, k, m, beta)
