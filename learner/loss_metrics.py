"""What the learner logs about its loss, and how those numbers merge into one training step's.

`step_metrics` is the no-grad pass over the tensors one `learner.loss.policy_loss` call used:
the loss terms, the importance ratios pi/mu, the KL estimates of kl.diagnostics, the response
counts and, where they apply, the entropy, the fraction of tokens a cap or a clip touched and
the fractions of tokens and of samples a mask dropped.

`merge_metrics` combines the parts of one update (micro-batches of a rank, then ranks) and
`merge_updates` the updates of one step. Both take each key's extreme or mean by one rule
(`_extreme_or_mean`): *_min keys the min, *_max keys the max, every other key a mean, whose
weights are what differs between the two merges.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

from kl.config import KLConfig
from kl.diagnostics import sequence_kl_estimates
from kl.surrogate import importance_log_coef


def step_metrics(terms: dict[str, torch.Tensor], *, lp: torch.Tensor, ref: torch.Tensor,
                 mu: torch.Tensor, mask: torch.Tensor, entropy: torch.Tensor | None,
                 kl_cfg: KLConfig, task_off_policy: str,
                 task_clipped: torch.Tensor | None,
                 task_masked: torch.Tensor | None = None,
                 fresh: torch.Tensor | None = None) -> dict[str, float]:
    """The metrics of one loss evaluation, computed without gradients.

    terms: the loss and its parts as scalars, keys "total", "task", "kl" and, when
        learner.entropy_coef > 0, "entropy" (logged as loss/<key>).
    lp / ref / mu: [B, L] current, reference and behaviour log-probs, 0 off-response.
    mask: [B, L] response tokens. entropy: [B, L] per-token entropy (None: not logged).
    task_clipped: [B, L] tokens the task term's cap or clip touched (None: no such term).
    task_masked: [B, L] response tokens whose task gradient a mask dropped (None: the term
        masks nothing). Logged as is/masked_token_frac (of response tokens) and
        is/masked_sample_frac (of samples with at least one masked token: under a sequence
        mask, the samples dropped whole).
    fresh: [B, L] the response tokens sampled by the weights being trained (token lag 0; None:
        not known). On them |log pi - log mu| holds no policy drift: on update 0 it is the
        learner/sampler mismatch alone, plus, with rollout.stale_kv=keep, what sampling over
        a prefix cache the previous weights computed changed (is/fresh_tokens counts them).
    """
    with torch.no_grad():
        log_rho = torch.where(mask, lp.double() - mu.double(), 0.0)
        tokens = int(mask.sum())
        if tokens:
            ratio = torch.exp(log_rho[mask])
            ratio_min, ratio_max = float(ratio.min()), float(ratio.max())
            # |log pi - log mu| per response token: at max_lag 0 (update 0 of a batch) the
            # learner/sampler numerics mismatch itself (docs/gpu.md); otherwise lag included.
            abs_log_ratio = log_rho[mask].abs()
            abs_lr_mean, abs_lr_max = float(abs_log_ratio.mean()), float(abs_log_ratio.max())
        else:  # no response token at all: nothing to compare, report the neutral ratio
            ratio_min = ratio_max = 1.0
            abs_lr_mean = abs_lr_max = 0.0
        estimates = sequence_kl_estimates(lp, ref, mu, mask)
        metrics = {
            "loss/total": float(terms["total"].detach()),
            "loss/task": float(terms["task"].detach()),
            "loss/kl": float(terms["kl"].detach()),
            **{f"kl/{name}": float(v.mean()) for name, v in estimates.items()},
            "is/ratio_min": ratio_min,
            "is/ratio_max": ratio_max,
            "is/abs_log_ratio_token_mean": abs_lr_mean,
            "is/abs_log_ratio_max": abs_lr_max,
            "response/length_mean": float(mask.sum(-1).double().mean()),
            "response/tokens": float(tokens),
            "response/sequences": float(mask.shape[0]),
        }
        if fresh is not None:
            fresh_tokens = int(fresh.sum())
            metrics["is/fresh_tokens"] = float(fresh_tokens)
            metrics[FRESH_KEY] = (float(log_rho[fresh].abs().mean()) if fresh_tokens else 0.0)
        if entropy is not None:
            metrics["policy/entropy"] = float(entropy[mask].sum()) / tokens if tokens else 0.0
            if "entropy" in terms:
                metrics["loss/entropy"] = float(terms["entropy"].detach())
        if kl_cfg.truncate is not None:
            log_c = importance_log_coef(log_rho, kl_cfg.importance)
            metrics["is/truncated_frac"] = _frac((log_c > math.log(kl_cfg.truncate)) & mask,
                                                 tokens)
        if task_clipped is not None:
            metrics[f"is/{task_off_policy}_clipped_frac"] = _frac(task_clipped, tokens)
        if task_masked is not None:
            metrics["is/masked_token_frac"] = _frac(task_masked, tokens)
            metrics[MASKED_SAMPLES_KEY] = float(task_masked.any(-1).double().mean())
    return metrics


def _frac(flags: torch.Tensor, tokens: int) -> float:
    return float(flags.sum()) / tokens if tokens else 0.0


def _extreme_or_mean(key: str, vals: list[float],
                     mean: Callable[[list[float]], float]) -> float:
    """The merging rule both merges share: *_min keys the min, *_max keys the max, every other
    key `mean` of the values."""
    if key.endswith("_min"):
        return min(vals)
    if key.endswith("_max"):
        return max(vals)
    return mean(vals)


COUNT_KEYS = ("response/tokens", "response/sequences", "is/fresh_tokens")
# The mean over the fresh tokens (step_metrics' `fresh`): weighted by their count, since a
# part may hold none (its 0 then weighs nothing).
FRESH_KEY = "is/abs_log_ratio_fresh_token_mean"
# A share of samples (per sequence, though it ends in _frac): merged sequence-weighted.
MASKED_SAMPLES_KEY = "is/masked_sample_frac"
# Per-token averages without a *_frac or *_token_mean suffix: merged token-weighted like those.
TOKEN_MEAN_KEYS = ("policy/entropy",)


def merge_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """One update's metrics from its parts' (micro-batches of a rank, then ranks). loss/* are
    sums over tokens / N with the global N, so they add, and so do COUNT_KEYS; otherwise the
    shared rule, with *_frac, *_token_mean and TOKEN_MEAN_KEYS (per-token averages) weighted by
    the parts' tokens and every other key (per-sequence means such as response/length_mean and
    MASKED_SAMPLES_KEY, and rank-level scalars such as grad/norm, equal on every rank) by their
    sequences."""
    if not parts:
        return {}
    seqs = [p.get("response/sequences", 1.0) for p in parts]
    toks = [p.get("response/tokens", 1.0) for p in parts]
    out: dict[str, float] = {}
    for key in parts[0]:
        vals = [p[key] for p in parts]
        if key.startswith("loss/") or key in COUNT_KEYS:
            out[key] = sum(vals)
        else:
            per_token = (key.endswith(("_frac", "_token_mean")) or key in TOKEN_MEAN_KEYS) \
                and key != MASKED_SAMPLES_KEY
            weights = toks if per_token else seqs
            if key == FRESH_KEY:
                weights = [p.get("is/fresh_tokens", 0.0) for p in parts]
            out[key] = _extreme_or_mean(key, vals, lambda v, w=weights: _weighted(v, w))
    return out


def _weighted(vals, weights) -> float:
    total = sum(weights)
    if total == 0:
        return sum(vals) / len(vals)
    return sum(v * w for v, w in zip(vals, weights)) / total


# Per-update metrics shown for each update when a batch takes several optimizer steps: the
# importance ratios say how far off-policy each update's data is (update 0 at max_lag 0: 1 up
# to the learner/sampler numerics, which update_0/is/abs_log_ratio_* then measure alone).
PER_UPDATE_KEYS = ("is/ratio_min", "is/ratio_max", "is/abs_log_ratio_token_mean",
                   "is/abs_log_ratio_max", FRESH_KEY, "loss/total", "kl/pi_ref")
TIME_KEYS = ("time/learner_step", "time/reference")  # seconds spent: they add up


def merge_updates(updates: list[dict[str, float]], mini_batches: int) -> dict[str, float]:
    """One training step's metrics from its updates' (each already merged over micro-batches
    and ranks). One update: its metrics unchanged. Several: COUNT_KEYS over the first pass (the
    batch itself), TIME_KEYS summed, every other key by the shared rule with a plain mean;
    `nonfinite` 1 only if every update was refused, with `nonfinite/updates_refused` counting
    them; plus `update_<k>/<key>` for PER_UPDATE_KEYS."""
    if len(updates) == 1:
        return dict(updates[0])
    first_pass = updates[:mini_batches]
    out: dict[str, float] = {}
    for key in updates[0]:
        vals = [u[key] for u in updates]
        if key in COUNT_KEYS:
            out[key] = sum(u[key] for u in first_pass)
        elif key in TIME_KEYS:
            out[key] = sum(vals)
        else:
            out[key] = _extreme_or_mean(key, vals, lambda v: sum(v) / len(v))
    refused = sum(u["nonfinite"] for u in updates)
    out["nonfinite"] = float(refused == len(updates))
    out["nonfinite/updates_refused"] = float(refused)
    for k, u in enumerate(updates):
        out.update({f"update_{k}/{key}": u[key] for key in PER_UPDATE_KEYS if key in u})
    return out
