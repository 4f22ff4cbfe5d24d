"""KL surrogate losses whose autograd gradient is a documented estimate of grad KL.

Contract (tested exactly by enumeration in tests/test_kl_exact.py): for sequences drawn from
the sampler mu, the expectation of grad_logp of `surrogate(...)` is the configuration's KL
gradient estimate as defined in docs/design.md (What each KL configuration computes). With beta = 1 and sg() the
stop-gradient:

  R_t = sum_{t'>=t} k_t'                       (KL as a per-token reward, reward-to-go)
  rho_t = pi/mu per token, w_t = prod_{s<=t} rho_s (prefix weight), W = w_T (sequence weight)

  placement "reward" (score-function term; KL treated as a cost in the return):
    none      sum_t logp_t * sg(R_t - b)
    token     sum_t rho_t(live) * sg(R_t - b)         truncate: sg(min(rho_t,C)) * logp_t * sg(R_t - b)
    sequence  sg(W) * sum_t logp_t * sg(R_t - b)      truncate: sg(min(W,C)) * ...
    prefix    sum_t w_t(live) * sg(k_t) - sum_t logp_t * sg(w_t b)
              truncate: sum_t logp_t * sg(sum_{t'>=t} min(w_t',C) k_t' - min(w_{t-1},C) rho_t b)
  placement "loss" (estimator differentiated as a loss; b is not used):
    none sum_t k_t;  token sum_t sg(rho_t) k_t;  sequence sg(W) sum_t k_t;  prefix sum_t sg(w_t) k_t
    (truncate caps each coefficient at C)
  placement "reward+loss": reward part + loss part with the same option, except prefix, which
    is the unified sum_t w_t(live) k_t(live) - sum_t logp_t sg(w_t b) (same gradient as the
    sum of the parts); truncate: sum_t sg(min(w_t,C)/w_t) w_t(live) k_t(live) - ...

`b` is an optional per-sequence baseline (`baseline`, e.g. the leave-one-out mean of the other
samples' sequence KL). When b does not depend on the sequence itself its term has zero
expectation on-policy, and off-policy whenever importance != "none" and the coefficient is
not capped (with importance "none" off-policy, E_mu[grad log pi] != 0 and a baseline adds
bias), so it only reduces variance. Capped: the prefix form weights b by
min(w_{t-1}, C) rho_t (w_0 = 1), which keeps it exactly zero-mean, so the truncated prefix
bias is the closed form of kl.analysis.truncated_prefix_bias whatever b is; token and
sequence weight b by their capped coefficient min(c_t, C), which adds
+b E_mu[sum_t (c_t - C)_+ grad logp_t] to their bias (kl.analysis.truncated_bias).

Invariants enforced here:
- Masked positions contribute nothing whatever they contain (NaN, inf): inputs are replaced by
  zeros there before any arithmetic, so neither values nor gradients can be poisoned.
- Sums over tokens; there is deliberately no division by each sequence's own length (that
  reweights sequences by 1/|y| and biases the gradient). Callers may divide by a constant.
- Importance ratios are formed in log space in float64 (float32 would overflow exp() at
  log-weights above ~88, which long sequences reach off-policy), then cast back.
"""
from __future__ import annotations

import math
from typing import Literal

import torch

from kl.estimators import Estimator, estimate

Placement = Literal["reward", "loss", "reward+loss"]
Importance = Literal["none", "token", "sequence", "prefix"]
PLACEMENTS: tuple[str, ...] = ("reward", "loss", "reward+loss")
IMPORTANCES: tuple[str, ...] = ("none", "token", "sequence", "prefix")


def _reverse_cumsum(x: torch.Tensor) -> torch.Tensor:
    """out[:, t] = sum_{t' >= t} x[:, t']."""
    return x.flip(-1).cumsum(-1).flip(-1)


def importance_log_coef(log_rho: torch.Tensor, importance: Importance) -> torch.Tensor:
    """log of the importance coefficient per token from per-token log-ratios log(pi/mu)
    (0 on masked positions): token rho_t, sequence W (every position), prefix w_t."""
    if importance == "token":
        return log_rho
    if importance == "sequence":
        return log_rho.sum(-1, keepdim=True).expand_as(log_rho)
    if importance == "prefix":
        return log_rho.cumsum(-1)
    raise ValueError(f"importance_log_coef needs token, sequence or prefix, got {importance!r}")


def _check_inputs(logp, ref_logp, mask, behaviour_logp, estimator, placement, importance, truncate):
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    if importance not in IMPORTANCES:
        raise ValueError(f"importance must be one of {IMPORTANCES}, got {importance!r}")
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, T], got shape {tuple(logp.shape)}")
    for name, t in (("ref_logp", ref_logp), ("mask", mask), ("behaviour_logp", behaviour_logp)):
        if t is not None and t.shape != logp.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != logp shape {tuple(logp.shape)}")
    if importance != "none" and behaviour_logp is None:
        raise ValueError(f"importance={importance!r} needs behaviour_logp (the sampler's log-probs)")
    if truncate is not None:
        if importance == "none":
            raise ValueError("truncate caps an importance coefficient; it needs importance != 'none'")
        if not truncate > 0:
            raise ValueError(f"truncate must be > 0, got {truncate}")


def surrogate(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    estimator: Estimator = "k1",
    placement: Placement = "reward",
    importance: Importance = "none",
    behaviour_logp: torch.Tensor | None = None,
    truncate: float | None = None,
    baseline: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-sequence KL surrogate loss (beta = 1, to be minimised); returns Tensor[B].

    Args:
        logp: [B, T] current-policy log-probs of the sampled tokens (live, requires grad).
        ref_logp: [B, T] reference-policy log-probs (constant).
        mask: [B, T] 1/True on response tokens, 0/False on prompt and padding.
        estimator: "k1" | "k2" | "k3" (see kl.estimators).
        placement: "reward" | "loss" | "reward+loss".
        importance: "none" | "token" | "sequence" | "prefix"; all but "none" need behaviour_logp.
        behaviour_logp: [B, T] log-probs of the distribution that sampled the tokens (mu).
        truncate: cap C > 0 on the importance coefficient (None: no cap).
        baseline: optional [B] baseline subtracted from the KL return in the reward part.
    """
    _check_inputs(logp, ref_logp, mask, behaviour_logp, estimator, placement, importance, truncate)
    m = mask.bool()
    out_dtype = torch.promote_types(logp.dtype, torch.float32)
    zero = torch.zeros((), dtype=out_dtype, device=logp.device)
    # Sanitise first: masked entries become exact zeros (with zero gradient) before any math.
    lp = torch.where(m, logp.to(out_dtype), zero)
    ref = torch.where(m, ref_logp.detach().to(out_dtype), zero)
    k = torch.where(m, estimate(lp, ref, estimator), zero)

    # Importance coefficient per token (float64 log space). coef_cap = min(c, C), detached.
    # coef_live has the same value but carries grad: exp(log_cap + log_c - sg(log_c)), so
    # grad coef_live = min(c, C) * grad log c. It never forms c itself, so a capped
    # coefficient stays finite however large the log-ratio is.
    coef_live = coef_cap = coef_base = None
    if importance != "none":
        mu = torch.where(m, behaviour_logp.detach().to(out_dtype), zero)
        log_rho = torch.where(m, lp.double() - mu.double(), 0.0)  # live
        log_c = importance_log_coef(log_rho, importance)
        log_cap = log_c.detach()
        if truncate is not None:
            log_cap = log_cap.clamp(max=math.log(truncate))
        coef_live = torch.where(m, torch.exp(log_cap + log_c - log_c.detach()).to(out_dtype), zero)
        coef_cap = coef_live.detach()
        if importance == "prefix" and truncate is not None:
            # The baseline's coefficient: min(w_{t-1}, C) rho_t, not min(w_t, C). A function of
            # the prefix before t times rho_t has E_mu[. grad logp_t | s_t] = 0 exactly, so the
            # baseline stays zero-mean under the cap (min(w_t, C) b would add
            # +b E_mu[(w_t - C)_+ grad logp_t]); uncapped it is w_t, the same coefficient.
            lr = log_rho.detach()
            log_base = (log_c.detach() - lr).clamp(max=math.log(truncate)) + lr
            coef_base = torch.where(m, torch.exp(log_base).to(out_dtype), zero)

    b = zero if baseline is None else baseline.detach().to(out_dtype).reshape(-1, 1)
    total = torch.zeros(lp.shape[0], dtype=out_dtype, device=lp.device)
    unified_prefix = placement == "reward+loss" and importance == "prefix"
    if placement in ("reward", "reward+loss"):
        total = total + _reward_part(lp, k, m, b, importance, coef_live,
                                     coef_cap if coef_base is None else coef_base, unified_prefix)
    if placement in ("loss", "reward+loss") and not unified_prefix:
        weights = torch.ones_like(k) if importance == "none" else coef_cap
        total = total + (weights * k).sum(-1)
    return total


def _reward_part(lp, k, m, b, importance, coef_live, coef_b, unified_prefix):
    """Score-function (KL-as-reward) term. With `unified_prefix` it also carries the loss part.
    coef_b: the (detached) coefficient of the baseline; for token and sequence the capped
    coefficient itself."""
    mf = m.to(lp.dtype)
    ret = (_reverse_cumsum(k) - b).detach() * mf  # KL return-to-go minus baseline
    if importance == "none":
        return (lp * ret).sum(-1)
    if importance == "token":
        return (coef_live * ret).sum(-1)  # grad = min(rho_t, C) * grad logp_t * R_t
    if importance == "sequence":
        return (coef_b * lp * ret).sum(-1)
    # prefix (per-decision IS). w_t(live) * sg(k_t) has gradient
    #   sum_t min(w_t, C) k_t sum_{s<=t} grad logp_s = sum_s grad logp_s sum_{t>=s} min(w_t, C) k_t,
    # i.e. exactly the truncated form sum_t logp_t * sg(sum_{t'>=t} min(w_t', C) k_t').
    base_term = (lp * (coef_b * b).detach() * mf).sum(-1)  # zero-mean under mu, capped or not
    k_term = k if unified_prefix else k.detach()
    return (coef_live * k_term).sum(-1) - base_term
