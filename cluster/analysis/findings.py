"""Findings: the paper's claims and klrl's own, each tested on a directory's runs by a test of
known error rate (stats.py), with Holm's correction across the claims of a sweep.

`klrl report` measures every finished run (measures.py) and writes the verdicts into
report.md. A claim compares *configurations* (KL estimator, placement, `kl.importance`, beta,
async lag), each a set of runs that differ in their seed; a configuration's measures are the
final greedy accuracy on each set, compared paired by seed (arms.py), the KL to the reference
at the end beside every accuracy, and how many of its runs broke (one failure definition for
every claim, instability and not distance: prereg.FailureRule). Each claim is labelled with
whose it is: the paper makes its claims on-policy, so the same claim tested at max_lag > 0 is
klrl's off-policy extension of it, and says so.

Each claim gives two p-values (`Outcome`): one for the evidence it predicts (`reproduce`), one
for the opposite beyond an equivalence bound (`contradict`: an accuracy lead shown to be smaller
than `Rules.accuracy_margin`, or, under `Rules.gates` (gates.py), a difference of break rates
shown below the gates' margin where the comparison was testable; without gates, as the first
two pre-registrations registered it, a break rate shown on the wrong side of
`Rules.break_rate`). Under gates an accuracy comparison on a set nothing moved is not made.
A claim made of several comparisons is reproduced only when each is (intersection-union: its
p-value is the largest), and contradicted when any one is (Bonferroni within the claim). Holm's
correction then runs across the claims, over both directions in one family (2 x claims
p-values), so that the family-wise error of a sweep's verdicts, "reproduced" and
"contradicted" together, is at most `Rules.alpha`:

- *reproduced*: the Holm-adjusted reproduction p-value is at most alpha;
- *contradicted*: otherwise, the Holm-adjusted contradiction p-value is at most alpha;
- *inconclusive*: neither;
- *not testable here*: no outcome of this design could decide it (a break comparison whose
  break counts leave no table extreme enough, e.g. a control that never broke: Tarone's rule,
  at Holm's first level under gates; an accuracy claim on sets nothing moved);
- *not run here*: its configurations are not in the directory.

The rules of each claim are in its function's docstring and in docs/sweeps.md.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import get_args

from cluster.analysis import claims_async, dose, gates, stats
from cluster.analysis.arms import (  # noqa: F401 (re-exported: the claims' vocabulary)
    ARM_KEYS,
    IN,
    OUT,
    Arm,
    ArmKey,
    Outcome,
    Study,
    accuracy_lines,
    arm_name,
    not_run,
    outcome,
)
from cluster.analysis.labels import toy_anchor
from cluster.analysis.measures import PRIMARY, Measures
from cluster.analysis.prereg import ClaimId, Preregistration, Rules

def _label(rules: Rules) -> str:
    """How the claims name the set of rules.retained."""
    return "out-of-domain" if rules.retained == OUT else rules.retained.replace("_", " ")


def _regime(lag: int, on_policy_source: str = "paper") -> str:
    """Whose claim a test at this lag is: the paper makes its claims on-policy; the same claim
    at max_lag > 0 is klrl's off-policy extension of it."""
    return on_policy_source if lag == 0 else "klrl (off-policy extension)"


def k1_reward_best(study: Study, beta: float, lag: int, rules: Rules) -> Outcome:
    """Paper: K1 in the reward gives the best in- and out-of-domain accuracy. Reproduced: it
    is ahead of each of the three other KL configurations in-domain and on rules.retained (six
    one-sided paired t-tests by seed, intersection-union). Contradicted: its lead over one of
    them on one set is shown to be below the margin (non-superiority, Bonferroni over the
    six)."""
    claim = "K1 in the reward is best " + (
        "in- and out-of-domain" if rules.retained == OUT else f"in-domain and on {_label(rules)}")
    setting, source = f"beta {beta:g}, max_lag {lag}", _regime(lag)
    best = study.arm("k1", "reward", beta, lag)
    others = [a for e, p in (("k1", "loss"), ("k3", "reward"), ("k3", "loss"))
              if (a := study.arm(e, p, beta, lag))]
    if best is None or len(others) < 3:
        return not_run(claim, source, setting, "needs the four KL configurations")
    rep, con, lines, whole = [], [], [], True
    for key, label in ((IN, "in-domain"), (rules.retained, _label(rules))):
        decidable, why = gates.moved(study, key, label, beta, lag, rules, [best, *others])
        lines += [why] if why else []
        whole &= decidable
        for other in others:
            ahead, short, line = accuracy_lines(best, other, key, label, rules.accuracy_margin)
            if decidable:
                rep.append(ahead)
                con.append(short)
            lines.append(line)
    # a claim about both sets is reproduced only where both could be decided
    return outcome(claim, source, setting, rep if whole else [], con, rules.alpha, lines)


def _breaks_more(claim: str, source: str, setting: str, a: Arm, b: Arm, rules: Rules) -> Outcome:
    """a breaks in more of its runs than b (Fisher). Contradicted, under gates, when the
    comparison was testable (Outcome.reach) and rate(a) - rate(b) is shown below
    Gates.break_difference; without gates (as the first two pre-registrations registered it)
    when a's break rate is shown below rules.break_rate (exact binomial)."""
    more = stats.fisher(a.broken, a.n, b.broken, b.n)
    lines = [f"{a.flags()}, {b.flags()}: {more.text}, {more.effect} (smallest reachable p "
             f"{more.min_p:.2g})"]
    if rules.gates is not None:
        con, line = gates.more_breaks_contradicted(a, b, rules)
        return outcome(claim, source, setting, [more], con, rules.alpha, [*lines, line],
                       reach=more.min_p)
    stable = stats.binomial(a.broken, a.n, rules.break_rate, "less")
    return outcome(claim, source, setting, [more], [stable], rules.alpha,
                   [*lines, f"{a.name}: {stable.text}"])


def k1_loss_unstable(study: Study, beta: float, lag: int, rules: Rules) -> Outcome:
    """Paper (on-policy; at max_lag > 0 klrl's off-policy extension, a different mechanism:
    E_mu[grad log pi] != 0): K1 in the loss is unstable. Reproduced: it breaks in more of its
    runs than K1 in the reward (Fisher, one-sided). Contradicted: its break rate is shown below
    rules.break_rate (exact binomial)."""
    claim, setting = "K1 in the loss is unstable", f"beta {beta:g}, max_lag {lag}"
    k1l, k1r = study.arm("k1", "loss", beta, lag), study.arm("k1", "reward", beta, lag)
    if k1l is None or k1r is None:
        return not_run(claim, _regime(lag), setting, "needs K1 in loss and in reward")
    return _breaks_more(claim, _regime(lag), setting, k1l, k1r, rules)


def k3_reward_breaks(study: Study, beta: float, lag: int, rules: Rules) -> Outcome:
    """klrl: K3 in the reward breaks off-policy (its exp(-delta) turns tokens the reference
    finds unlikely into huge costs). Reproduced: it breaks in more runs than K1 in the reward
    (Fisher). Contradicted: its break rate is shown below rules.break_rate (binomial)."""
    claim, setting = "K3 in the reward breaks off-policy", f"beta {beta:g}, max_lag {lag}"
    k3r, k1r = study.arm("k3", "reward", beta, lag), study.arm("k1", "reward", beta, lag)
    if k3r is None or k1r is None or lag == 0:
        return not_run(claim, "klrl", setting, "needs K3 and K1 in reward at a lag")
    return _breaks_more(claim, "klrl", setting, k3r, k1r, rules)


def k3_loss_stable_worse_ood(study: Study, beta: float, lag: int, rules: Rules) -> Outcome:
    """Paper: K3 in the loss is stable but generalises worse than K1 in the reward.
    Reproduced: its break rate is shown below rules.break_rate (binomial) and K1 in the
    reward is ahead of it on rules.retained (paired t), both. Contradicted: its break rate is
    shown above rules.break_rate, or K1 in the reward's lead there is shown below the margin
    (Bonferroni over the two)."""
    claim = "K3 in the loss is stable but worse " + (
        "out-of-domain" if rules.retained == OUT else f"on {_label(rules)}")
    setting, source = f"beta {beta:g}, max_lag {lag}", _regime(lag)
    k3l, k1r = study.arm("k3", "loss", beta, lag), study.arm("k1", "reward", beta, lag)
    if k3l is None or k1r is None:
        return not_run(claim, source, setting, "needs K3 in loss and K1 in reward")
    stable = stats.binomial(k3l.broken, k3l.n, rules.break_rate, "less")
    unstable = stats.binomial(k3l.broken, k3l.n, rules.break_rate, "greater")
    ahead, short, line = accuracy_lines(k1r, k3l, rules.retained, _label(rules),
                                        rules.accuracy_margin)
    decidable, why = gates.moved(study, rules.retained, _label(rules), beta, lag, rules,
                                 [k1r, k3l])
    # "stable but worse": reproduced only where "worse" could be decided
    return outcome(claim, source, setting, [stable, ahead] if decidable else [],
                   [unstable, short] if decidable else [unstable], rules.alpha,
                   [f"{k3l.name}: {stable.text}", *([why] if why else []), line])


def kl_stabilises_async(study: Study, beta: float, lag: int, rules: Rules) -> Outcome:
    """Paper: KL regularisation stabilises asynchronous training. Reproduced: the no-KL
    control (beta 0, same lag) breaks in more runs than K1 in the reward (Fisher).
    Contradicted (only where there was something to stabilise, i.e. the Fisher test is
    testable): K1 in the reward's own break rate is shown above rules.break_rate. Not testable
    here by Tarone's rule: when no Fisher table with these margins (the two arms' runs and
    their breaks together) could reach alpha, e.g. neither arm breaks. A control that never
    breaks beside a K1 arm that breaks often is testable, and can contradict the claim."""
    claim, setting = ("KL regularisation stabilises async training",
                      f"beta {beta:g} against beta 0, max_lag {lag}")
    nokl, k1r = study.arm(None, None, 0.0, lag), study.arm("k1", "reward", beta, lag)
    if nokl is None or k1r is None or lag == 0:
        return not_run(claim, "paper", setting,
                        "needs the no-KL control (kl.beta 0) and K1 in reward at a lag")
    more = stats.fisher(nokl.broken, nokl.n, k1r.broken, k1r.n)
    head = (f"{nokl.flags()}, {k1r.flags()}: {more.text}, {more.effect} (smallest reachable p "
            f"{more.min_p:.2g}; 95% upper bound on no KL's break rate "
            f"{stats.rate_bound(nokl.broken, nokl.n):.2f})")
    if rules.gates is not None:
        con, line = gates.more_breaks_contradicted(nokl, k1r, rules)
        return outcome(claim, "paper", setting, [more], con, rules.alpha, [head, line],
                       reach=more.min_p)
    breaks = stats.binomial(k1r.broken, k1r.n, rules.break_rate, "greater")
    return outcome(claim, "paper", setting, [more],
                    [breaks] if stats.reaches(more.min_p, rules.alpha) else [], rules.alpha,
                    [head, f"{k1r.name}: {breaks.text}"])


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
        return not_run(claim, "klrl", setting,
                        "needs configurations with and without kl.importance prefix at a lag")
    rep, con, lines = [], [], []
    for plain, fixed in pairs:
        more = stats.fisher(plain.broken, plain.n, fixed.broken, fixed.n)
        lines.append(f"{plain.flags()} -> {fixed.flags()}: {more.text}, {more.effect}")
        if stats.reaches(more.min_p, rules.alpha):
            rep.append(more)
            if rules.gates is not None:
                tests, line = gates.more_breaks_contradicted(plain, fixed, rules)
                con += tests
                lines.append(line)
            else:
                con.append(stats.binomial(fixed.broken, fixed.n, rules.break_rate, "greater"))
                lines.append(f"{fixed.name}: {con[-1].text}")
    reach = max((t.min_p for t in rep), default=0.0) if rules.gates is not None else 0.0
    return outcome(claim, "klrl", setting, rep, con, rules.alpha, lines, reach=reach)


CLAIMS: dict[str, Callable[..., Outcome]] = {f.__name__: f for f in (
    k1_reward_best, k1_loss_unstable, k3_loss_stable_worse_ood, kl_stabilises_async,
    k3_reward_breaks, prefix_repairs, dose.k1_loss_regularises_nothing, dose.breaks_with_dose,
    dose.kl_keeps_retained, claims_async.async_breaks_control, claims_async.kl_delays_breaks,
    claims_async.kl_beats_early_stopping, claims_async.biased_loss_rises_with_beta)}
if set(CLAIMS) != set(get_args(ClaimId)):
    raise AssertionError("findings.CLAIMS must test exactly the claims prereg.ClaimId names")
# What an exploratory report tests at each beta's largest lag (and, where the directory ran
# them, the paper's on-policy claims at max_lag 0): the dose claims need a pre-registered grid.
EXPLORATORY = (k1_reward_best, k1_loss_unstable, k3_loss_stable_worse_ood, kl_stabilises_async,
               k3_reward_breaks, prefix_repairs)
ON_POLICY = (k1_reward_best, k1_loss_unstable, k3_loss_stable_worse_ood,
             dose.k1_loss_regularises_nothing)


def _testable(o: Outcome, level: float) -> Outcome:
    """Tarone's rule for a contradiction under gates: a claim whose own comparison could not
    reach Holm's first `level` with these margins (Outcome.reach) cannot be contradicted by
    it either; with nothing left to test it is not testable here."""
    if o.status != "tested" or stats.reaches(o.reach, level):
        return o
    note = (f"; not testable: its comparison's smallest reachable p, {o.reach:.2g}, is above "
            f"Holm's first level {level:.2g}, so seeing no difference shows nothing")
    return replace(o, contradict=math.nan, evidence=o.evidence + note,
                   status="tested" if math.isfinite(o.reproduce) else "not testable here")


def decide(outcomes: Sequence[Outcome], alpha: float) -> list[Outcome]:
    """Verdicts after Holm's correction across `outcomes` and both directions (one family of
    2 x len(outcomes) p-values: "reproduced" and "contradicted" together keep the family-wise
    error at alpha; claims not run or not testable count in it with p = 1)."""
    level = alpha / (2 * max(1, len(outcomes)))
    outcomes = [_testable(o, level) for o in outcomes]
    both = stats.holm([o.reproduce for o in outcomes] + [o.contradict for o in outcomes])
    rep, con = both[:len(outcomes)], both[len(outcomes):]
    out = []
    for o, r, c in zip(outcomes, rep, con):
        verdict = o.status if o.status != "tested" else "reproduced" if stats.reaches(r, alpha) \
            else "contradicted" if stats.reaches(c, alpha) else "inconclusive"
        out.append(replace(o, verdict=verdict, adjusted=(r, c)))
    return out


def plan(study: Study, prereg: Preregistration | None, sweep: str) -> list[tuple]:
    """(claim function, beta, lag, extra arguments) to test: the pre-registration's claims for
    `sweep`, else (exploratory) every claim of EXPLORATORY at each beta's largest lag and, where
    the directory ran them on-policy too, the paper's on-policy claims (ON_POLICY) there."""
    if prereg is not None:
        sweep_plan = prereg.sweeps[sweep]

        def extra(c):
            if c.claim == "prefix_repairs":
                return {"repaired": sweep_plan.repaired}
            if c.claim == "breaks_with_dose":
                return {"configuration": c.configuration, "over": c.over, "doses": c.doses,
                        "direction": c.direction}
            if c.claim == "biased_loss_rises_with_beta":
                return {"doses": c.doses}
            return {}

        return [(CLAIMS[c.claim], c.beta or prereg.beta, c.max_lag, extra(c))
                for c in sweep_plan.claims]
    out = []
    for beta, lag in study.settings():
        if lag > 0 and study.arm("k1", "reward", beta, 0):
            out += [(claim, beta, 0, {}) for claim in ON_POLICY
                    if claim is not dose.k1_loss_regularises_nothing
                    or study.arm(None, None, 0.0, 0)]
        out += [(claim, beta, lag, {}) for claim in EXPLORATORY]
    return out


def _named(configuration: str) -> str:
    """"k1-loss[-prefix]" (a sweep plan's spelling) -> its arm's name, "none-..." -> no KL."""
    est, place, *imp = configuration.split("-")
    return "no KL" if est == "none" else arm_name((est, place, imp[0] if imp else "none", 0, 0))


# The configurations each claim is about (its own lag; dose claims: each dose's): the toy's
# rows (`klrl kl-fixed-points`) that say where theory expects each to end.
_ABOUT: dict[str, Callable[[dict], list[str]]] = {
    "k1_reward_best": lambda x: ["K1 in reward"],
    "k1_loss_unstable": lambda x: ["K1 in loss"],
    "k3_loss_stable_worse_ood": lambda x: ["K3 in loss"],
    "kl_stabilises_async": lambda x: ["no KL", "K1 in reward"],
    "k3_reward_breaks": lambda x: ["K3 in reward"],
    "prefix_repairs": lambda x: [_named(f"{c}-prefix") for c in
                                 x.get("repaired", ("k1-loss", "k3-reward"))],
    "k1_loss_regularises_nothing": lambda x: ["K1 in loss", "no KL"],
    "kl_keeps_retained": lambda x: ["K1 in reward", "no KL"],
    "breaks_with_dose": lambda x: [_named(x["configuration"])],
    "async_breaks_control": lambda x: ["no KL"],
    "kl_delays_breaks": lambda x: ["no KL", "K1 in reward"],
    "kl_beats_early_stopping": lambda x: ["K1 in reward", "no KL"],
    "biased_loss_rises_with_beta": lambda x: ["K1 in loss", "K3 in reward"],
}
if set(_ABOUT) != set(CLAIMS):
    raise AssertionError("findings._ABOUT must name the configurations of every claim")


def about(claim: Callable, lag: int, extra: dict) -> tuple[tuple[str, int], ...]:
    """(arm name, lag) of the configurations `claim` is about at `lag` (a dose claim over the
    lag: at each of its doses)."""
    lags = [int(d) for d in extra["doses"]] if extra.get("over") == "max_lag" else [lag]
    return tuple((name, lg) for lg in lags for name in _ABOUT[claim.__name__](extra))


def findings(measures: Sequence[Measures], rules: Rules, todo: Sequence[tuple],
             variant: str = PRIMARY, family_of_all: bool = False,
             base: dict[str, float] | None = None) -> list[Outcome]:
    """Every planned claim, decided. `family_of_all`: claims not run here stay in the Holm
    family (a pre-registration's); otherwise they are listed after it, outside. `base`: the
    base model's accuracy per set on the same problems (the retained gate's reference)."""
    study = Study.of(measures, variant, base)
    outcomes = [replace(claim(study, beta, lag, rules, **extra), toy=about(claim, lag, extra))
                for claim, beta, lag, extra in todo]
    if family_of_all:
        return decide(outcomes, rules.alpha)
    run = [o for o in outcomes if o.status != "not run here"]
    return decide(run, rules.alpha) + [replace(o, verdict=o.status) for o in outcomes
                                       if o.status == "not run here"]


def robust(measures: Sequence[Measures], rules: Rules, todo: Sequence[tuple],
           family_of_all: bool = False, base: dict[str, float] | None = None
           ) -> tuple[list[Outcome], list[str]]:
    """The findings under the failure definition, each marked fragile where a threshold
    variant (rules.sensitivity) changes its verdict, and the sensitivity table (markdown)."""
    primary = findings(measures, rules, todo, PRIMARY, family_of_all, base)
    variants = {v.name: findings(measures, rules, todo, v.name, family_of_all, base)
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


@dataclass(frozen=True)
class ToyRows:
    """The committed table of `klrl kl-fixed-points` as a report links it."""

    path: str            # from the report's directory
    anchors: set[str]    # its rows' (labels.toy_anchor)
    beta: float          # the beta its toy trained at


def _adjusted(f: Outcome) -> str:
    return " / ".join("-" if not math.isfinite(p) else f"{p:.2g}" for p in f.adjusted)


def findings_markdown(found: Sequence[Outcome], toy: ToyRows | None = None,
                      gated: Sequence[Outcome] | None = None,
                      run_betas: Sequence[float] = ()) -> list[str]:
    """The claims table; with `toy`, a column linking the rows of the configurations each
    claim is about (Outcome.toy) that the toy's table has. With `gated` (the same claims
    decided under prereg.Gates, for a pre-registration that registered none), both verdicts
    side by side and the gated evidence, which says what each gate saw. `run_betas`: the
    runs' kl.beta values, named in the toy column's header where they are not the toy's."""
    if not found:
        return ["No finished run with a KL penalty: no claim to test."]
    if gated is not None:
        head = ("| claim | from | setting | verdict as registered | verdict under the gates "
                "(a rule change made after the runs) | Holm-adjusted p (reproduce / "
                "contradict): registered; gated | evidence (mean ± standard error over seeds; "
                "each test's statistics; what each gate saw) |")
    else:
        head = ("| claim | from | setting | verdict | Holm-adjusted p (reproduce / contradict) "
                "| evidence (mean ± standard error over seeds; each test's statistics) |")
    others = [b for b in run_betas if not math.isclose(b, toy.beta)] if toy else []
    these = (f" (these runs: beta {', '.join(f'{b:g}' for b in run_betas)}; the toy's ends "
             "are at its own beta)" if others else "")
    lines = [head + (f" the toy at beta {toy.beta:g}{these}: where theory expects it to end |"
                     if toy else ""),
             "|---|---|---|---|---|---|" + ("---|" if gated is not None else "")
             + ("---|" if toy else "")]
    for i, f in enumerate(found):
        verdict = f"**{f.verdict}**" + (" (fragile)" if f.fragile else "")
        if gated is not None:
            g = gated[i]
            verdict += f" | **{g.verdict}**" + (" (fragile)" if g.fragile else "")
            row = (f"| {f.claim} | {f.source} | {f.setting} | {verdict} | {_adjusted(f)}; "
                   f"{_adjusted(g)} | {g.evidence} |")
        else:
            row = f"| {f.claim} | {f.source} | {f.setting} | {verdict} | {_adjusted(f)} | " \
                f"{f.evidence} |"
        if toy:
            links = [f"[{name}, lag {lag}]({toy.path}#{a})" for name, lag in f.toy
                     if (a := toy_anchor(name, lag)) in toy.anchors]
            row += f" {', '.join(links) or '-'} |"
        lines.append(row)
    return lines
