"""Pure KL math for RL on LLMs: estimators, surrogate losses, importance weights, advantages.

Imports torch (and pydantic for configs) only; never Ray, vLLM or DeepSpeed.

    kl.estimate(logp, ref_logp, estimator)            per-token K1/K2/K3
    kl.surrogate(logp, ref_logp, mask, *, estimator, placement, importance,
                 behaviour_logp, truncate, baseline)  per-sequence loss, exact gradient contract
    kl.compute_advantages(rewards, group_ids, ...)    RLOO/GRPO/Dr.GRPO/REINFORCE (+ KL reward)
    kl.KLConfig, kl.AdvantageConfig                   validated configuration
"""
from kl.advantage import compute_advantages, group_baseline, group_scale, kl_baseline
from kl.config import AdvantageConfig, KLConfig
from kl.estimators import ESTIMATORS, estimate
from kl.surrogate import IMPORTANCES, PLACEMENTS, surrogate

__all__ = [
    "ESTIMATORS", "IMPORTANCES", "PLACEMENTS", "AdvantageConfig", "KLConfig",
    "compute_advantages", "estimate", "group_baseline", "group_scale", "kl_baseline", "surrogate",
]
