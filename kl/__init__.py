"""Pure KL math for RL on LLMs: estimators, surrogate losses, importance weights, advantages.

Imports torch (and pydantic for configs) only; never Ray, vLLM or DeepSpeed.

    kl.estimate(logp, ref_logp, estimator)            per-token K1/K2/K3
    kl.surrogate(logp, ref_logp, mask, *, estimator, placement, importance,
                 behaviour_logp, truncate, baseline)  per-sequence loss, exact gradient contract
    kl.compute_advantages(rewards, group_ids, ...)    RLOO/GRPO/Dr.GRPO/REINFORCE (+ KL reward)
    kl.KLConfig, kl.AdvantageConfig                   validated configuration

Every setting is a Literal of names and one table from each name to what owns its behaviour
(kl.registry): FORMULAS (kl.estimator), PLACEMENT_FORMS, IMPORTANCE_CORRECTIONS,
KL_IN_ADVANTAGE_FORMS, ADVANTAGE_ESTIMATORS (advantage.estimator) and NORMALIZATIONS.
"""
from kl.advantage import (
    ADVANTAGE_ESTIMATORS,
    KL_IN_ADVANTAGE,
    KL_IN_ADVANTAGE_FORMS,
    NORMALIZATIONS,
    compute_advantages,
    group_baseline,
    group_scale,
    kl_baseline,
)
from kl.config import AdvantageConfig, KLConfig
from kl.estimators import ESTIMATORS, FORMULAS, estimate
from kl.surrogate import IMPORTANCE_CORRECTIONS, IMPORTANCES, PLACEMENT_FORMS, PLACEMENTS, surrogate

__all__ = [
    "ADVANTAGE_ESTIMATORS", "ESTIMATORS", "FORMULAS", "IMPORTANCES", "IMPORTANCE_CORRECTIONS",
    "KL_IN_ADVANTAGE", "KL_IN_ADVANTAGE_FORMS", "NORMALIZATIONS", "PLACEMENTS", "PLACEMENT_FORMS",
    "AdvantageConfig", "KLConfig", "compute_advantages", "estimate", "group_baseline",
    "group_scale", "kl_baseline", "surrogate",
]
