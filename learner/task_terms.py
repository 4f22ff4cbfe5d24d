"""The task-term table (learner.task_off_policy): how the task policy-gradient term handles
data the current weights did not sample. One TASK_TERMS entry per name of
learner.task_term_traits' TaskOffPolicy, holding that name's traits (uses_ratio, masks);
learner.loss sums the per-token loss an entry returns over response tokens and divides it by
the constant N (never by the tokens a mask kept: a mask drops a token's
gradient, it does not scale up the others').

Notation (learner.loss): rho_t = pi_t / mu_t per response token, sg() stop-gradient, A the
task advantage (per token when the KL reward is folded into it), [low, high] the band
learner.mask_low / learner.mask_high, C = learner.tis_cap.

    none           -A logp_t
    tis            -sg(min(rho_t, C)) A logp_t
    ppo_clip       -min(rho_t A, clip(rho_t, 1-eps, 1+eps) A)             (rho_t live)
    icepop         -sg(rho_t 1[low <= rho_t <= high]) A logp_t             token-level mask
    mis            -sg(R_i 1[low <= R_i <= high]) A logp_t,  R_i = prod_t rho_t
    seq_mask_geo   -sg(min(rho_t, C) 1[low <= G_i <= high]) A logp_t,  G_i = R_i^(1/|y_i|)
    seq_mask_prod  -sg(min(rho_t, C) 1[low <= R_i <= high]) A logp_t

The masks (icepop, mis, seq_mask_*) are biased by design: a token outside the band loses its
gradient instead of being reweighted. How much, on the toy, is `klrl kl-table`'s mask table
(learner/exact_masks.py). The band always holds 1 (LearnerConfig's bounds), so on-policy
(rho = 1) nothing is masked and every entry has the gradient -A grad logp_t.

They act on the task term only. The `separate` KL term (kl.surrogate) never sees them: its
off-policy handling is kl.importance, and its gradient stays beta x the surrogate's whatever
the task term (learner/exact_table.py proves it per entry). A KL reward folded into the
advantage (kl.kl_in_advantage normalized / centered) is part of A, so a masked token loses
its KL-reward part too.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kl.registry import literal_names
from learner.config import LearnerConfig
from learner.task_term_traits import TASK_TERM_TRAITS, TaskOffPolicy, TaskTermTraits


@dataclass(frozen=True)
class TermTokens:
    """What a task term computed on a batch, [B, L] each (response positions meaningful).

    loss: the per-token loss (the caller zeroes positions off the response).
    clipped: tokens whose weight a cap or clip changed (None: the term clips nothing).
    masked: response tokens whose gradient a mask dropped (None: the term masks nothing).
    """

    loss: torch.Tensor
    clipped: torch.Tensor | None = None
    masked: torch.Tensor | None = None


@dataclass(frozen=True)
class TaskTerm:
    """One learner.task_off_policy: the task policy-gradient term against the behaviour
    (sampler) log-probs mu (the formulas are in the module docstring).

    tokens: (lp, mu, adv, mask, cfg) -> TermTokens.
    traits: what it is (learner.task_term_traits, their one home: uses_ratio, masks).
    """

    tokens: Callable[..., TermTokens]
    traits: TaskTermTraits

    @property
    def uses_ratio(self) -> bool:
        """It forms the ratios pi/mu (which must then be importance ratios)."""
        return self.traits.uses_ratio

    @property
    def masks(self) -> bool:
        """It drops tokens or samples outside [learner.mask_low, learner.mask_high]."""
        return self.traits.masks


def log_ratio(lp, mu, mask) -> torch.Tensor:
    """log pi - log mu in float64 (0 off-response): exp() of a float32 log-ratio overflows
    above ~88 (inf * 0 = NaN in backward even on a clipped branch)."""
    return torch.where(mask, lp.double() - mu.double(), 0.0)


def in_band(log_x: torch.Tensor, cfg: LearnerConfig) -> torch.Tensor:
    """exp(log_x) in [mask_low, mask_high], compared in log space (mask_low 0: no lower end)."""
    low = math.log(cfg.mask_low) if cfg.mask_low > 0 else -math.inf
    return (log_x >= low) & (log_x <= math.log(cfg.mask_high))


def sequence_log_ratio(log_rho: torch.Tensor, mask: torch.Tensor, *,
                       geometric: bool) -> torch.Tensor:
    """[B, 1] log R_i = sum_t log rho_t (the product ratio pi(y)/mu(y)), or its mean over the
    response tokens (the geometric mean; 0 for an empty response)."""
    s = log_rho.sum(-1, keepdim=True)
    return s / mask.sum(-1, keepdim=True).clamp(min=1) if geometric else s


def _plain_tokens(lp, mu, adv, mask, cfg: LearnerConfig) -> TermTokens:
    return TermTokens(-adv * lp)


def _capped(log_rho, cfg: LearnerConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """min(rho, C) and the tokens the cap touched (float64)."""
    log_cap = math.log(cfg.tis_cap)
    return torch.exp(log_rho.clamp(max=log_cap)), log_rho > log_cap


def _tis_tokens(lp, mu, adv, mask, cfg: LearnerConfig) -> TermTokens:
    w, capped = _capped(log_ratio(lp, mu, mask).detach(), cfg)
    return TermTokens(-w.to(lp.dtype) * adv * lp, clipped=capped & mask)


def _ppo_clip_tokens(lp, mu, adv, mask, cfg: LearnerConfig) -> TermTokens:
    rho = torch.exp(log_ratio(lp, mu, mask))
    a = adv.double()
    eps = cfg.ppo_clip_eps
    unclipped, clipped_obj = rho * a, rho.clamp(1 - eps, 1 + eps) * a
    obj = torch.minimum(unclipped, clipped_obj)
    clipped = (clipped_obj < unclipped) & mask  # the clipped (zero-gradient) branch was taken
    return TermTokens(-obj.to(lp.dtype), clipped=clipped)


def _icepop_tokens(lp, mu, adv, mask, cfg: LearnerConfig) -> TermTokens:
    log_rho = log_ratio(lp, mu, mask).detach()
    keep = in_band(log_rho, cfg)
    # exp of the clamped log-ratio: an out-of-band ratio is never formed, so never overflows
    w = torch.where(keep, torch.exp(log_rho.clamp(max=math.log(cfg.mask_high))), 0.0)
    return TermTokens(-w.to(lp.dtype) * adv * lp, masked=~keep & mask)


def _mis_tokens(lp, mu, adv, mask, cfg: LearnerConfig) -> TermTokens:
    log_seq = sequence_log_ratio(log_ratio(lp, mu, mask).detach(), mask, geometric=False)
    keep = in_band(log_seq, cfg)  # [B, 1]
    w = torch.where(keep, torch.exp(log_seq.clamp(max=math.log(cfg.mask_high))), 0.0)
    return TermTokens(-w.to(lp.dtype) * adv * lp, masked=~keep & mask)


def _sequence_mask(geometric: bool) -> Callable[..., TermTokens]:
    def tokens(lp, mu, adv, mask, cfg: LearnerConfig) -> TermTokens:
        log_rho = log_ratio(lp, mu, mask).detach()
        keep = in_band(sequence_log_ratio(log_rho, mask, geometric=geometric), cfg)  # [B, 1]
        w, capped = _capped(log_rho, cfg)
        w = torch.where(keep, w, 0.0)
        return TermTokens(-w.to(lp.dtype) * adv * lp, clipped=capped & keep & mask,
                          masked=~keep & mask)
    return tokens


_TOKENS: dict[str, Callable[..., TermTokens]] = {
    "none": _plain_tokens,
    "tis": _tis_tokens,
    "ppo_clip": _ppo_clip_tokens,
    "icepop": _icepop_tokens,
    "mis": _mis_tokens,
    "seq_mask_geo": _sequence_mask(geometric=True),
    "seq_mask_prod": _sequence_mask(geometric=False),
}
TASK_TERMS: dict[str, TaskTerm] = {
    name: TaskTerm(_TOKENS[name], traits) for name, traits in TASK_TERM_TRAITS.items()}
literal_names(TaskOffPolicy, TASK_TERMS, table_name="learner.task_terms.TASK_TERMS",
              literal_name="TaskOffPolicy", kind="task off-policy handlings")
