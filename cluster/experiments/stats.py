"""The tests behind the findings (findings.py), each with the numbers a reader needs to recheck
it: Welch's t-test (its own Welch-Satterthwaite degrees of freedom), Fisher's exact test for
counts of broken runs, the exact binomial test for one configuration's break rate, and Holm's
correction across claims. The p-values are scipy.stats'; this module adds only what scipy
leaves to the caller: Welch's p-value without ttest_ind's overhead, a margin for
non-superiority tests, the smallest p-value a discrete test
can reach with the margins it is given (a claim that cannot reach its level is "not testable
here", Tarone's rule), and the report's wording.

Error rates of the rules built on these tests are simulated in tests/test_stats.py against the
figures stated in the pre-registration (docs/sweeps/preregistration.yaml, `design:`).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from scipy import stats as st
from scipy.special import stdtr

Alternative = Literal["greater", "less"]


@dataclass(frozen=True)
class Test:
    """One test's result. `p` is NaN when the data cannot be tested (fewer than two values in
    a group for Welch's t); `min_p` is the smallest p-value the test could have given with
    these group sizes and (Fisher) these margins, whatever the outcome."""

    kind: Literal["welch", "fisher", "binomial"]
    p: float
    min_p: float
    text: str      # the statistic, its degrees of freedom and p, as the report prints them
    effect: str = ""  # the effect size (Welch: difference of means and Cohen's d)

    @property
    def testable(self) -> bool:
        return math.isfinite(self.p)


def reaches(p: float, level: float) -> bool:
    """p <= level, up to floating-point error (Fisher's 1/20 must reach 0.05)."""
    return p <= level * (1 + 1e-9)


def _p(p: float) -> str:
    return "p < 1e-6" if p < 1e-6 else f"p = {p:.2g}" if p < 0.01 else f"p = {p:.3f}"


def welch(a: Sequence[float], b: Sequence[float], alternative: Alternative = "greater",
          margin: float = 0.0) -> Test:
    """Welch's t-test of mean(a) - mean(b) against `margin`: "greater" shows a difference above
    it, "less" one below it (a non-superiority test when margin > 0: a's lead is shown to be
    smaller than the margin, b ahead included). t and its Welch-Satterthwaite df as
    scipy.stats.ttest_ind(equal_var=False) computes them (tests/test_stats.py checks they
    agree), the p-value from Student's t distribution (scipy.special.stdtr: the simulations of
    the rules call this thousands of times, ttest_ind costs a thousand times more). Effect size:
    the difference of means and Cohen's d on the average of the two variances. Two groups
    without spread and a difference beyond the margin give t = +/-inf, p = 0."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    if len(a) < 2 or len(b) < 2:
        return Test("welch", math.nan, math.nan, f"n = {len(a)}, {len(b)}: untestable "
                    "(Welch's t needs two runs per configuration)")
    diff = float(a.mean() - b.mean())
    va, vb = float(a.var(ddof=1)), float(b.var(ddof=1))
    ea, eb = va / len(a), vb / len(b)
    shift = diff - margin
    if ea + eb == 0:
        t = math.copysign(math.inf, shift) if shift else 0.0
        df = float(len(a) + len(b) - 2)
    else:
        t = shift / math.sqrt(ea + eb)
        df = (ea + eb) ** 2 / (ea ** 2 / (len(a) - 1) + eb ** 2 / (len(b) - 1))
    signed = t if alternative == "greater" else -t
    p = 1.0 if signed == 0 and ea + eb == 0 else float(stdtr(df, -signed))
    spread = math.sqrt((va + vb) / 2)
    d = f", d = {diff / spread:.2g}" if spread > 0 else ""
    return Test("welch", p, 0.0, f"t = {t:.2f}, df = {df:.1f}, {_p(p)}",
                f"difference {diff:+.3f}{d}")


def fisher(broken_a: int, n_a: int, broken_b: int, n_b: int) -> Test:
    """Fisher's exact test, one-sided: a breaks in a larger share of its runs than b. `min_p`:
    the p of the most extreme table with the same margins (every break in a, as far as a's
    runs allow); 1 when nothing broke."""
    p = float(st.fisher_exact([[broken_a, n_a - broken_a], [broken_b, n_b - broken_b]],
                              alternative="greater").pvalue)
    total = broken_a + broken_b
    most = min(total, n_a)
    min_p = float(st.hypergeom.sf(most - 1, n_a + n_b, total, n_a)) if total else 1.0
    diff = broken_a / n_a - broken_b / n_b
    return Test("fisher", p, min_p, f"{broken_a}/{n_a} vs {broken_b}/{n_b} broken, Fisher "
                f"one-sided {_p(p)}", f"difference of rates {diff:+.2f}")


def binomial(broken: int, n: int, rate: float, alternative: Alternative) -> Test:
    """Exact binomial test of one configuration's break rate against `rate`: "less" shows it
    below (fewer runs break), "greater" above. `min_p`: that of the most extreme count."""
    p = float(st.binomtest(broken, n, rate, alternative=alternative).pvalue)
    extreme = 0 if alternative == "less" else n
    min_p = float(st.binomtest(extreme, n, rate, alternative=alternative).pvalue)
    return Test("binomial", p, min_p, f"{broken}/{n} broken, binomial one-sided ({alternative} "
                f"than {rate:g}) {_p(p)}", f"rate {broken / n:.2f}")


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (a claim is decided where its adjusted p <= alpha);
    family-wise error <= alpha for any dependence between the tests. NaN (no test) counts as
    1, so that an untested claim still counts in the family."""
    p = [1.0 if not math.isfinite(v) else min(1.0, v) for v in pvalues]
    m = len(p)
    adjusted = [1.0] * m
    running = 0.0
    for rank, i in enumerate(sorted(range(m), key=lambda i: p[i])):
        running = max(running, min(1.0, (m - rank) * p[i]))
        adjusted[i] = running
    return adjusted


def rate_bound(broken: int, n: int, confidence: float = 0.95) -> float:
    """The one-sided Clopper-Pearson upper confidence bound of a break rate (0/3 -> 0.63)."""
    return float(st.binomtest(broken, n).proportion_ci(2 * confidence - 1, "exact").high) \
        if broken < n else 1.0
