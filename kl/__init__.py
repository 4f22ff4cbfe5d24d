"""Pure KL math for RL on LLMs: estimators, surrogate losses, importance weights, advantages.

Imports torch (and pydantic for configs) only; never Ray, vLLM or DeepSpeed. The settings'
names and traits (kl.traits) and the configs (kl.config) import no torch.

    kl.estimate(logp, ref_logp, estimator)            per-token K1/K2/K3
    kl.surrogate(logp, ref_logp, mask, *, estimator, placement, importance,
                 behaviour_logp, truncate, baseline)  per-sequence loss, exact gradient contract
    kl.compute_advantages(rewards, group_ids, ...)    RLOO/GRPO/Dr.GRPO/REINFORCE (+ KL reward)
    kl.KLConfig, kl.AdvantageConfig                   validated configuration

Every setting is a Literal of names and one table from each name to what owns its behaviour
(kl.registry), whose traits (what the configs read) live in kl.traits: FORMULAS (kl.estimator),
PLACEMENT_FORMS, IMPORTANCE_CORRECTIONS, KL_IN_ADVANTAGE_FORMS, ADVANTAGE_ESTIMATORS
(advantage.estimator) and NORMALIZATIONS.
"""
from __future__ import annotations

import importlib
import sys
import types
from typing import Any

# Each public name and the module that owns it, imported on first use (PEP 562): importing a
# torch-free module of this package (kl.config, kl.traits: what loading a config reads) then
# runs no torch through this __init__.
_HOMES = {
    "ADVANTAGE_ESTIMATORS": "kl.advantage", "KL_IN_ADVANTAGE_FORMS": "kl.advantage",
    "NORMALIZATIONS": "kl.advantage", "compute_advantages": "kl.advantage",
    "group_baseline": "kl.advantage", "group_scale": "kl.advantage",
    "kl_baseline": "kl.advantage",
    "AdvantageConfig": "kl.config", "KLConfig": "kl.config",
    "ESTIMATORS": "kl.estimators", "FORMULAS": "kl.estimators", "estimate": "kl.estimators",
    "IMPORTANCE_CORRECTIONS": "kl.surrogate", "surrogate": "kl.surrogate",
    "IMPORTANCES": "kl.traits", "KL_IN_ADVANTAGE": "kl.traits", "PLACEMENTS": "kl.traits",
    "PLACEMENT_FORMS": "kl.traits",
}
__all__ = list(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'kl' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


class _Package(types.ModuleType):
    """kl itself. Loading the module kl.surrogate binds it on the package, where `kl.surrogate`
    is the function of that name (`kl.surrogate(...)`), so that binding is skipped and the name
    goes on resolving to the function through `__getattr__`."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "surrogate" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
