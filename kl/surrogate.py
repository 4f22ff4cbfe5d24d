"""KL surrogate losses whose autograd gradient is a documented estimate of grad KL.

Contract (tested exactly by enumeration in tests/test_kl_exact.py): for sequences drawn from
the sampler mu, the expectation of grad_logp of `surrogate(...)` is the configuration's KL
gradient estimate as defined in docs/design.md (What each KL configuration computes). With
beta = 1 and sg() the stop-gradient:

  R_t = sum_{t'>=t} k_t'                       (KL as a per-token reward, reward-to-go)
  rho_t = pi/mu per token, w_t = prod_{s<=t} rho_s (prefix weight), W = w_T (sequence weight)

  placement "reward" (score-function term; KL treated as a cost in the return):
    none      sum_t logp_t * sg(R_t - b)
    token     sum_t rho_t(live) * sg(R_t - b)
              truncate: sg(min(rho_t,C)) * logp_t * sg(R_t - b)
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

Each placement is an entry of PLACEMENT_FORMS (the parts it adds) and each importance one of
IMPORTANCE_CORRECTIONS (its coefficient and its reward part), in kl.registry's form: `surrogate`
asks the two entries and compares no name.

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
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kl.estimators import Estimator, estimate
from kl.registry import literal_names, lookup
from kl.traits import (
    IMPORTANCE_TRAITS,
    PLACEMENT_FORMS,
    REWEIGHTING,
    Importance,
    ImportanceTraits,
    Placement,
)


def _reverse_cumsum(x: torch.Tensor) -> torch.Tensor:
    """out[:, t] = sum_{t' >= t} x[:, t']."""
    return x.flip(-1).cumsum(-1).flip(-1)


@dataclass(frozen=True)
class RewardTerms:
    """What the reward part of every importance correction is written in ([B, T] tensors, 0 on
    masked positions, except `b` [B, 1]).

    lp: live log-probs; k: the per-token estimates, live only where this reward part also
    carries the loss part (ImportanceCorrection.carries_loss), else detached; ret: the KL
    return-to-go minus the baseline, sg(R_t - b); b: the baseline; mask: the float mask;
    coef_live: the importance coefficient carrying the gradient min(c, C) grad log c (None
    without a correction); coef_b: the baseline's detached coefficient."""

    lp: torch.Tensor
    k: torch.Tensor
    ret: torch.Tensor
    b: torch.Tensor
    mask: torch.Tensor
    coef_live: torch.Tensor | None
    coef_b: torch.Tensor | None


@dataclass(frozen=True)
class ImportanceCorrection:
    """One kl.importance: how it reweights the KL term toward pi when mu sampled the tokens.

    log_coef: the per-token log-coefficient from the per-token log-ratios log(pi/mu) (0 on
        masked positions); None: no correction (and no behaviour_logp needed).
    reward_part: the score-function (KL-as-reward) term per sequence [B] from RewardTerms.
    capped_baseline_log_coef: under a cap C, the baseline's log-coefficient from (log c,
        log rho, log C) when it is not the capped coefficient min(c, C) itself; None: it is.
    traits: what it is (kl.traits, their one home: reweights, carries_loss, exact).
    """

    traits: ImportanceTraits
    log_coef: Callable[[torch.Tensor], torch.Tensor] | None
    reward_part: Callable[[RewardTerms], torch.Tensor]
    capped_baseline_log_coef: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None \
        = None

    def __post_init__(self) -> None:
        if self.traits.reweights != (self.log_coef is not None):
            raise ImportError("an importance correction reweights exactly when it has a "
                              "coefficient (kl.traits.IMPORTANCE_TRAITS vs its log_coef)")

    @property
    def reweights(self) -> bool:
        """Whether it has a coefficient (and so needs behaviour_logp and may be capped)."""
        return self.traits.reweights

    @property
    def carries_loss(self) -> bool:
        """Its reward part with live estimates is also the loss part (one reward+loss term)."""
        return self.traits.carries_loss

    @property
    def exact(self) -> bool:
        """Uncapped, its expectation off-policy is the on-policy one."""
        return self.traits.exact


def _unweighted_reward(t: RewardTerms) -> torch.Tensor:
    return (t.lp * t.ret).sum(-1)


def _token_reward(t: RewardTerms) -> torch.Tensor:
    return (t.coef_live * t.ret).sum(-1)  # grad = min(rho_t, C) * grad logp_t * R_t


def _sequence_reward(t: RewardTerms) -> torch.Tensor:
    return (t.coef_b * t.lp * t.ret).sum(-1)


def _prefix_reward(t: RewardTerms) -> torch.Tensor:
    # Per-decision IS. w_t(live) * sg(k_t) has gradient
    #   sum_t min(w_t, C) k_t sum_{s<=t} grad logp_s = sum_s grad logp_s sum_{t>=s} min(w_t, C) k_t,
    # i.e. exactly the truncated form sum_t logp_t * sg(sum_{t'>=t} min(w_t', C) k_t').
    base_term = (t.lp * (t.coef_b * t.b).detach() * t.mask).sum(-1)  # zero-mean, capped or not
    return (t.coef_live * t.k).sum(-1) - base_term


def _prefix_capped_baseline_log_coef(log_c: torch.Tensor, log_rho: torch.Tensor,
                                     log_cap: float) -> torch.Tensor:
    # min(w_{t-1}, C) rho_t, not min(w_t, C): a function of the prefix before t times rho_t has
    # E_mu[. grad logp_t | s_t] = 0 exactly, so the baseline stays zero-mean under the cap
    # (min(w_t, C) b would add +b E_mu[(w_t - C)_+ grad logp_t]); uncapped it is w_t.
    return (log_c - log_rho).clamp(max=log_cap) + log_rho


_TRAITS = IMPORTANCE_TRAITS
IMPORTANCE_CORRECTIONS: dict[str, ImportanceCorrection] = {
    "none": ImportanceCorrection(_TRAITS["none"], None, _unweighted_reward),
    "token": ImportanceCorrection(_TRAITS["token"], lambda log_rho: log_rho,          # rho_t
                                  _token_reward),
    "sequence": ImportanceCorrection(                                                # W
        _TRAITS["sequence"], lambda log_rho: log_rho.sum(-1, keepdim=True).expand_as(log_rho),
        _sequence_reward),
    "prefix": ImportanceCorrection(                                                  # w_t
        _TRAITS["prefix"], lambda log_rho: log_rho.cumsum(-1), _prefix_reward,
        _prefix_capped_baseline_log_coef),
}
literal_names(Importance, IMPORTANCE_CORRECTIONS,
              table_name="kl.surrogate.IMPORTANCE_CORRECTIONS", literal_name="Importance",
              kind="importance corrections")


def importance_log_coef(log_rho: torch.Tensor, importance: Importance) -> torch.Tensor:
    """log of the importance coefficient per token from per-token log-ratios log(pi/mu)
    (0 on masked positions): token rho_t, sequence W (every position), prefix w_t."""
    correction = lookup(IMPORTANCE_CORRECTIONS, importance, "importance")
    if not correction.reweights:
        raise ValueError(f"importance_log_coef needs one of {REWEIGHTING}, got {importance!r}")
    return correction.log_coef(log_rho)


def _check_inputs(logp, ref_logp, mask, behaviour_logp, placement, importance, truncate):
    """The placement's and the importance's table entries, once the inputs are known valid."""
    form = lookup(PLACEMENT_FORMS, placement, "placement")
    correction = lookup(IMPORTANCE_CORRECTIONS, importance, "importance")
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, T], got shape {tuple(logp.shape)}")
    for name, t in (("ref_logp", ref_logp), ("mask", mask), ("behaviour_logp", behaviour_logp)):
        if t is not None and t.shape != logp.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != logp shape {tuple(logp.shape)}")
    if correction.reweights and behaviour_logp is None:
        raise ValueError(f"importance={importance!r} needs behaviour_logp (the sampler's "
                         "log-probs)")
    if truncate is not None:
        if not correction.reweights:
            raise ValueError("truncate caps an importance coefficient; it needs an importance "
                             f"among {REWEIGHTING}, got {importance!r}")
        if not truncate > 0:
            raise ValueError(f"truncate must be > 0, got {truncate}")
    return form, correction


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
        estimator: a name of kl.estimators.FORMULAS ("k1" | "k2" | "k3").
        placement: a name of PLACEMENT_FORMS ("reward" | "loss" | "reward+loss").
        importance: a name of IMPORTANCE_CORRECTIONS ("none" | "token" | "sequence" |
            "prefix"); all but "none" need behaviour_logp.
        behaviour_logp: [B, T] log-probs of the distribution that sampled the tokens (mu).
        truncate: cap C > 0 on the importance coefficient (None: no cap).
        baseline: optional [B] baseline subtracted from the KL return in the reward part.
    """
    form, correction = _check_inputs(logp, ref_logp, mask, behaviour_logp, placement,
                                     importance, truncate)
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
    coef_live = coef_cap = coef_b = None
    if correction.reweights:
        mu = torch.where(m, behaviour_logp.detach().to(out_dtype), zero)
        log_rho = torch.where(m, lp.double() - mu.double(), 0.0)  # live
        log_c = correction.log_coef(log_rho)
        log_cap = log_c.detach()
        if truncate is not None:
            log_cap = log_cap.clamp(max=math.log(truncate))
        coef_live = torch.where(m, torch.exp(log_cap + log_c - log_c.detach()).to(out_dtype), zero)
        coef_b = coef_cap = coef_live.detach()
        if correction.capped_baseline_log_coef is not None and truncate is not None:
            log_base = correction.capped_baseline_log_coef(
                log_c.detach(), log_rho.detach(), math.log(truncate))
            coef_b = torch.where(m, torch.exp(log_base).to(out_dtype), zero)

    b = zero if baseline is None else baseline.detach().to(out_dtype).reshape(-1, 1)
    total = torch.zeros(lp.shape[0], dtype=out_dtype, device=lp.device)
    # The loss part rides in the reward part where the correction unifies them (prefix).
    unified = form.reward and form.loss and correction.carries_loss
    if form.reward:
        mf = m.to(lp.dtype)
        ret = (_reverse_cumsum(k) - b).detach() * mf  # KL return-to-go minus baseline
        terms = RewardTerms(lp, k if unified else k.detach(), ret, b, mf, coef_live, coef_b)
        total = total + correction.reward_part(terms)
    if form.loss and not unified:
        weights = torch.ones_like(k) if coef_cap is None else coef_cap
        total = total + (weights * k).sum(-1)
    return total
