"""The claims of the second pre-registration (docs/sweeps/preregistration_regimes.yaml) beside
findings.py's: an equivalence claim on-policy and the dose-response of breaking.

- `k1_loss_regularises_nothing`: on-policy, K1 in the loss has expected gradient zero
  (E_pi[grad log pi] = 0: kl/dynamics.py trains it step for step as the no-KL control), so its
  runs should end as far from the reference as the no-KL control's. An equivalence claim on
  the KL at the end, paired by seed (two one-sided tests on log KL within +/- the margin).
- `kl_keeps_retained`: what a KL anchor is for: K1 in the reward ends with more of the
  capability the base model has and the task never rewards (rules.retained) than the no-KL
  control at the same lag, paired by seed; the long sweep tests it where forgetting happens.
- `breaks_with_dose`: a configuration's break rate rises (or falls) over ordered doses of beta
  or of the lag (Cochran-Armitage trend test), with each dose's break count, its
  Clopper-Pearson upper bound and the median step its broken runs broke at (time-to-break) as
  evidence.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from cluster.analysis import gates, stats
from cluster.analysis.arms import (
    Arm,
    Outcome,
    Study,
    accuracy_lines,
    compare,
    not_run,
    outcome,
)
from cluster.analysis.prereg import Rules


def k1_loss_regularises_nothing(study: Study, beta: float, lag: int, rules: Rules) -> Outcome:
    """klrl (the theory of the paper's on-policy mechanism): on-policy, K1 in the loss ends as
    far from the reference as no KL. Reproduced: the paired mean of log KL(K1 in the loss) -
    log KL(no KL) at the end is shown inside +/- rules.kl_log_margin (TOST: both one-sided
    paired tests, intersection-union). Contradicted: it is shown below -margin (K1 in the loss
    does hold the policy nearer the reference)."""
    claim = "K1 in the loss regularises nothing on-policy (equivalence with no KL)"
    setting = f"beta {beta:g} against beta 0, max_lag {lag}"
    k1l, nokl = study.arm("k1", "loss", beta, lag), study.arm(None, None, 0.0, lag)
    if k1l is None or nokl is None or lag != 0:
        return not_run(claim, "klrl (theory, on-policy)", setting,
                       "needs K1 in the loss and the no-KL control at max_lag 0")
    m, whence = gates.kl_margin(study, beta, lag, rules)
    if not math.isfinite(m):
        return outcome(claim, "klrl (theory, on-policy)", setting, [], [], rules.alpha,
                       [f"{k1l.flags()}; {nokl.flags()}", whence])
    above, below = compare(k1l, nokl, "kl", "greater", -m), compare(k1l, nokl, "kl", "less", m)
    closer = compare(k1l, nokl, "kl", "less", -m)
    lines = [f"{k1l.flags()}; {nokl.flags()}", *([whence] if whence else []),
             f"log KL ratio {below.effect.replace('mean paired difference ', '')}: above "
             f"-{m:.3g}: {above.text}; below +{m:.3g}: {below.text}; below -{m:.3g} "
             f"(regularises): {closer.text}"]
    return outcome(claim, "klrl (theory, on-policy)", setting, [above, below], [closer],
                   rules.alpha, lines)


def kl_keeps_retained(study: Study, beta: float, lag: int, rules: Rules) -> Outcome:
    """klrl (the premise of a KL anchor, which the paper's out-of-domain claims rest on): KL
    regularisation keeps what the base model has and the task never rewards. Reproduced: K1 in
    the reward ends ahead of the no-KL control (beta 0, same lag) on rules.retained (one-sided
    paired t by seed). Contradicted: its lead there is shown below rules.accuracy_margin
    (non-superiority): at this beta the anchor keeps nothing measurable."""
    label = rules.retained.replace("_", " ")
    claim = f"KL regularisation keeps the {label} capability (K1 in the reward against no KL)"
    setting = f"beta {beta:g} against beta 0, max_lag {lag}"
    k1r, nokl = study.arm("k1", "reward", beta, lag), study.arm(None, None, 0.0, lag)
    if k1r is None or nokl is None:
        return not_run(claim, "klrl (the anchor's premise)", setting,
                       "needs K1 in the reward and the no-KL control at the same lag")
    ahead, short, line = accuracy_lines(k1r, nokl, rules.retained, label, rules.accuracy_margin)
    decidable, why = gates.moved(study, rules.retained, label, beta, lag, rules)
    return outcome(claim, "klrl (the anchor's premise)", setting, [ahead] if decidable else [],
                   [short] if decidable else [], rules.alpha,
                   [f"{k1r.flags()}; {nokl.flags()}", *([why] if why else []), line])


def _time_to_break(arm: Arm) -> str:
    return f"median step {statistics.median(arm.break_steps):g}" if arm.break_steps else "-"


def breaks_with_dose(study: Study, beta: float, lag: int, rules: Rules, configuration: str,
                     over: str, doses: Sequence[float], direction: str = "rises") -> Outcome:
    """A configuration ("<estimator>-<placement>[-<importance>]") breaks more often as the
    dose (`over`: "beta" at max_lag `lag`, or "max_lag" at `beta`) rises ("rises") or less
    often ("falls"). Reproduced: the Cochran-Armitage trend test (one-sided). Contradicted:
    the break rate at the dose where the claim expects most breaks is shown below
    rules.break_rate (exact binomial): nothing to trend toward."""
    est, place, *imp = configuration.split("-")
    name = "no KL" if est == "none" else configuration
    doses = sorted(doses, reverse=direction == "falls")
    claim = f"{name} breaks more as {over} {'rises' if direction == 'rises' else 'falls'}"
    setting = (f"max_lag {lag}, beta {', '.join(f'{d:g}' for d in doses)}" if over == "beta"
               else f"beta {beta:g}, max_lag {', '.join(f'{d:g}' for d in doses)}")
    source = "klrl (dose-response)"

    def arm_at(dose):
        b, lg = (dose, lag) if over == "beta" else (beta, int(dose))
        if est == "none":
            return study.arm(None, None, 0.0, lg)
        return study.arm(est, place, b, lg, *(imp or ["none"]))

    arms = [arm_at(d) for d in doses]
    if any(a is None for a in arms):
        return not_run(claim, source, setting, f"needs {name} at every dose")
    trend = stats.trend([a.broken for a in arms], [a.n for a in arms],
                        [float(i) for i in range(len(doses))])
    top = arms[-1]
    cells = "; ".join(f"{over} {d:g}: {a.broken}/{a.n} broken (95% upper bound "
                      f"{stats.rate_bound(a.broken, a.n):.2f}; time-to-break {_time_to_break(a)}"
                      f"; {a.drifted} drifted)" for d, a in zip(doses, arms))
    trend_line = f"{trend.text} (smallest reachable p {trend.min_p:.2g})"
    if rules.gates is not None:  # the most against the least expected dose, where testable
        con, line = gates.more_breaks_contradicted(top, arms[0], rules)
        return outcome(claim, source, setting, [trend], con, rules.alpha,
                       [cells, trend_line, f"at {over} {doses[-1]:g} against {doses[0]:g}: "
                        + line], reach=trend.min_p)
    none_there = stats.binomial(top.broken, top.n, rules.break_rate, "less")
    return outcome(claim, source, setting, [trend], [none_there], rules.alpha,
                   [cells, trend_line, f"at {over} {doses[-1]:g}: {none_there.text}"])
