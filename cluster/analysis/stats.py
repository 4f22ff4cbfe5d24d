"""The tests behind the findings (findings.py), each with the numbers a reader needs to recheck
it: the paired t-test by seed (a claim's configurations share their seeds, and the seed is a
block: on the confirmation it explained 76% of the out-of-domain variance), Welch's t-test
(its own Welch-Satterthwaite degrees of freedom) where runs cannot be paired, the
Cochran-Armitage test of a trend in break rates over ordered doses, Fisher's exact test for
counts of broken runs, the exact binomial test for one configuration's break rate, and Holm's
correction across claims. The p-values are scipy.stats'; this module adds only what scipy
leaves to the caller: Welch's p-value without ttest_ind's overhead, a margin for
non-superiority tests, the smallest p-value a discrete test
can reach with the margins it is given (a claim that cannot reach its level is "not testable
here", Tarone's rule), the lead a paired comparison detects at a given power, and the report's
wording.

Error rates of the rules built on these tests are simulated in tests/test_stats.py against the
figures stated in the pre-registration (docs/sweeps/preregistration.yaml, `design:`).
"""
from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from scipy import optimize
from scipy import stats as st
from scipy.special import stdtr

Alternative = Literal["greater", "less"]
Sided = Literal["greater", "less", "two-sided"]


@dataclass(frozen=True)
class Test:
    """One test's result. `p` is NaN when the data cannot be tested (fewer than two values in
    a group for Welch's t); `min_p` is the smallest p-value the test could have given with
    these group sizes and (Fisher) these margins, whatever the outcome."""

    kind: Literal["welch", "paired", "fisher", "binomial", "trend", "difference", "logrank"]
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


def paired(a: Sequence[float], b: Sequence[float], alternative: Sided = "greater",
           margin: float = 0.0) -> Test:
    """The paired t-test of mean(a - b) against `margin`, a[i] and b[i] of the same seed:
    "greater" shows the difference above it, "less" below it (non-superiority when margin > 0),
    "two-sided" a difference from it either way. As scipy.stats.ttest_rel (tests/test_stats.py
    checks they agree), with stdtr for speed. Differences without spread beyond the margin give
    t = +/-inf, p = 0. Effect: the mean difference and its sd over seeds."""
    d = np.asarray(a, float) - np.asarray(b, float)
    if len(d) < 2:
        return Test("paired", math.nan, math.nan, f"{len(d)} pair(s): untestable (the paired "
                    "t-test needs two seeds that both configurations ran)")
    mean, sd = float(d.mean()), float(d.std(ddof=1))
    if sd <= 1e-12 * abs(mean):  # equal differences up to rounding: no spread, not t = 1e16
        sd = 0.0
    shift, df = mean - margin, len(d) - 1
    t = math.copysign(math.inf, shift) if sd == 0 and shift else \
        0.0 if sd == 0 else shift / (sd / math.sqrt(len(d)))
    if alternative == "two-sided":
        p = 1.0 if t == 0 and sd == 0 else float(2 * stdtr(df, -abs(t)))
    else:
        signed = t if alternative == "greater" else -t
        p = 1.0 if signed == 0 and sd == 0 else float(stdtr(df, -signed))
    return Test("paired", min(1.0, p), 0.0, f"paired t = {t:.2f}, df = {df}, {_p(p)}",
                f"mean paired difference {mean:+.3f} (sd {sd:.3f} over {len(d)} seeds)")


def trend(broken: Sequence[int], n: Sequence[int], doses: Sequence[float]) -> Test:
    """The Cochran-Armitage test of a break rate rising with the dose (one-sided, normal
    approximation, scores = the doses' ranks, so that a lag or beta grid's spacing does not
    weigh): Z = sum_i s_i (x_i - n_i p) / sqrt(p (1 - p) (sum n_i s_i^2 - (sum n_i s_i)^2 / N)).
    `min_p`: the p of the most extreme table with these margins (every break at the highest
    doses); 1 when nothing or everything broke."""
    x, m = np.asarray(broken, float), np.asarray(n, float)
    s = np.asarray(st.rankdata(doses), float)

    def p_of(counts):
        total, size = counts.sum(), m.sum()
        share = total / size
        var = share * (1 - share) * ((m * s ** 2).sum() - (m * s).sum() ** 2 / size)
        if var <= 0:
            return 1.0, 0.0
        z = float((s * (counts - m * share)).sum() / math.sqrt(var))
        return float(st.norm.sf(z)), z

    p, z = p_of(x)
    extreme, left = np.zeros_like(x), x.sum()
    for i in np.argsort(-s, kind="stable"):
        extreme[i] = min(m[i], left)
        left -= extreme[i]
    rates = ", ".join(f"{int(b)}/{int(k)}" for b, k in zip(x, m))
    return Test("trend", p, p_of(extreme)[0], f"{rates} broken at doses "
                f"{', '.join(f'{d:g}' for d in doses)}: Cochran-Armitage Z = {z:.2f}, "
                f"one-sided {_p(p)}", f"rates {', '.join(f'{b / k:.2f}' for b, k in zip(x, m))}")


# The break-count tests below are pure functions of a few small integers, and a report (or
# a simulation of the rules' error rates) asks for the same ones again and again; scipy's
# exact tests and above all its Clopper-Pearson bound (a root search) cost a millisecond or
# more each. Their results are frozen records: cached, the same object answers every time.
@functools.lru_cache(maxsize=4096)
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


@functools.lru_cache(maxsize=4096)
def binomial(broken: int, n: int, rate: float, alternative: Alternative) -> Test:
    """Exact binomial test of one configuration's break rate against `rate`: "less" shows it
    below (fewer runs break), "greater" above. `min_p`: that of the most extreme count."""
    p = float(st.binomtest(broken, n, rate, alternative=alternative).pvalue)
    extreme = 0 if alternative == "less" else n
    min_p = float(st.binomtest(extreme, n, rate, alternative=alternative).pvalue)
    return Test("binomial", p, min_p, f"{broken}/{n} broken, binomial one-sided ({alternative} "
                f"than {rate:g}) {_p(p)}", f"rate {broken / n:.2f}")


def _wilson(x: int, n: int, z: float) -> tuple[float, float]:
    """Wilson's score interval of a rate x/n at normal quantile z."""
    p, z2 = x / n, z * z
    centre, half = (p + z2 / (2 * n)) / (1 + z2 / n), \
        z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def difference_upper(x_a: int, n_a: int, x_b: int, n_b: int, z: float) -> float:
    """Newcombe's hybrid score upper bound of rate(a) - rate(b) at normal quantile z (his
    method 10: each rate's Wilson interval, combined as a square root of squares), one-sided
    confidence Phi(z). Near its nominal coverage at small n where the Wald interval is not."""
    pa, pb = x_a / n_a, x_b / n_b
    ua, lb = _wilson(x_a, n_a, z)[1], _wilson(x_b, n_b, z)[0]
    return pa - pb + math.sqrt((ua - pa) ** 2 + (pb - lb) ** 2)


def _newcombe_p(x_a: int, n_a: int, x_b: int, n_b: int, delta: float) -> float:
    """The one-sided level at which Newcombe's upper bound of rate(a) - rate(b) reaches
    `delta` (bisection on the quantile: the bound falls as the level rises); 1 when the
    observed difference is delta or more. Approximate: the ordering of the exact test below."""
    if x_a / n_a - x_b / n_b >= delta:
        return 1.0
    low, high = 0.0, 40.0
    if difference_upper(x_a, n_a, x_b, n_b, high) < delta:
        return 0.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if difference_upper(x_a, n_a, x_b, n_b, mid) < delta \
            else (low, mid)
    return float(st.norm.sf(low))


@functools.lru_cache(maxsize=64)
def _difference_null(n_a: int, n_b: int, delta: float) -> tuple[np.ndarray, np.ndarray]:
    """(every table's Newcombe p, (n_a + 1) x (n_b + 1); each table's probability at each
    nuisance value on the null's boundary rate(a) = rate(b) + delta, as a matrix of the
    nuisance grid by (x_a, x_b))."""
    order = np.array([[_newcombe_p(x, n_a, y, n_b, delta) for y in range(n_b + 1)]
                      for x in range(n_a + 1)])
    rate_b = np.linspace(0.0, 1.0 - delta, 501)
    pa = st.binom.pmf(np.arange(n_a + 1)[:, None], n_a, rate_b[None, :] + delta)
    pb = st.binom.pmf(np.arange(n_b + 1)[:, None], n_b, rate_b[None, :])
    return order, np.einsum("xg,yg->gxy", pa, pb)


@functools.lru_cache(maxsize=4096)
def rate_difference_below(broken_a: int, n_a: int, broken_b: int, n_b: int, delta: float
                          ) -> Test:
    """The exact unconditional test that rate(a) - rate(b) is below `delta`: tables are
    ordered by Newcombe's approximate p (difference_upper), and the p-value is the largest
    probability, over the nuisance rate on the null's boundary rate(a) - rate(b) = delta, of a
    table at least as extreme as the one seen. Exact where Newcombe's interval alone is not
    (at 16 runs a side it passes 0.01 about twice as often as it should). `min_p`: that of the
    most extreme table (a never breaks, b always). What contradicts "a breaks more than b" by
    a registered delta (gates.py), only where the comparison itself was testable."""
    order, null = _difference_null(n_a, n_b, delta)

    def p_of(xa: int, xb: int) -> float:
        extreme = order <= order[xa, xb] * (1 + 1e-12)
        return float(min(1.0, (null * extreme[None]).sum(axis=(1, 2)).max()))

    p = p_of(broken_a, broken_b) if broken_a / n_a - broken_b / n_b < delta else 1.0
    bound = difference_upper(broken_a, n_a, broken_b, n_b, float(st.norm.isf(0.05)))
    return Test("difference", p, p_of(0, n_b), f"{broken_a}/{n_a} vs {broken_b}/{n_b} broken: "
                f"difference of rates below {delta:g}, exact unconditional one-sided {_p(p)}",
                f"difference {broken_a / n_a - broken_b / n_b:+.2f} (Newcombe's 95% upper "
                f"bound {bound:+.2f})")


def logrank(times_a: Sequence[tuple[int, bool]], times_b: Sequence[tuple[int, bool]]
            ) -> Test:
    """The log-rank test, one-sided: a breaks sooner than b (its survival below b's), each run
    a (step, broke) pair, an unbroken run censored at its last step (scipy.stats.logrank).
    `min_p` is not computed (0): the claims that use it take Tarone's reach from the same
    break counts' Fisher table."""
    if not times_a or not times_b:
        return Test("logrank", math.nan, math.nan, "untestable: a run's length is unknown "
                    "(runs read from runs.csv)")
    broke_a, broke_b = sum(b for _, b in times_a), sum(b for _, b in times_b)
    if broke_a + broke_b == 0:
        return Test("logrank", 1.0, 1.0, "no run broke: log-rank p = 1")

    def data(times):
        return st.CensoredData(uncensored=[t for t, b in times if b],
                               right=[t for t, b in times if not b])

    # scipy's "greater": the first group's hazard is the greater (it fails sooner; its
    # statistic is observed minus expected breaks of the first group)
    res = st.logrank(data(times_a), data(times_b), alternative="greater")
    p = float(res.pvalue)
    return Test("logrank", p, 0.0, f"log-rank Z = {float(res.statistic):.2f}, one-sided {_p(p)}",
                f"{broke_a}/{len(times_a)} and {broke_b}/{len(times_b)} broke")


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


@functools.lru_cache(maxsize=4096)
def rate_bound(broken: int, n: int, confidence: float = 0.95) -> float:
    """The one-sided Clopper-Pearson upper confidence bound of a break rate (0/3 -> 0.63)."""
    return float(st.binomtest(broken, n).proportion_ci(2 * confidence - 1, "exact").high) \
        if broken < n else 1.0


def paired_detectable_lead(residual_sd: float, seeds: int, level: float,
                           power: float = 0.8) -> float:
    """The true lead a one-sided paired t-test over `seeds` seeds shows at `level` with
    probability `power`, when each configuration's final accuracy is its mean + the seed's
    shared effect + an independent residual of sd `residual_sd` (a paired difference then has
    sd sqrt(2) x residual_sd). Exact: the noncentral t distribution of the statistic. A
    smaller true lead is more likely missed than shown: the report's "at what power"."""
    if seeds < 2:
        raise ValueError(f"{seeds} seed(s): a paired t-test needs two")
    return _detectable_lead(math.sqrt(2) * residual_sd / math.sqrt(seeds), seeds - 1, level,
                            power)


def unpaired_detectable_lead(seed_sd: float, seeds: int, level: float,
                             power: float = 0.8) -> float:
    """The same for a test that ignores the seed: a one-sided two-sample t-test over `seeds`
    runs a configuration whose final accuracies scatter with sd `seed_sd` (seed effect and
    residual together; df 2 x seeds - 2, which Welch's df equals when the two sds do). What
    pairing gains is this lead against paired_detectable_lead's at the residual."""
    if seeds < 2:
        raise ValueError(f"{seeds} seed(s): a two-sample t-test needs two a side")
    return _detectable_lead(seed_sd * math.sqrt(2 / seeds), 2 * seeds - 2, level, power)


def _detectable_lead(scale: float, df: int, level: float, power: float) -> float:
    """The lead at which a one-sided t statistic (the difference / `scale`, `df` degrees of
    freedom) passes its critical value at `level` with probability `power`."""
    if scale == 0:
        return 0.0  # differences without spread: any lead is shown (t = inf)
    critical = float(st.t.ppf(1 - level, df))

    def shortfall(lead: float) -> float:
        return float(st.nct.sf(critical, df, lead / scale)) - power

    high = scale * (critical + 10)
    while shortfall(high) < 0:  # few seeds: the statistic's heavy tails need a larger lead
        high *= 2
    return float(optimize.brentq(shortfall, 0.0, high, xtol=1e-9 * scale))


def mean_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """The two-sided Student-t confidence interval of the mean of `values` (paired differences:
    the interval of the paired effect). At least two values."""
    x = np.asarray(values, float)
    half = float(st.t.ppf((1 + confidence) / 2, len(x) - 1)) * float(x.std(ddof=1)) \
        / math.sqrt(len(x))
    return float(x.mean()) - half, float(x.mean()) + half


def welch_interval(a: Sequence[float], b: Sequence[float], confidence: float = 0.95
                   ) -> tuple[float, float]:
    """Welch's two-sided confidence interval of mean(a) - mean(b) (Welch-Satterthwaite df).
    At least two values a side."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    ea, eb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    diff = float(a.mean() - b.mean())
    if ea + eb == 0:
        return diff, diff
    df = (ea + eb) ** 2 / (ea ** 2 / (len(a) - 1) + eb ** 2 / (len(b) - 1))
    half = float(st.t.ppf((1 + confidence) / 2, df)) * math.sqrt(ea + eb)
    return diff - half, diff + half


def seeds_for_power(effect: float, sd: float, level: float, paired: bool = True,
                    power: float = 0.8, most: int = 10_000) -> int | None:
    """The fewest seeds at which a one-sided t-test at `level` shows a true `effect` with
    probability `power` when the spread is `sd`: paired, the sd of a paired difference (df
    n - 1); unpaired, the sd of one configuration's runs (df 2n - 2, n runs a side). None when
    no seed count up to `most` does (a zero effect, or one far inside the noise)."""
    effect = abs(effect)
    if effect == 0:
        return None
    if sd == 0:
        return 2

    def enough(n: int) -> bool:
        scale, df = (sd / math.sqrt(n), n - 1) if paired else (sd * math.sqrt(2 / n), 2 * n - 2)
        return _detectable_lead(scale, df, level, power) <= effect

    low, high = 1, 2  # the detectable lead falls as n grows: double, then bisect
    while not enough(high):
        if high >= most:
            return None
        low, high = high, min(2 * high, most)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if enough(mid) else (mid, high)
    return high
