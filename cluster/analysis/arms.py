"""What the claims compare: a directory's runs grouped into configurations (`Arm`s of a
`Study`), the comparison of two arms (paired by seed where they share seeds), and a claim's
`Outcome` before Holm's correction (findings.py decides it).

Pairing: every configuration of a sweep runs the same seeds, and the seed is a block (it sets
the data order, the sampling and, through both, much of where a run ends: on the confirmation
of seeds 101-108 it explained 76% of the out-of-domain variance). An accuracy comparison is
therefore a paired t-test on the per-seed differences over the seeds both arms finished, and
Welch's test only where fewer than two seeds pair. The KL to the reference at the end, a
distance that moves with accuracy, is compared beside every accuracy the same way (log KL,
paired, two-sided, descriptive: no claim's verdict rests on it).
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from cluster.analysis import stats
from cluster.analysis.measures import PRIMARY, Measures

IN, OUT = "in_domain", "out_of_domain"
ArmKey = tuple  # (estimator, placement, importance, beta, max_lag); no KL: (None, None, ...)
# The config keys an ArmKey is made of: runs that differ in any other key (bar the seed) share
# an arm, and the claims pool them (the report says so: report_findings.pooled_keys).
ARM_KEYS = ("kl.estimator", "kl.placement", "kl.importance", "kl.beta", "max_lag")


@dataclass(frozen=True)
class Arm:
    """One configuration's finished runs: their final accuracies and KL by seed, how many
    broke (and when), how many drifted."""

    name: str
    accuracy: dict[str, tuple[float, ...]]
    broken: int
    n: int
    kl_end: tuple[float, ...] = ()  # KL to the reference at the end, per run
    seeds: dict[str, tuple] = field(default_factory=dict)  # set -> seeds of `accuracy`'s values
    kl_seeds: tuple = ()            # the seeds of kl_end's values
    drifted: int = 0                # runs whose KL blew up (a flag, not a break)
    break_steps: tuple[int, ...] = ()  # the step each broken run broke at
    # per run: (step it broke at, or its last step when it did not; whether it broke), the
    # time-to-break censored at the run's end (empty where the length is unknown)
    times: tuple[tuple[int, bool], ...] = ()
    curves: dict = field(default_factory=dict)  # seed -> Measures.curve of that seed's run

    def text(self, key: str) -> str:
        values = self.accuracy.get(key, ())
        if not values:
            return f"{self.name} -"
        se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.nan
        return f"{self.name} {statistics.fmean(values):.3f}" + (
            f" ± {se:.3f}" if math.isfinite(se) else "") + f" (n={len(values)})"

    def flags(self) -> str:
        kl = [v for v in self.kl_end if math.isfinite(v)]
        at_end = f", KL at the end {statistics.median(kl):.3g} (median)" if kl else ""
        drift = f", {self.drifted}/{self.n} drifted (KL blow-up, not a break)" \
            if self.drifted else ""
        # none broke: how high a break rate these runs leave possible (what they could see)
        bound = f" (95% upper bound {stats.rate_bound(0, self.n):.2f})" if not self.broken \
            else ""
        return f"{self.name}: {self.broken}/{self.n} broken{bound}{drift}{at_end}"

    def by_seed(self, key: str) -> dict:
        """seed -> value of a set's accuracy ("kl": log KL at the end); seedless runs left out."""
        if key == "kl":
            return {s: math.log(v) for s, v in zip(self.kl_seeds, self.kl_end)
                    if s is not None and math.isfinite(v) and v > 0}
        return {s: v for s, v in zip(self.seeds.get(key, ()), self.accuracy.get(key, ()))
                if s is not None}


def arm_name(key: ArmKey) -> str:
    estimator, placement, importance, _, _ = key
    if estimator is None:
        return "no KL"
    return f"{estimator.upper()} in {placement}" + (
        f" + importance {importance}" if importance != "none" else "")


def arm_key(config: dict) -> ArmKey:
    beta, lag = float(config.get("kl.beta", 0) or 0), config.get("max_lag", 0)
    if beta == 0:
        return (None, None, "none", 0.0, lag)
    return (config.get("kl.estimator"), config.get("kl.placement"),
            config.get("kl.importance", "none"), beta, lag)


class Study:
    """The configurations of a directory (or simulated ones), by ArmKey, and the base model's
    accuracy on the same problems (set -> accuracy; empty when base_eval.json is missing),
    against which a gate tells whether anything was forgotten (gates.py)."""

    def __init__(self, arms: dict[ArmKey, Arm], base: dict[str, float] | None = None):
        self.arms = arms
        self.base = dict(base or {})

    @classmethod
    def of(cls, measures: Sequence[Measures], variant: str = PRIMARY,
           base: dict[str, float] | None = None) -> Study:
        """The finished runs' arms, a run broken as the failure definition (or `variant`)
        says."""
        runs: dict[ArmKey, list[Measures]] = {}
        for m in measures:
            if m.finished:
                runs.setdefault(arm_key(m.config), []).append(m)

        def finite(ms, s):
            return [m for m in ms if math.isfinite(m.accuracy.get(s, math.nan))]

        sets = sorted({IN, OUT} | {s for m in measures for s in m.accuracy})
        return cls({key: Arm(
            arm_name(key), {s: tuple(m.accuracy[s] for m in finite(ms, s)) for s in sets},
            sum(bool(m.broken[variant]) for m in ms), len(ms), tuple(m.kl_end for m in ms),
            {s: tuple(m.seed for m in finite(ms, s)) for s in sets},
            tuple(m.seed for m in ms), sum(bool(m.drifted) for m in ms),
            tuple(m.break_step for m in ms if m.broken[variant] and m.break_step is not None),
            _times(ms), {m.seed: m.curve for m in ms if m.curve})
            for key, ms in runs.items()}, base)

    def arm(self, estimator: str | None, placement: str | None, beta: float, lag: int,
            importance: str = "none") -> Arm | None:
        if beta == 0:
            return self.arms.get((None, None, "none", 0.0, lag))
        return self.arms.get((estimator, placement, importance, float(beta), lag))

    def settings(self) -> list[tuple[float, int]]:
        """(beta, lag) pairs of an exploratory report: each positive beta at its largest lag."""
        lags: dict[float, int] = {}
        for _, _, _, beta, lag in self.arms:
            if beta > 0:
                lags[beta] = max(lag, lags.get(beta, lag))
        return sorted(lags.items())


def _times(ms: Sequence[Measures]) -> tuple[tuple[int, bool], ...]:
    """Each run's time-to-break under the failure definition itself (Measures.break_step is
    its step; a threshold variant's breaks have no step of their own), censored at its last
    step; () when a run's length is unknown (read from runs.csv) or a broken run's step is."""
    out = []
    for m in ms:
        broke = bool(m.broken[PRIMARY])
        at = m.break_step if broke else m.last_step
        if at is None:
            return ()
        out.append((at, broke))
    return tuple(out)


def compare(a: Arm, b: Arm, key: str, alternative: stats.Sided, margin: float = 0.0
            ) -> stats.Test:
    """mean(a) - mean(b) against `margin` on a set's accuracy (key "kl": log KL at the end):
    the paired t-test over the seeds both finished when at least two pair, else Welch's."""
    x, y = a.by_seed(key), b.by_seed(key)
    common = sorted(set(x) & set(y))
    if len(common) >= 2:
        return stats.paired([x[s] for s in common], [y[s] for s in common], alternative, margin)
    if key == "kl":
        return stats.welch(list(x.values()), list(y.values()), alternative, margin) \
            if alternative != "two-sided" else stats.paired([], [], alternative)
    return stats.welch(a.accuracy.get(key, ()), b.accuracy.get(key, ()), alternative, margin)


def kl_text(a: Arm, b: Arm) -> str:
    """KL to the reference at the end of both arms (geometric means) and their paired log
    ratio: the distance that goes with every accuracy comparison."""
    def geo(arm):
        v = list(arm.by_seed("kl").values()) or [math.log(k) for k in arm.kl_end
                                                  if math.isfinite(k) and k > 0]
        return f"{math.exp(statistics.fmean(v)):.3g}" if v else "-"

    test = compare(a, b, "kl", "two-sided")
    detail = f", log ratio {test.effect.replace('mean paired difference ', '')}: {test.text}" \
        if test.testable else ""
    return f"KL at the end {geo(a)} vs {geo(b)} (geometric means){detail}"


@dataclass(frozen=True)
class Outcome:
    """One claim at one setting, before Holm's correction."""

    claim: str
    source: str              # "paper", "paper, on-policy", "klrl (off-policy extension)"...
    setting: str
    reproduce: float         # p-value of the claim's evidence (NaN: cannot be tested)
    contradict: float        # p-value of the opposite beyond the equivalence bound
    evidence: str
    status: str = "tested"   # or "not testable here", "not run here"
    verdict: str = ""        # set by `decide`
    fragile: bool = False    # the verdict differs under a threshold variant (`robust`)
    adjusted: tuple[float, float] = (math.nan, math.nan)  # Holm-adjusted (reproduce, contradict)
    toy: tuple[tuple[str, int], ...] = ()  # (arm name, lag) of the configurations it is about
    # Under gates: the smallest p the claim's own comparison could reach with these margins; a
    # contradiction counts only where that reaches Holm's first level (findings.decide).
    reach: float = 0.0


def not_run(claim: str, source: str, setting: str, needs: str) -> Outcome:
    return Outcome(claim, source, setting, math.nan, math.nan, needs, "not run here")


def outcome(claim, source, setting, rep: Sequence[stats.Test], con: Sequence[stats.Test],
            alpha: float, evidence: list[str], reach: float = 0.0) -> Outcome:
    """Intersection-union over `rep` (every test must pass: the largest p), Bonferroni over
    `con` (any one suffices). A side none of whose tests can reach alpha is not testable."""
    rep_ok = bool(rep) and all(t.testable and stats.reaches(t.min_p, alpha) for t in rep)
    con = [t for t in con if t.testable and stats.reaches(t.min_p, alpha / max(1, len(con)))]
    p_rep = max(t.p for t in rep) if rep_ok else math.nan
    p_con = min(1.0, len(con) * min(t.p for t in con)) if con else math.nan
    status = "tested" if rep_ok or con else "not testable here"
    return Outcome(claim, source, setting, p_rep, p_con, "; ".join(evidence), status,
                   reach=reach)


def accuracy_lines(a: Arm, b: Arm, key: str, label: str, margin: float) -> tuple:
    """(a ahead of b, a's lead below the margin, the evidence line with both tests and the
    two arms' KL at the end)."""
    ahead, short = compare(a, b, key, "greater"), compare(a, b, key, "less", margin)
    return ahead, short, (f"{label}: {a.text(key)} vs {b.text(key)}, {ahead.effect}; "
                          f"ahead: {ahead.text}; lead below {margin:g}: {short.text}; "
                          f"{kl_text(a, b)}")
