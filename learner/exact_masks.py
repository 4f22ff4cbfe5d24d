"""The task-term rows of `klrl kl-table`: what each learner.task_off_policy does to the task
gradient off-policy, in exact expectation over every group of the trainer table's toy.

For each task term and each lag of the trainer table (kl/table.py TrainerTableConfig: the toy,
n, the band of the masks), with beta 0 and the trainer's default advantage (rloo, group
normalisation), against g_on = E_pi[grad of the `none` term], the task gradient the same pi
would get from its own samples:

    bias      |E_mu[g] - g_on| / |g_on|
    variance  E_mu||g_group - E_mu[g]||^2 / |g_on|^2, the per-group variance of one group's
              gradient (the groups' weights are their probabilities under mu)
    dropped   for a mask: |E_mu[g_unmasked] - E_mu[g]| / |E_mu[g_unmasked]|, the share of the
              gradient's norm the band removes, g_unmasked the same term with the band [0, 1e6]
              (nothing masked on the toy: checked)
    masked    the expected share of response tokens, and of samples, whose gradient the mask
              drops (samples: with at least one masked token)

On-policy every term has the gradient g_on and masks nothing; a row whose lag-0 cell breaks
that fails the command, like the trainer rows, and so does a mask whose band [0, 1e6] masks
something (no unmasked reference). Off-policy nothing is claimed: the numbers are
the bias each term has on the toy, which docs/learner.md quotes.
"""
from __future__ import annotations

import torch

from kl import toy as T
from kl.config import AdvantageConfig, KLConfig
from kl.table import TrainerTableConfig
from learner.config import LearnerConfig
from learner.exact import Groups, enumerate_groups, expected_grad, per_group_grads
from learner.exact_table import task_reward
from learner.task_term_traits import MASKING_TERMS, TASK_OFF_POLICIES
from learner.task_terms import TASK_TERMS

TOLERANCE = 1e-9  # on-policy cells: float64 rounding only
UNMASKED = {"mask_low": 0.0, "mask_high": 1e6}  # the widest band LearnerConfig allows
NO_KL = KLConfig(beta=0.0)


def learner_config(term: str, cfg: TrainerTableConfig, **band) -> LearnerConfig:
    """The learner config of a task term's row: the table's band for a mask (null: the
    learner's default band), the defaults otherwise."""
    if TASK_TERMS[term].masks:
        band = band or {k: v for k, v in (("mask_low", cfg.mask_low),
                                          ("mask_high", cfg.mask_high)) if v is not None}
        return LearnerConfig(task_off_policy=term, **band)
    return LearnerConfig(task_off_policy=term)


def masked_shares(groups: Groups, lcfg: LearnerConfig) -> tuple[float, float]:
    """E_mu[masked response tokens] / E_mu[response tokens] and the expected share of samples
    with a masked token, under the term of `lcfg` (0, 0 for a term that masks nothing)."""
    toy, b = groups.toy, groups.batch
    lp = torch.cat([torch.zeros(groups.rows.shape[0], 1, dtype=torch.float64),
                    T.token_logp(toy.logits, toy.space)[groups.rows]], dim=1)
    mask = b.response_mask
    term = TASK_TERMS[lcfg.task_off_policy]
    masked = term.tokens(lp, b.behaviour_logp, b.advantages[:, None].expand_as(lp), mask,
                         lcfg).masked
    if masked is None:
        return 0.0, 0.0
    w = groups.weight.repeat_interleave(groups.n)  # each row: its group's probability
    tokens = float(w @ mask.sum(-1).double())
    return (float(w @ masked.sum(-1).double()) / tokens,
            float(w @ masked.any(-1).double()) / float(w.sum()))


def _cell(groups: Groups, g_on: torch.Tensor, term: str, cfg, adv_cfg) -> dict:
    lcfg = learner_config(term, cfg)
    g = expected_grad(groups, NO_KL, adv_cfg, lcfg)
    per_group = per_group_grads(groups, NO_KL, adv_cfg, lcfg)
    var = float(groups.weight @ ((per_group - g) ** 2).sum(-1))
    on_norm = float(g_on.norm())
    tokens, samples = masked_shares(groups, lcfg)
    cell = {"bias": float((g - g_on).norm()) / on_norm, "variance": var / on_norm ** 2,
            "masked_tokens": tokens, "masked_samples": samples, "dropped": None}
    if TASK_TERMS[term].masks:
        wide = learner_config(term, cfg, **UNMASKED)
        if masked_shares(groups, wide) != (0.0, 0.0):
            return {**cell, "reference": False}  # no unmasked gradient to compare: the row fails
        g_wide = expected_grad(groups, NO_KL, adv_cfg, wide)
        cell["dropped"] = float((g_wide - g).norm() / g_wide.norm())
    return {**cell, "reference": True}


def compute_mask_rows(cfg: TrainerTableConfig) -> dict:
    """JSON-ready rows, one per (task term, lag), for groups of the largest n of `cfg`."""
    torch.set_num_threads(1)  # tiny tensors (as kl.table)
    n = max(cfg.group_sizes)
    adv_cfg = AdvantageConfig()
    lags = sorted({0.0, *cfg.lags})
    groups = {}
    for lag in lags:
        toy = T.ToyProblem.make(3, cfg.length, True, cfg.seed, 1.0, lag)
        groups[lag] = enumerate_groups(toy, n, task_reward(toy.space)).with_task_advantages(
            adv_cfg)
    g_on = expected_grad(groups[0.0], NO_KL, adv_cfg, LearnerConfig(task_off_policy="none"))
    rows = []
    for term in TASK_OFF_POLICIES:
        for lag in lags:
            cell = _cell(groups[lag], g_on, term, cfg, adv_cfg)
            on_policy_ok = cell["bias"] <= TOLERANCE and cell["masked_tokens"] == 0.0
            ok = cell["reference"] and (lag > 0 or on_policy_ok)
            rows.append({"task_off_policy": term, "lag": lag, "ok": ok, **cell})
    lcfg = learner_config(MASKING_TERMS[0], cfg)
    return {"n": n, "advantage": f"{adv_cfg.estimator}/{adv_cfg.normalize}",
            "band": [lcfg.mask_low, lcfg.mask_high], "tis_cap": lcfg.tis_cap,
            "tolerance": TOLERANCE, "rows": rows}
