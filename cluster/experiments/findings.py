"""Findings: the paper's claims and klrl's own, each tested on a directory's runs by a test of
known error rate (stats.py), with Holm's correction across the claims of a sweep.

`klrl report` measures every finished run (measures.py) and writes the verdicts into
report.md. A claim compares *configurations* (KL estimator, placement, `kl.importance`, beta,
async lag), each a set of runs that differ in their seed; a configuration's measures are the
final greedy accuracy in-domain and out-of-domain, and how many of its runs broke (one failure
definition for every claim: prereg.FailureRule).

Each claim gives two p-values (`Outcome`): one for the evidence it predicts (`reproduce`), one
for the opposite beyond an equivalence bound (`contradict`: an accuracy lead shown to be smaller
than `Rules.accuracy_margin`, or a break rate shown on the wrong side of `Rules.break_rate`).
A claim made of several comparisons is reproduced only when each is (intersection-union: its
p-value is the largest), and contradicted when any one is (Bonferroni within the claim). Holm's
correction then runs across the claims, separately for the two, at `Rules.alpha`:

- *reproduced*: the Holm-adjusted reproduction p-value is at most alpha;
- *contradicted*: otherwise, the Holm-adjusted contradiction p-value is at most alpha;
- *inconclusive*: neither;
- *not testable here*: no outcome of this design could decide it (a break comparison whose
  break counts leave no table extreme enough, e.g. a control that never broke: Tarone's rule);
- *not run here*: its configurations are not in the directory.

The rules of each claim are in its function's docstring and in docs/sweeps.md.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from cluster.experiments import stats
from cluster.experiments.measures import PRIMARY, Measures
from cluster.experiments.prereg import Preregistration, Rules

IN, OUT = "in_domain", "out_of_domain"
ArmKey = tuple  # (estimator, placement, importance, beta, max_lag); no KL: (None, None, ...)
# The config keys an ArmKey is made of: runs that differ in any other key (bar the seed) share
# an arm, and the claims pool them (the report says so: report_findings.pooled_keys).
ARM_KEYS = ("kl.estimator", "kl.placement", "kl.importance", "kl.beta", "max_lag")


@dataclass(frozen=True)
class Arm:
    """One configuration's finished runs: their final accuracies and how many broke."""

    name: str
    accuracy: dict[str, tuple[float, ...]]
    broken: int
    n: int
    kl_end: tuple[float, ...] = ()  # KL to the reference at the end, per run

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
        return f"{self.name}: {self.broken}/{self.n} broken{at_end}"


def arm_name(key: ArmKey) -> str:
    estimator, placement, importance, _, _ = key
    if estimator is None:
        return "no KL"
    return f"{estimator.upper()} in {placement}" + (
        f" + importance {importance}" if importance != "none" else "")


class Study:
    """The configurations of a directory (or simulated ones), by ArmKey."""

    def __init__(self, arms: dict[ArmKey, Arm]):
        self.arms = arms

    @classmethod
    def of(cls, measures: Sequence[Measures], variant: str = PRIMARY) -> Study:
        """The finished runs' arms, a run broken as the failure definition (or `variant`)
        says."""
        runs: dict[ArmKey, list[Measures]] = {}
        for m in measures:
            if m.finished:
                runs.setdefault(_key(m.config), []).append(m)
        return cls({key: Arm(arm_name(key), {s: tuple(v for m in ms if math.isfinite(
            v := m.accuracy.get(s, math.nan))) for s in (IN, OUT)},
            sum(bool(m.broken[variant]) for m in ms), len(ms), tuple(m.kl_end for m in ms))
            for key, ms in runs.items()})

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


def _key(config: dict) -> ArmKey:
    beta, lag = float(config.get("kl.beta", 0) or 0), config.get("max_lag", 0)
    if beta == 0:
        return (None, None, "none", 0.0, lag)
    return (config.get("kl.estimator"), config.get("kl.placement"),
            config.get("kl.importance", "none"), beta, lag)


@dataclass(frozen=True)
class Outcome:
    """One claim at one setting, before Holm's correction."""

    claim: str
    source: str              # "paper" or "klrl"
    setting: str
    reproduce: float         # p-value of the claim's evidence (NaN: cannot be tested)
    contradict: float        # p-value of the opposite beyond the equivalence bound
    evidence: str
    status: str = "tested"   # or "not testable here", "not run here"
    verdict: str = ""        # set by `decide`
    fragile: bool = False    # the verdict differs under a threshold variant (`robust`)
    adjusted: tuple[float, float] = (math.nan, math.nan)  # Holm-adjusted (reproduce, contradict)


def _not_run(claim: str, source: str, setting: str, needs: str) -> Outcome:
    return Outcome(claim, source, setting, math.nan, math.nan, needs, "not run here")


def _outcome(claim, source, setting, rep: Sequence[stats.Test], con: Sequence[stats.Test],
             alpha: float, evidence: list[str]) -> Outcome:
    """Intersection-union over `rep` (every test must pass: the largest p), Bonferroni over
    `con` (any one suffices). A side none of whose tests can reach alpha is not testable."""
    rep_ok = bool(rep) and all(t.testable and stats.reaches(t.min_p, alpha) for t in rep)
    con = [t for t in con if t.testable and stats.reaches(t.min_p, alpha / max(1, len(con)))]
    p_rep = max(t.p for t in rep) if rep_ok else math.nan
    p_con = min(1.0, len(con) * min(t.p for t in con)) if con else math.nan
    status = "tested" if rep_ok or con else "not testable here"
    return Outcome(claim, source, setting, p_rep, p_con, "; ".join(evidence), status)


def _welch_lines(a: Arm, b: Arm, key: str, label: str, margin: float) -> tuple:
    """(a ahead of b, a's lead below the margin, the evidence line with both tests)."""
    ahead, short = stats.welch(a.accuracy[key], b.accuracy[key], "greater"), \
        stats.welch(a.accuracy[key], b.accuracy[key], "less", margin)
    return ahead, short, (f"{label}: {a.text(key)} vs {b.text(key)}, {ahead.effect}; "
                          f"ahead: {ahead.text}; lead below {margin:g}: {short.text}")


def k1_reward_best(study: Study, beta: float, lag: int, rules: Rules) -> Outcome:
    """Paper: K1 in the reward gives the best in- and out-of-domain accuracy. Reproduced: it
    is ahead of each of the three other KL configurations on both sets (six one-sided Welch
    tests, intersection-union). Contradicted: its lead over one of them on one set is shown
    to be below the margin (non-superiority Welch, Bonferroni over the six)."""
    claim = "K1 in the reward is best in- and out-of-domain"
    setting = f"beta {beta:g}, max_lag {lag}"
    best = study.arm("k1", "reward", beta, lag)
    others = [a for e, p in (("k1", "loss"), ("k3", "reward"), ("k3", "loss"))
              if (a := study.arm(e, p, beta, lag))]
    if best is None or len(others) < 3:
        return _not_run(claim, "paper", setting, "needs the four KL configurations")
    rep, con, lines = [], [], []
    for key, label in ((IN, "in-domain"), (OUT, "out-of-domain")):
        for other in others:
            ahead, short, line = _welch_lines(best, other, key, label, rules.accuracy_margin)
            rep.append(ahead)
            con.append(short)
            lines.append(line)
    return _outcome(claim, "paper", setting, rep, con, rules.alpha, lines)


def _breaks_more(claim: str, source: str, setting: str, a: Arm, b: Arm, rules: Rules) -> Outcome:
    """a breaks in more of its runs than b (Fisher); contradicted when a's break rate is
    shown below rules.break_rate (exact binomial)."""
    more = stats.fisher(a.broken, a.n, b.broken, b.n)
    stable = stats.binomial(a.broken, a.n, rules.break_rate, "less")
    return _outcome(claim, source, setting, [more], [stable], rules.alpha,
                    [f"{a.flags()}, {b.flags()}: {more.text}, {more.effect}",
                     f"{a.name}: {stable.text}"])


def k1_loss_unstable(study: Study, beta: float, lag: int, rules: Rules) -> Outcome:
    """Paper: K1 in the loss is unstable off-policy. Reproduced: it breaks in more of its runs
    than K1 in the reward (Fisher, one-sided). Contradicted: its break rate is shown below
    rules.break_rate (exact binomial)."""
    claim, setting = "K1 in the loss is unstable off-policy", f"beta {beta:g}, max_lag {lag}"
    k1l, k1r = study.arm("k1", "loss", beta, lag), study.arm("k1", "reward", beta, lag)
    if k1l is None or k1r is None or lag == 0:
        return _not_run(claim, "paper", setting, "needs K1 in loss and in reward at a lag")
    return _breaks_more(claim, "paper", setting, k1l, k1r, rules)


def k3_reward_breaks(study: Study, beta: float, lag: int, rules: Rules) -> Outcome:
    """klrl: K3 in the reward breaks off-policy (its exp(-delta) turns tokens the reference
    finds unlikely into huge costs). Reproduced: it breaks in more runs than K1 in the reward
    (Fisher). Contradicted: its break rate is shown below rules.break_rate (binomial)."""
    claim, setting = "K3 in the reward breaks off-policy", f"beta {beta:g}, max_lag {lag}"
    k3r, k1r = study.arm("k3", "reward", beta, lag), study.arm("k1", "reward", beta, lag)
    if k3r is None or k1r is None or lag == 0:
        return _not_run(claim, "klrl", setting, "needs K3 and K1 in reward at a lag")
    return _breaks_more(claim, "klrl", setting, k3r, k1r, rules)


def k3_loss_stable_worse_ood(study: Study, beta: float, lag: int, rules: Rules) -> Outcome:
    """Paper: K3 in the loss is stable but generalises worse than K1 in the reward.
    Reproduced: its break rate is shown below rules.break_rate (binomial) and K1 in the
    reward is ahead of it out-of-domain (Welch), both. Contradicted: its break rate is shown
    above rules.break_rate, or K1 in the reward's out-of-domain lead is shown below the margin
    (Bonferroni over the two)."""
    claim = "K3 in the loss is stable but worse out-of-domain"
    setting = f"beta {beta:g}, max_lag {lag}"
    k3l, k1r = study.arm("k3", "loss", beta, lag), study.arm("k1", "reward", beta, lag)
    if k3l is None or k1r is None:
        return _not_run(claim, "paper", setting, "needs K3 in loss and K1 in reward")
    stable = stats.binomial(k3l.broken, k3l.n, rules.break_rate, "less")
    unstable = stats.binomial(k3l.broken, k3l.n, rules.break_rate, "greater")
    ahead, short, line = _welch_lines(k1r, k3l, OUT, "out-of-domain", rules.accuracy_margin)
    return _outcome(claim, "paper", setting, [stable, ahead], [unstable, short], rules.alpha,
                    [f"{k3l.name}: {stable.text}", line])


def kl_stabilises_async(study: Study, beta: float, lag: int, rules: Rules) -> Outcome:
    """Paper: KL regularisation stabilises asynchronous training. Reproduced: the no-KL
    control (beta 0, same lag) breaks in more runs than K1 in the reward (Fisher).
    Contradicted (only where there was something to stabilise, i.e. the Fisher test is
    testable): K1 in the reward's own break rate is shown above rules.break_rate. Not testable
    here when the control's breaks cannot make the Fisher test reach alpha (it never breaks)."""
    claim, setting = ("KL regularisation stabilises async training",
                      f"beta {beta:g} against beta 0, max_lag {lag}")
    nokl, k1r = study.arm(None, None, 0.0, lag), study.arm("k1", "reward", beta, lag)
    if nokl is None or k1r is None or lag == 0:
        return _not_run(claim, "paper", setting,
                        "needs the no-KL control (kl.beta 0) and K1 in reward at a lag")
    more = stats.fisher(nokl.broken, nokl.n, k1r.broken, k1r.n)
    breaks = stats.binomial(k1r.broken, k1r.n, rules.break_rate, "greater")
    evidence = [(f"{nokl.flags()}, {k1r.flags()}: {more.text}, {more.effect} (smallest reachable p "
                f"{more.min_p:.2g}; 95% upper bound on no KL's break rate "
                f"{stats.rate_bound(nokl.broken, nokl.n):.2f})"), f"{k1r.name}: {breaks.text}"]
    return _outcome(claim, "paper", setting, [more],
                    [breaks] if stats.reaches(more.min_p, rules.alpha) else [], rules.alpha,
                    evidence)


def prefix_repairs(study: Study, beta: float, lag: int, rules: Rules,
                   repaired: Sequence[str] = ("k1-loss", "k3-reward")) -> Outcome:
    """klrl: per-decision importance weights (kl.importance prefix) repair the configurations
    that break off-policy (`repaired`, named before the runs). For each whose Fisher test can
    decide (it broke): reproduced when it breaks in more runs without the weights than with
    them, for each (intersection-union); contradicted when one's corrected runs are shown to
    break above rules.break_rate (Bonferroni)."""
    claim, setting = ("Per-decision importance weights repair what breaks off-policy",
                      f"beta {beta:g}, max_lag {lag}")
    pairs = [(plain, fixed) for name in repaired
             if (plain := study.arm(*name.split("-"), beta, lag))
             and (fixed := study.arm(*name.split("-"), beta, lag, "prefix"))]
    if not pairs or lag == 0:
        return _not_run(claim, "klrl", setting,
                        "needs configurations with and without kl.importance prefix at a lag")
    rep, con, lines = [], [], []
    for plain, fixed in pairs:
        more = stats.fisher(plain.broken, plain.n, fixed.broken, fixed.n)
        lines.append(f"{plain.flags()} -> {fixed.flags()}: {more.text}, {more.effect}")
        if stats.reaches(more.min_p, rules.alpha):
            rep.append(more)
            con.append(stats.binomial(fixed.broken, fixed.n, rules.break_rate, "greater"))
            lines.append(f"{fixed.name}: {con[-1].text}")
    return _outcome(claim, "klrl", setting, rep, con, rules.alpha, lines)


CLAIMS: dict[str, Callable[..., Outcome]] = {f.__name__: f for f in (
    k1_reward_best, k1_loss_unstable, k3_loss_stable_worse_ood, kl_stabilises_async,
    k3_reward_breaks, prefix_repairs)}


def decide(outcomes: Sequence[Outcome], alpha: float) -> list[Outcome]:
    """Verdicts after Holm's correction across `outcomes` (the family; claims not run or not
    testable count in it with p = 1)."""
    rep = stats.holm([o.reproduce for o in outcomes])
    con = stats.holm([o.contradict for o in outcomes])
    out = []
    for o, r, c in zip(outcomes, rep, con):
        verdict = o.status if o.status != "tested" else "reproduced" if stats.reaches(r, alpha) \
            else "contradicted" if stats.reaches(c, alpha) else "inconclusive"
        out.append(replace(o, verdict=verdict, adjusted=(r, c)))
    return out


def plan(study: Study, prereg: Preregistration | None, sweep: str) -> list[tuple]:
    """(claim function, beta, lag, extra arguments) to test: the pre-registration's claims for
    `sweep`, else (exploratory) every claim at each beta's largest lag, K1-in-reward-best also
    on-policy."""
    if prereg is not None:
        sweep_plan = prereg.sweeps[sweep]
        return [(CLAIMS[c.claim], prereg.beta, c.max_lag,
                 {"repaired": sweep_plan.repaired} if c.claim == "prefix_repairs" else {})
                for c in sweep_plan.claims]
    out = []
    for beta, lag in study.settings():
        if lag > 0 and study.arm("k1", "reward", beta, 0):
            out.append((k1_reward_best, beta, 0, {}))
        out += [(claim, beta, lag, {}) for claim in CLAIMS.values()]
    return out


def findings(measures: Sequence[Measures], rules: Rules, todo: Sequence[tuple],
             variant: str = PRIMARY, family_of_all: bool = False) -> list[Outcome]:
    """Every planned claim, decided. `family_of_all`: claims not run here stay in the Holm
    family (a pre-registration's); otherwise they are listed after it, outside."""
    study = Study.of(measures, variant)
    outcomes = [claim(study, beta, lag, rules, **extra) for claim, beta, lag, extra in todo]
    if family_of_all:
        return decide(outcomes, rules.alpha)
    run = [o for o in outcomes if o.status != "not run here"]
    return decide(run, rules.alpha) + [replace(o, verdict=o.status) for o in outcomes
                                       if o.status == "not run here"]


def robust(measures: Sequence[Measures], rules: Rules, todo: Sequence[tuple],
           family_of_all: bool = False) -> tuple[list[Outcome], list[str]]:
    """The findings under the failure definition, each marked fragile where a threshold
    variant (rules.sensitivity) changes its verdict, and the sensitivity table (markdown)."""
    primary = findings(measures, rules, todo, PRIMARY, family_of_all)
    variants = {v.name: findings(measures, rules, todo, v.name, family_of_all)
                for v in rules.sensitivity}
    marked = [replace(f, fragile=any(v[i].verdict != f.verdict for v in variants.values()))
              for i, f in enumerate(primary)]
    lines = ["| claim | setting | " + " | ".join([PRIMARY, *variants]) + " | fragile |",
             "|---|---|" + "---|" * (len(variants) + 2)]
    lines += [f"| {f.claim} | {f.setting} | " + " | ".join(
        [f.verdict, *(v[i].verdict for v in variants.values())])
        + f" | {'**yes**' if f.fragile else 'no'} |" for i, f in enumerate(marked)
        if f.verdict != "not run here"]
    return marked, lines if len(lines) > 2 else []


def findings_markdown(found: Sequence[Outcome]) -> list[str]:
    if not found:
        return ["No finished run with a KL penalty: no claim to test."]
    lines = [("| claim | from | setting | verdict | Holm-adjusted p (reproduce / contradict) | "
             "evidence (mean ± standard error over seeds; each test's statistics) |"),
             "|---|---|---|---|---|---|"]
    for f in found:
        adj = " / ".join("-" if not math.isfinite(p) else f"{p:.2g}" for p in f.adjusted)
        verdict = f"**{f.verdict}**" + (" (fragile)" if f.fragile else "")
        lines.append(f"| {f.claim} | {f.source} | {f.setting} | {verdict} | {adj} | "
                     f"{f.evidence} |")
    return lines
