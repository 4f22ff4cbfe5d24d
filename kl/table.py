"""The KL table `klrl kl-table` prints: every KL configuration's exact expected gradient on a
seeded toy (kl.toy), against the true gradient g* = grad KL(pi||ref).

For each configuration: the cosine to g*, the relative error |E g - g*| / |g*| and the
per-sample gradient variance, on-policy and off-policy; whether the exact expectation matches
docs/design.md's table; and a sweep of the bias against the behaviour policy's lag.
Everything is exact enumeration (no sampling), so the numbers are deterministic for a seed.
"""
from __future__ import annotations

from typing import Annotated

import torch
from pydantic import BaseModel, ConfigDict, Field

from kl import toy as T
from kl.analysis import (
    KLVariant,
    all_variants,
    cosine,
    expected_grad,
    gradient_variance,
    is_exact_correction,
    on_policy_prediction,
    reference_grads,
    relative_error,
    unbiased_for_g_star,
)

LAG_SWEEP_VARIANTS = [
    ("k1", "reward", "none", None), ("k3", "reward", "none", None), ("k1", "loss", "none", None),
    ("k3", "loss", "none", None), ("k1", "reward", "token", None),
    ("k1", "reward", "sequence", None), ("k1", "reward", "prefix", None),
    ("k1", "reward", "prefix", 2.0), ("k3", "reward+loss", "prefix", None),
]


class TrainerTableConfig(BaseModel):
    """The toy of the trainer-level rows (learner/exact_table.py): vocabulary 3 with EOS and
    shorter sequences than the estimator table's, since groups of n = 3 enumerate S^3 of them."""

    model_config = ConfigDict(extra="forbid")

    seed: int = Field(0, ge=0, le=2**31 - 1, description="Seed of the toy's policy, reference "
                      "and drift direction.")
    length: int = Field(3, ge=1, le=3, description="Maximum response length (vocabulary 3 with "
                        "EOS: 15 sequences at 3, 3375 groups of 3).")
    beta: float = Field(0.1, gt=0, le=10, description="kl.beta of every row.")
    lags: list[Annotated[float, Field(ge=0, le=100)]] = Field(
        [0.0, 1.0, 3.0], min_length=1, max_length=6, description="Behaviour lags of the "
        "columns in drift units (0: on-policy; 1: a batch's second update; 3: max_lag 3).")
    group_sizes: list[Annotated[int, Field(ge=2, le=3)]] = Field(
        [2, 3], min_length=1, max_length=2, description="Samples per prompt n of the groups.")
    environment: list[Annotated[int, Field(ge=1, le=2)]] = Field(
        [1], max_length=2, description="The multi-turn rows: positions at which an "
        "environment answers between the policy's turns (kl.toy.Environment; [1]: policy, "
        "environment, policy), the same table over trajectories; []: no multi-turn rows.")
    truncate: float = Field(1.2, gt=0, le=1e6, description="kl.truncate C of the capped "
                            "prefix rows (shown off-policy only: C >= 1 is inert on-policy).")
    mask_low: float | None = Field(None, ge=0, lt=1, description="learner.mask_low of the "
                                   "masking task terms' rows (null: the learner's default).")
    mask_high: float | None = Field(None, gt=1, le=1e6, description="learner.mask_high of the "
                                    "masking task terms' rows (null: the learner's default).")


class KLTableConfig(BaseModel):
    """The toy problem and the lags shown by `klrl kl-table` (configs/kl_table.yaml)."""

    model_config = ConfigDict(extra="forbid")

    seed: int = Field(0, ge=0, le=2**31 - 1, description="Seed of the toy's policy, reference "
                      "and drift direction.")
    vocab: int = Field(3, ge=2, le=6, description="Toy vocabulary size (token 0 is EOS when eos).")
    length: int = Field(4, ge=1, le=6, description="Maximum sequence length of the toy.")
    eos: bool = Field(True, description="Token 0 ends a sequence (variable lengths) when true.")
    ref_scale: float = Field(1.0, gt=0, le=10, description="How far the reference logits are "
                             "from the policy's.")
    drift: float = Field(0.15, gt=0, le=5, description="Behaviour drift per unit of lag (logit "
                         "scale).")
    off_policy_lag: float = Field(3.0, gt=0, le=100, description="Lag of the off-policy columns.")
    lags: list[float] = Field([0, 1, 2, 3, 4, 6, 8, 10], min_length=1,
                              description="Lags of the bias sweep.")
    truncate: float = Field(2.0, gt=0, le=1e6,
                            description="Cap C shown for the truncated prefix rows.")
    trainer: TrainerTableConfig = Field(default_factory=TrainerTableConfig, description="The "
                                        "trainer-level rows: the learner's whole loss over groups.")


def compute_table(cfg: KLTableConfig) -> dict:
    """The table as JSON-ready data: `rows` (one per configuration), `lag_sweep`, `config`."""
    # The toy's tensors are tiny: thread start-up and contention cost more than the math.
    torch.set_num_threads(1)

    def make(lag):
        return T.ToyProblem.make(cfg.vocab, cfg.length, cfg.eos, cfg.seed, cfg.ref_scale, lag,
                                 cfg.drift)

    on, off = make(0.0), make(cfg.off_policy_lag)
    refs = {"on": reference_grads(on), "off": reference_grads(off)}
    variants = [v for v in all_variants((cfg.truncate,))
                if v.truncate is None or v.importance == "prefix"]
    rows = []
    for v in variants:
        row = {"config": v.name, "estimator": v.estimator, "placement": v.placement,
               "importance": v.importance, "truncate": v.truncate,
               "unbiased_on_policy": unbiased_for_g_star(v),
               "unbiased_off_policy": unbiased_for_g_star(v) and is_exact_correction(v)}
        for key, toy in (("on", on), ("off", off)):
            g, r = expected_grad(toy, v), refs[key]
            row[f"{key}_cosine"] = cosine(g, r.g_star)
            row[f"{key}_rel_error"] = relative_error(g, r.g_star)
            row[f"{key}_variance"] = gradient_variance(toy, v)
            row[f"{key}_norm_ratio"] = float(g.norm() / r.g_star.norm())  # |E g| / |g*|
            if key == "on":
                g_on = g
        pred = on_policy_prediction(v, refs["on"])
        row["matches_design_table"] = bool(
            (g_on - pred).norm() <= 1e-6 * max(float(pred.norm()), 1e-12)
            or float(g_on.abs().max()) < 1e-12)
        rows.append(row)
    sweep = {}
    toys = [make(lag) for lag in cfg.lags]
    g_stars = [reference_grads(t).g_star for t in toys]
    for est, pl, imp, c in LAG_SWEEP_VARIANTS:
        v = KLVariant(est, pl, imp, c)
        sweep[v.name] = [relative_error(expected_grad(t, v), g) for t, g in zip(toys, g_stars)]
    return {"config": cfg.model_dump(), "num_sequences": int(on.space.tokens.shape[0]),
            "rows": rows, "lag_sweep": {"lags": list(cfg.lags), "rel_error": sweep}}
