"""Per-token KL estimators K1, K2, K3 (Schulman's naming).

With delta_t = log pi(y_t|s_t) - log pi_ref(y_t|s_t) and y_t ~ pi:
- K1 = delta                    unbiased for KL(pi||ref) per token, high variance, can be < 0
- K2 = delta^2 / 2              biased, >= 0; its gradient is the token-level reverse KL gradient
- K3 = exp(-delta) - 1 + delta  unbiased, >= 0, low variance; computed with expm1 for accuracy

What each estimator's *gradient* does depends on where it is placed (reward or loss) and on
the importance correction; see `kl.surrogate` and the table in docs/kl.md.

Adding an estimator (docs/extending.md): its formula as a function of delta, its name
in the `Estimator` Literal (the one home of the names: KLConfig, ESTIMATORS, the exact tests
and `klrl kl-table` read it) and in FORMULAS, its table (the form of kl.registry). FORMULAS is
read at every call, so a test can try a formula on the exact toy (kl.analysis) before it is
added to the Literal. No torch at import (the formulas call the tensors' own methods): the
configs read the names here without loading it.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from kl.registry import literal_names, lookup

if TYPE_CHECKING:
    import torch

Estimator = Literal["k1", "k2", "k3"]


def k1(delta: torch.Tensor) -> torch.Tensor:
    return delta


def k2(delta: torch.Tensor) -> torch.Tensor:
    return 0.5 * delta * delta


def k3(delta: torch.Tensor) -> torch.Tensor:
    # exp(-d) - 1 + d == expm1(-d) + d; expm1 keeps precision for small |d|.
    return (-delta).expm1() + delta


Formula = Callable[["torch.Tensor"], "torch.Tensor"]
# name -> per-token estimate as a function of delta = logp - ref_logp (elementwise, autograd
# through delta). Exactly the Literal's names, in its order (checked at import).
FORMULAS: dict[str, Formula] = {"k1": k1, "k2": k2, "k3": k3}
ESTIMATORS: tuple[str, ...] = literal_names(
    Estimator, FORMULAS, table_name="kl.estimators.FORMULAS", literal_name="Estimator",
    kind="estimators")


def estimate(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    estimator: Estimator = "k1",
    *,
    clamp_delta: float | None = None,
) -> torch.Tensor:
    """Per-token KL estimate of KL(pi || pi_ref) from log-probs of the sampled tokens.

    Args:
        logp: log pi(y_t|s_t), any shape; gradients flow through it.
        ref_logp: log pi_ref(y_t|s_t), same shape (treated as a constant by callers).
        estimator: a name of FORMULAS ("k1", "k2" or "k3").
        clamp_delta: opt-in clamp of delta to [-c, c] before the estimator. It is BIASED
            (it changes both the value and the gradient wherever |delta| > c) and exists only
            as a last-resort guard; None (the default) computes the exact estimator.
    """
    formula = lookup(FORMULAS, estimator, "estimator")  # read at each call (see above)
    delta = logp - ref_logp
    if clamp_delta is not None:
        if clamp_delta <= 0:
            raise ValueError(f"clamp_delta must be > 0, got {clamp_delta}")
        delta = delta.clamp(-clamp_delta, clamp_delta)
    return formula(delta)
