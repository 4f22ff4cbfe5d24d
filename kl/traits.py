"""What each kl/ setting is and requires, without torch: the Literals that name the choices and
one table of traits per setting, which the configs (kl.config, TrainConfig) read to validate.

This is the one home of every trait: the torch-side tables that own the behaviour
(kl.surrogate.IMPORTANCE_CORRECTIONS, kl.advantage's NORMALIZATIONS, ADVANTAGE_ESTIMATORS and
KL_IN_ADVANTAGE_FORMS) hold these entries and read their traits from them, so loading and
validating a config imports no torch (tests/test_config_without_torch.py). kl.estimator has no
trait but its names, kl.estimators' own `Estimator` (that module imports no torch either).

Adding a choice: its name in the Literal here, its traits in the table here, and its behaviour
in the torch-side table (each checks at import that it keys exactly the Literal's names).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kl.registry import literal_names, lookup

Placement = Literal["reward", "loss", "reward+loss"]
Importance = Literal["none", "token", "sequence", "prefix"]
AdvantageEstimator = Literal["rloo", "grpo", "drgrpo", "reinforce"]
Normalization = Literal["none", "group", "batch"]
KLInAdvantage = Literal["separate", "normalized", "centered"]


# ---- kl.placement -------------------------------------------------------------------------

@dataclass(frozen=True)
class PlacementForm:
    """The parts of the surrogate one kl.placement adds: the score-function part (`reward`: the
    KL as a per-token cost in the return) and the estimator differentiated as a loss (`loss`)."""

    reward: bool
    loss: bool


PLACEMENT_FORMS: dict[str, PlacementForm] = {
    "reward": PlacementForm(reward=True, loss=False),
    "loss": PlacementForm(reward=False, loss=True),
    "reward+loss": PlacementForm(reward=True, loss=True),
}
PLACEMENTS: tuple[str, ...] = literal_names(
    Placement, PLACEMENT_FORMS, table_name="kl.traits.PLACEMENT_FORMS",
    literal_name="Placement", kind="placements")


# ---- kl.importance ------------------------------------------------------------------------

@dataclass(frozen=True)
class ImportanceTraits:
    """What one kl.importance is (its coefficient and reward part: kl.surrogate).

    reweights: it has a coefficient (so it needs behaviour_logp and may be capped).
    carries_loss: its reward part with live estimates is also the loss part, so reward+loss is
        one term (prefix: sum_t w_t(live) k_t(live)).
    exact: uncapped, its expectation off-policy is the on-policy one (no state shift left).
    """

    reweights: bool
    carries_loss: bool = False
    exact: bool = False


IMPORTANCE_TRAITS: dict[str, ImportanceTraits] = {
    "none": ImportanceTraits(reweights=False),
    "token": ImportanceTraits(reweights=True),                          # rho_t
    "sequence": ImportanceTraits(reweights=True, exact=True),           # W
    "prefix": ImportanceTraits(reweights=True, carries_loss=True, exact=True),  # w_t
}
IMPORTANCES: tuple[str, ...] = literal_names(
    Importance, IMPORTANCE_TRAITS, table_name="kl.traits.IMPORTANCE_TRAITS",
    literal_name="Importance", kind="importance corrections")
REWEIGHTING: tuple[str, ...] = tuple(n for n, t in IMPORTANCE_TRAITS.items() if t.reweights)


# ---- advantage.normalize ------------------------------------------------------------------

@dataclass(frozen=True)
class NormalizationTraits:
    """What one advantage.normalize is (its divisor: kl.advantage.NORMALIZATIONS).

    within_group: it depends on the sample's own group only, so a learner rank's shard of
        whole groups computes it exactly as the whole batch would.
    meaning: what it is called in a refusal.
    """

    within_group: bool
    meaning: str


NORMALIZATION_TRAITS: dict[str, NormalizationTraits] = {
    "none": NormalizationTraits(True, "no std normalisation"),
    "group": NormalizationTraits(True, "group-std normalisation"),
    "batch": NormalizationTraits(False, "batch-std normalisation"),
}
NORMALIZATION_NAMES: tuple[str, ...] = literal_names(
    Normalization, NORMALIZATION_TRAITS, table_name="kl.traits.NORMALIZATION_TRAITS",
    literal_name="Normalization", kind="normalisations")


# ---- advantage.estimator ------------------------------------------------------------------

@dataclass(frozen=True)
class AdvantageEstimatorTraits:
    """What one advantage.estimator requires (its baseline: kl.advantage.ADVANTAGE_ESTIMATORS).

    centres: it subtracts a baseline at all (then the KL reward gets one too).
    min_group_size: the fewest samples per prompt it means anything with; `too_few` says what
        goes wrong below it.
    normalize: the advantage.normalize its name means (None: any).
    """

    centres: bool
    min_group_size: int = 1
    too_few: str = ""
    normalize: str | None = None


_SELF_SUBTRACTED = "subtracts each sample from itself (every advantage 0)"
ADVANTAGE_ESTIMATOR_TRAITS: dict[str, AdvantageEstimatorTraits] = {
    "rloo": AdvantageEstimatorTraits(True, 2, "has no other sample to average"),
    "grpo": AdvantageEstimatorTraits(True, 2, _SELF_SUBTRACTED, normalize="group"),
    "drgrpo": AdvantageEstimatorTraits(True, 2, _SELF_SUBTRACTED, normalize="none"),
    "reinforce": AdvantageEstimatorTraits(False),
}
ADVANTAGE_ESTIMATOR_NAMES: tuple[str, ...] = literal_names(
    AdvantageEstimator, ADVANTAGE_ESTIMATOR_TRAITS,
    table_name="kl.traits.ADVANTAGE_ESTIMATOR_TRAITS", literal_name="AdvantageEstimator",
    kind="advantage estimators")


def check_group_size(estimator: str, n: int, where: str) -> None:
    """Refuse `estimator` with groups of `n` samples (`where` says where n comes from, e.g.
    "rollout.samples_per_prompt=1"); the message lists the estimators that accept n."""
    traits = lookup(ADVANTAGE_ESTIMATOR_TRAITS, estimator, "advantage estimator")
    if n < traits.min_group_size:
        ok = [name for name, t in ADVANTAGE_ESTIMATOR_TRAITS.items() if t.min_group_size <= n]
        raise ValueError(f"advantage.estimator={estimator} with {where} {traits.too_few}: it "
                         f"needs at least {traits.min_group_size} samples per group; the "
                         f"estimators that accept {n}: {', '.join(ok)}")


def check_normalization(estimator: str, normalize: str) -> None:
    """Refuse a normalisation that `estimator`'s name rules out, listing those that allow it."""
    required = lookup(ADVANTAGE_ESTIMATOR_TRAITS, estimator, "advantage estimator").normalize
    lookup(NORMALIZATION_TRAITS, normalize, "advantage.normalize")
    if required is not None and normalize != required:
        ok = [name for name, t in ADVANTAGE_ESTIMATOR_TRAITS.items()
              if t.normalize in (None, normalize)]
        raise ValueError(f"advantage.estimator={estimator} means "
                         f"{NORMALIZATION_TRAITS[required].meaning}: use normalize={required}, "
                         f"or an estimator that allows normalize={normalize}: {', '.join(ok)}")


# ---- kl.kl_in_advantage -------------------------------------------------------------------

@dataclass(frozen=True)
class KLInAdvantageTraits:
    """What one kl.kl_in_advantage is (its advantages: kl.advantage.KL_IN_ADVANTAGE_FORMS).

    folds: it replaces the task advantage with one that holds the KL reward (so the KL reward
        does not go through kl.surrogate, and the task term's off-policy handling applies).
    normalises_kl: its KL part is divided by advantage.normalize's scale with the task reward
        (under a std the effective beta becomes beta / sigma per prompt: no closed form).
    """

    folds: bool
    normalises_kl: bool = False


KL_IN_ADVANTAGE_TRAITS: dict[str, KLInAdvantageTraits] = {
    "separate": KLInAdvantageTraits(folds=False),
    "normalized": KLInAdvantageTraits(folds=True, normalises_kl=True),
    "centered": KLInAdvantageTraits(folds=True),
}
KL_IN_ADVANTAGE: tuple[str, ...] = literal_names(
    KLInAdvantage, KL_IN_ADVANTAGE_TRAITS, table_name="kl.traits.KL_IN_ADVANTAGE_TRAITS",
    literal_name="KLInAdvantage", kind="forms")
