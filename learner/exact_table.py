"""The trainer-level rows of `klrl kl-table`: what the KL does to the trainer's own update, in
exact expectation, against what docs/kl.md says it does.

For each configuration (kl.placement x kl.kl_in_advantage x advantage.estimator x
advantage.normalize x learner.task_off_policy x group size n) and each behaviour policy
(on-policy; the second update of a batch, mu one drift unit old; lag 3), the KL's share of the
expected update is

    d = E_mu[grad loss(beta)] - E_mu[grad loss(beta = 0)]

(learner.exact: policy_loss summed over every group of n toy sequences, a binary task reward
on every sequence). The documented form of d, where docs/kl.md claims one exactly:

    separate     beta x G, G the KL gradient of kl.surrogate's table (K1 reward: g*; K3 loss:
                 the token-level forward KL gradient; K3 reward+loss: g*), for every task
                 estimator, normalisation and task_off_policy; off-policy with kl.importance
                 prefix (its closed-form bias added when capped at C)
    normalized   on-policy with normalize none: beta g* (rloo, reinforce), (n-1)/n beta g*
                 (drgrpo); with a group std there is no closed form (beta / sigma per group)
    centered     on-policy: (n-1)/n beta g* (K1, the clamp not binding), any task estimator

Elsewhere (folded rows off-policy, normalized with a std) there is no exact claim: the table
prints the relative distance from the on-policy form, to show how far off it is. A row fails
if a claimed cell is off by more than TOLERANCE, or if a folded advantage leaves the bound
that group normalisation promises (|A| <= n / sqrt(n-1) for rloo, sqrt(n-1) for grpo).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from kl import toy as T
from kl.advantage import ADVANTAGE_ESTIMATORS, KL_IN_ADVANTAGE_FORMS
from kl.analysis import (
    KLVariant,
    on_policy_prediction,
    reference_grads,
    relative_error,
    truncated_bias,
)
from kl.config import AdvantageConfig, KLConfig
from kl.table import TrainerTableConfig
from learner.config import LearnerConfig
from learner.exact import (
    Groups,
    enumerate_groups,
    expected_grad,
    folded_advantages,
    per_group_grads,
)
from learner.task_term_traits import TASK_OFF_POLICIES

TOLERANCE = 1e-9  # float64 enumeration: claimed cells differ by rounding only
KL_MODES = [  # (name, kl_in_advantage, placement, estimator, truncate)
    ("separate/reward/k1", "separate", "reward", "k1", None),
    ("separate/reward/k1/C", "separate", "reward", "k1", "C"),
    ("separate/loss/k3", "separate", "loss", "k3", None),
    ("separate/reward+loss/k3", "separate", "reward+loss", "k3", None),
    ("normalized/reward/k1", "normalized", "reward", "k1", None),
    ("centered/reward/k1", "centered", "reward", "k1", None),
]
# Every valid (estimator, normalize) pair but reinforce/group: it divides an uncentred reward by
# the group std, so a group whose reward is constant and non-zero gets r / eps (1e6), and the
# KL's share of the update is lost in float64 under a task part that large.
ADVANTAGES = [("rloo", "none"), ("rloo", "group"), ("grpo", "group"), ("drgrpo", "none"),
              ("reinforce", "none")]


def task_reward(space: T.SequenceSpace) -> torch.Tensor:
    """A binary task reward (like a correct answer): 1 if the response holds token 1."""
    return (space.tokens == 1).any(-1).to(torch.float64)


def _kl_cfg(mode, lag: float, beta: float, cap: float) -> KLConfig:
    _, kia, placement, est, trunc = mode
    # The separate KL term's off-policy handling is kl.importance; a folded one's is the task
    # term's (learner.task_off_policy).
    folds = KL_IN_ADVANTAGE_FORMS[kia].folds
    importance = "prefix" if not folds and (lag > 0 or trunc) else "none"
    return KLConfig(estimator=est, placement=placement, importance=importance, beta=beta,
                    kl_in_advantage=kia, truncate=cap if trunc else None)


def documented(mode, est: str, norm: str, n: int, lag: float, beta: float, refs, toy, cap):
    """(target, exact): docs/kl.md's form of d for this cell, and whether it claims it exactly
    (False: the on-policy form, shown as a reference)."""
    _, kia, placement, k, trunc = mode
    form = KL_IN_ADVANTAGE_FORMS[kia]
    if not form.folds:
        target = beta * on_policy_prediction(KLVariant(k, placement), refs)
        if trunc:
            target = target + beta * truncated_bias(toy, KLVariant(k, placement, "prefix", cap))
        return target, True
    # The baseline whose expected scale the folded KL part gets: the form's own (centered: the
    # group mean), else the estimator's (normalized). A KL part divided by a std has no closed
    # form, so only normalize none is claimed there.
    baseline = form.kl_centring or ADVANTAGE_ESTIMATORS[est].baseline
    shrink = baseline.expected_scale(n)
    exact = lag == 0 and (not form.normalises_kl or norm == "none")
    return shrink * beta * refs.g_star, exact


def advantage_bound(est: str, norm: str, n: int) -> float | None:
    """The most |A| per-group normalisation allows (None: no bound is promised)."""
    if norm != "group" or n < 2:
        return None
    bound = ADVANTAGE_ESTIMATORS[est].baseline.group_std_bound
    return None if bound is None else bound(n)


def compute_trainer_rows(cfg: TrainerTableConfig, multi_turn: bool = False) -> dict:
    """JSON-ready rows: one per (KL mode, estimator, normalize, n), with a cell per
    (lag, task_off_policy). `multi_turn`: the same over trajectories whose environment answers
    at cfg.environment's positions (kl.toy.Environment), the documented forms taken over the
    policy's tokens only; the capped rows' bias has no multi-turn closed form there, so they
    are computed without a claim."""
    torch.set_num_threads(1)
    toys = {lag: T.ToyProblem.make(3, cfg.length, True, cfg.seed, 1.0, lag) for lag in cfg.lags}
    if multi_turn:
        env = T.Environment.at_positions(toys[cfg.lags[0]].space, cfg.environment, cfg.seed + 5)
        toys = {lag: replace(toy, env=env) for lag, toy in toys.items()}
    refs = reference_grads(toys[cfg.lags[0]])  # pi and ref are the same for every lag
    rows = []
    for n in cfg.group_sizes:
        groups = {lag: enumerate_groups(toy, n, task_reward(toy.space))
                  for lag, toy in toys.items()}
        for est, norm in ADVANTAGES:
            adv_cfg = AdvantageConfig(estimator=est, normalize=norm)
            with_adv = {lag: g.with_task_advantages(adv_cfg) for lag, g in groups.items()}
            base = {(lag, o): expected_grad(g, KLConfig(beta=0.0), adv_cfg,
                                            LearnerConfig(task_off_policy=o))
                    for lag, g in with_adv.items() for o in TASK_OFF_POLICIES}
            for mode in KL_MODES:
                rows.append(_row(cfg, mode, est, norm, n, with_adv, base, refs, adv_cfg,
                                 multi_turn))
    num_sequences = int(next(iter(toys.values())).space.tokens.shape[0])
    return {"config": cfg.model_dump(), "num_sequences": num_sequences,
            "tolerance": TOLERANCE, "rows": rows}


def _row(cfg, mode, est, norm, n, with_adv: dict[float, Groups], base, refs, adv_cfg,
         multi_turn: bool = False) -> dict:
    cells = []
    for lag, g in with_adv.items():
        if mode[4] and lag == 0:
            continue  # a cap C >= 1 is inert on-policy: the uncapped row says it
        kl_cfg = _kl_cfg(mode, lag, cfg.beta, cfg.truncate)
        target, exact = documented(mode, est, norm, n, lag, cfg.beta, refs, g.toy, cfg.truncate)
        exact = exact and not (multi_turn and mode[4])  # the cap's bias is single-turn
        for o in TASK_OFF_POLICIES:
            d = expected_grad(g, kl_cfg, adv_cfg, LearnerConfig(task_off_policy=o)) - base[(lag, o)]
            err = relative_error(d, target)
            cells.append({"lag": lag, "task_off_policy": o, "rel_error": err, "exact": exact,
                          "ok": (err <= TOLERANCE) if exact else True})
    row = {"config": f"{mode[0]}  {est}/{norm}  n={n}", "kl": mode[0], "estimator": est,
           "normalize": norm, "n": n, "cells": cells}
    bound = advantage_bound(est, norm, n)
    if KL_IN_ADVANTAGE_FORMS[mode[1]].normalises_kl:  # one unnormalised (centered): no bound
        adv = folded_advantages(with_adv[cfg.lags[0]],
                                _kl_cfg(mode, 0.0, cfg.beta, cfg.truncate), adv_cfg)
        row["max_abs_advantage"] = float(adv.abs().max())
        row["advantage_bound"] = bound
        within = bound is None or row["max_abs_advantage"] <= bound * (1 + 1e-12)
    else:
        within = True
    row["ok"] = within and all(c["ok"] for c in cells)
    return row


def kl_part_variance(seeds=(0, 1, 2, 3), group_sizes=(2, 3), beta: float = 1.0,
                     length: int = 3) -> list[dict]:
    """Per-group variance E_mu||d_g - E d||^2 of the KL's share of one group's update, on-policy,
    for `centered` (K1, group mean of the sequence sums) and `separate` (K1 reward-to-go, the
    leave-one-out baseline); both also divided by their expectation's scale ((n-1)/n for
    centered), so that the comparison is at equal expected step."""
    torch.set_num_threads(1)  # tiny tensors: threads cost more than the math (as kl.table)
    out = []
    adv_cfg = AdvantageConfig(estimator="drgrpo", normalize="none")
    lcfg = LearnerConfig(task_off_policy="none")
    for seed in seeds:
        toy = T.ToyProblem.make(3, length, True, seed, 1.0, 0.0)
        for n in group_sizes:
            g = enumerate_groups(toy, n, task_reward(toy.space)).with_task_advantages(adv_cfg)
            g0 = per_group_grads(g, KLConfig(beta=0.0), adv_cfg, lcfg)
            var = {}
            for kia in ("separate", "centered"):
                d = per_group_grads(g, KLConfig(beta=beta, kl_in_advantage=kia), adv_cfg, lcfg) - g0
                mean = g.weight @ d
                v = float(g.weight @ ((d - mean) ** 2).sum(-1))
                var[kia] = v
                centring = KL_IN_ADVANTAGE_FORMS[kia].kl_centring  # separate: its own, scale 1
                scale = centring.expected_scale(n) if centring is not None else 1.0
                var[f"{kia}_scaled"] = v / scale ** 2
            out.append({"seed": seed, "n": n, **var})
    return out
