"""Exact expected gradients of every KL configuration on the enumerable toy (kl.toy).

`expected_grad` is the exact expectation under the behaviour policy mu of the autograd
gradient of `kl.surrogate` (a finite weighted sum over all sequences, no sampling).
`on_policy_prediction` is what docs/design.md's table says that expectation must be, computed
from independent quantities: the exact sequence KL gradient g*, the token-level reverse/forward
KL gradients and grad E[sum K2]. The tests compare the two; `klrl kl-table` prints them.

`contract_prediction` is the same expectation for any estimator, from its formula alone (no
kl.surrogate): the reward placement is the score-function part of grad E_pi[sum_t k_t], the
loss placement the pathwise part, reward+loss their sum. It is the prediction for an estimator
the table has no closed form for (one just added to kl.estimators).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from kl import toy as T
from kl.estimators import ESTIMATORS, estimate
from kl.surrogate import IMPORTANCE_CORRECTIONS, PLACEMENT_FORMS, surrogate
from kl.traits import IMPORTANCES, PLACEMENTS


@dataclass(frozen=True)
class KLVariant:
    """One KL configuration as passed to kl.surrogate."""

    estimator: str
    placement: str
    importance: str = "none"
    truncate: float | None = None

    @property
    def name(self) -> str:
        trunc = f"/C={self.truncate:g}" if self.truncate is not None else ""
        return f"{self.estimator}/{self.placement}/{self.importance}{trunc}"


def all_variants(truncates: tuple[float, ...] = (2.0,)) -> list[KLVariant]:
    """Every estimator x placement x importance, plus each truncated (capped) importance."""
    out = []
    for est, pl, imp in itertools.product(ESTIMATORS, PLACEMENTS, IMPORTANCES):
        out.append(KLVariant(est, pl, imp))
        if IMPORTANCE_CORRECTIONS[imp].reweights:
            out += [KLVariant(est, pl, imp, c) for c in truncates]
    return out


def per_sample_grads(toy: T.ToyProblem, v: KLVariant,
                     baseline: float | None = None) -> torch.Tensor:
    """Gradient w.r.t. the policy logits of each sequence's surrogate: [N, rows * vocab]."""
    space = toy.space
    x = toy.logits.detach().clone().requires_grad_(True)
    lp = T.token_logp(x, space)
    lp_leaf = lp.detach().clone().requires_grad_(True)
    base = None if baseline is None else torch.full((lp.shape[0],), baseline, dtype=lp.dtype)
    s = surrogate(lp_leaf, T.token_logp(toy.ref_logits, space), space.mask, estimator=v.estimator,
                  placement=v.placement, importance=v.importance,
                  behaviour_logp=T.token_logp(toy.behaviour_logits, space), truncate=v.truncate,
                  baseline=base)
    # Sequence n's surrogate depends on row n of logp only, so one backward gives every
    # d s_n / d logp_n; the chain rule through the log-softmax table is then applied per row.
    (c,) = torch.autograd.grad(s.sum(), lp_leaf)
    probs = torch.softmax(toy.logits, -1)
    onehot = torch.nn.functional.one_hot(space.tokens, space.vocab).to(c.dtype)
    dlogp = (onehot - probs[space.rows]) * (c * space.mask)[..., None]  # [N, T, V]
    n, t = space.tokens.shape
    g = torch.zeros(n, space.num_rows, space.vocab, dtype=c.dtype)
    g.index_put_((torch.arange(n)[:, None].expand(n, t), space.rows), dlogp, accumulate=True)
    return g.reshape(n, -1)


def expected_grad(toy: T.ToyProblem, v: KLVariant, baseline: float | None = None) -> torch.Tensor:
    """E_mu[grad surrogate], exact by enumeration."""
    mu = T.sequence_prob(toy.behaviour_logits, toy.space)
    return mu @ per_sample_grads(toy, v, baseline)


def gradient_variance(toy: T.ToyProblem, v: KLVariant) -> float:
    """Per-sample gradient variance under mu: E_mu ||g - E g||^2 (trace of the covariance)."""
    mu = T.sequence_prob(toy.behaviour_logits, toy.space)
    g = per_sample_grads(toy, v)
    return float(mu @ ((g - mu @ g) ** 2).sum(-1))


@dataclass(frozen=True)
class ReferenceGrads:
    """Independent exact gradients the table is written in terms of (all under pi)."""

    g_star: torch.Tensor        # grad KL(pi || ref) over sequences
    token_reverse: torch.Tensor  # token-level reverse KL gradient (state distribution held fixed)
    token_forward: torch.Tensor  # token-level forward KL(ref || pi) gradient
    sum_k2: torch.Tensor        # grad E_pi[sum_t K2_t], state distribution differentiated too
    toy: T.ToyProblem | None = None  # for estimators without a closed form (contract_prediction)


def reference_grads(toy: T.ToyProblem) -> ReferenceGrads:
    """The exact gradients, over sequences, or (toy.env) over trajectories with environment
    turns: the policy's tokens only, the environment's drawn from its own table."""
    sp, ref, env = toy.space, toy.ref_logits, toy.env

    def e_sum_k2(x):
        lp, lr = T.token_logp(x, sp), T.token_logp(ref, sp)
        prob = T.token_logp(toy.world(x), sp).sum(-1).exp()
        return (prob * (0.5 * (lp - lr) ** 2 * toy.policy_mask).sum(-1)).sum()

    return ReferenceGrads(
        g_star=T.grad_of(lambda x: T.sequence_kl(x, ref, sp, env), toy.logits),
        token_reverse=T.grad_of(lambda x: T.token_kl(x, ref, sp, "reverse", env), toy.logits),
        token_forward=T.grad_of(lambda x: T.token_kl(x, ref, sp, "forward", env), toy.logits),
        sum_k2=T.grad_of(e_sum_k2, toy.logits),
        toy=toy,
    )


def on_policy_prediction(v: KLVariant, r: ReferenceGrads) -> torch.Tensor:
    """docs/design.md's on-policy table (importance is inert on-policy, so it is ignored). An
    estimator without a closed form here is predicted by its contract (`contract_prediction`)."""
    reward = {"k1": r.g_star, "k2": r.sum_k2 - r.token_reverse, "k3": r.g_star - r.token_forward}
    loss = {"k1": torch.zeros_like(r.g_star), "k2": r.token_reverse, "k3": r.token_forward}
    if v.estimator not in reward:
        return contract_prediction(r.toy, v)
    form = PLACEMENT_FORMS[v.placement]
    if not form.loss:
        return reward[v.estimator]
    if not form.reward:
        return loss[v.estimator]
    return reward[v.estimator] + loss[v.estimator]


def contract_prediction(toy: T.ToyProblem, v: KLVariant) -> torch.Tensor:
    """The on-policy expected gradient of any per-token estimator k_t = f(delta_t) in each
    placement, from f alone (kl.estimators.FORMULAS; kl.surrogate is not used):

      reward       grad_x E_pi[sum_t sg(k_t)] = E_pi[sum_t grad logp_t * sum_t' k_t']
                   (score function; with reward-to-go the same in expectation, by causality)
      loss         E_pi[sum_t grad k_t] = E_pi[sum_t f'(delta_t) grad logp_t]   (pathwise)
      reward+loss  their sum: grad E_pi[sum_t k_t], which is g* = grad KL(pi||ref) whenever f is
                   unbiased per token (E_pi(.|s)[f(delta)] = KL(pi(.|s)||ref(.|s)) at every s)

    Off-policy, `sequence` and `prefix` importance (uncapped) give the same expectations."""
    sp = toy.space

    def expected_sum(x: torch.Tensor, score: bool) -> torch.Tensor:
        lp = T.token_logp(x, sp)
        k = torch.where(sp.mask, estimate(lp, T.token_logp(toy.ref_logits, sp), v.estimator), 0.0)
        p = lp.sum(-1).exp()  # pi(y) of every sequence
        return (p * k.sum(-1).detach()).sum() if score else (p.detach() * k.sum(-1)).sum()

    out = torch.zeros(toy.logits.numel(), dtype=toy.logits.dtype)
    form = PLACEMENT_FORMS[v.placement]
    if form.reward:
        out = out + T.grad_of(lambda x: expected_sum(x, score=True), toy.logits)
    if form.loss:
        out = out + T.grad_of(lambda x: expected_sum(x, score=False), toy.logits)
    return out


def is_exact_correction(v: KLVariant) -> bool:
    """Sequence and prefix weights (uncapped) make the off-policy expectation equal the
    on-policy one; none and token do not (state and continuation shift remain)."""
    return IMPORTANCE_CORRECTIONS[v.importance].exact and v.truncate is None


def unbiased_for_g_star(v: KLVariant) -> bool:
    """The rows of the table whose expected gradient is g* (given an exact correction
    off-policy)."""
    return (v.estimator, v.placement) in {("k1", "reward"), ("k1", "reward+loss"),
                                          ("k3", "reward+loss")}


def truncated_prefix_bias(toy: T.ToyProblem, v: KLVariant) -> torch.Tensor:
    """Closed form of the truncated-prefix bias (written without kl.surrogate):
    -E_mu[sum_t (w_t - C)_+ (k_t sum_{s<=t} grad logp_s  [reward part]  +  grad k_t  [loss part])],
    the same with any baseline b independent of the sequence (its coefficient in kl.surrogate,
    min(w_{t-1}, C) rho_t, is exactly zero-mean)."""
    assert v.importance == "prefix" and v.truncate is not None
    sp = toy.space

    def closed_form(x):
        lp = T.token_logp(x, sp)
        lr, lm = T.token_logp(toy.ref_logits, sp), T.token_logp(toy.behaviour_logits, sp)
        w = torch.exp(torch.cumsum(lp.detach() - lm, -1))
        excess = torch.clamp(w - v.truncate, min=0.0) * sp.mask
        k = estimate(lp, lr, v.estimator) * sp.mask
        term = torch.zeros_like(lp)
        if PLACEMENT_FORMS[v.placement].reward:
            term = term + k.detach() * torch.cumsum(lp, -1)
        if PLACEMENT_FORMS[v.placement].loss:
            term = term + k
        mu = T.sequence_prob(toy.behaviour_logits, sp)
        return -(mu * (excess * term).sum(-1)).sum()

    return T.grad_of(closed_form, toy.logits)


def truncated_bias(toy: T.ToyProblem, v: KLVariant, baseline: float = 0.0) -> torch.Tensor:
    """Closed form of the bias of a capped importance coefficient against the same uncapped
    one, with a constant baseline b in the reward part (written without kl.surrogate).

    prefix: `truncated_prefix_bias`, whatever b is (the baseline's coefficient
    min(w_{t-1}, C) rho_t is exactly zero-mean). token (c_t = rho_t) and sequence (c_t = W):
        -E_mu[sum_t (c_t - C)_+ (grad logp_t (R_t - b)  [reward part]  +  grad k_t  [loss part])]
    so with a baseline their bias has the extra term +b E_mu[sum_t (c_t - C)_+ grad logp_t]."""
    assert v.importance in ("token", "sequence", "prefix") and v.truncate is not None
    if v.importance == "prefix":
        return truncated_prefix_bias(toy, v)
    sp = toy.space

    def closed_form(x):
        lp = T.token_logp(x, sp)
        lr, lm = T.token_logp(toy.ref_logits, sp), T.token_logp(toy.behaviour_logits, sp)
        log_rho = (lp.detach() - lm) * sp.mask
        # c_t written out here, not read from kl.surrogate's table, so the check is independent.
        log_c = (log_rho if v.importance == "token"
                 else log_rho.sum(-1, keepdim=True).expand_as(lp))
        excess = torch.clamp(torch.exp(log_c) - v.truncate, min=0.0) * sp.mask
        k = estimate(lp, lr, v.estimator) * sp.mask
        term = torch.zeros_like(lp)
        if PLACEMENT_FORMS[v.placement].reward:
            to_go = k.detach().flip(-1).cumsum(-1).flip(-1)
            term = term + lp * (to_go - baseline) * sp.mask
        if PLACEMENT_FORMS[v.placement].loss:
            term = term + k
        mu = T.sequence_prob(toy.behaviour_logits, sp)
        return -(mu * (excess * term).sum(-1)).sum()

    return T.grad_of(closed_form, toy.logits)


def relative_error(g: torch.Tensor, target: torch.Tensor) -> float:
    return float((g - target).norm() / target.norm().clamp_min(1e-300))


def cosine(g: torch.Tensor, target: torch.Tensor) -> float:
    denom = (g.norm() * target.norm()).clamp_min(1e-300)
    return float(g @ target / denom)
