"""The claims of a confirmation in a regime where the no-KL control breaks (issue 63 item 4),
beside findings.py's and dose.py's:

- `async_breaks_control`: the no-KL control breaks more at the lag than on-policy (Fisher):
  the instability is the asynchrony's, the premise of "KL stabilises async training".
- `kl_delays_breaks`: the no-KL control breaks sooner than K1 in the reward at the same lag
  (log-rank on the time-to-break, unbroken runs censored at their last step): the time
  dimension of "KL stabilises async training", which break counts at the end throw away.
- `kl_beats_early_stopping`: at matched in-domain accuracy K1 in the reward keeps more of the
  retained set than the no-KL run stopped early, at the point of its own curve where it first
  reached K1 in the reward's accuracy (paired by seed): KL is not only slower training.
- `biased_loss_rises_with_beta`: off-policy, the configurations whose gradient is biased there
  (K1 in the loss, K3 in the reward) fall further behind K1 in the reward in-domain as beta
  rises (paired by seed: the gap at the largest beta minus the gap at the smallest).

Each follows the gates (gates.py) as the other claims do: comparisons of break rates only
where testable, accuracy comparisons only on sets that moved.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from cluster.analysis import gates, stats
from cluster.analysis.arms import IN, Arm, Outcome, Study, not_run, outcome
from cluster.analysis.prereg import Rules

BIASED = (("k1", "loss"), ("k3", "reward"))  # their gradient is biased off-policy (kl.md)


def async_breaks_control(study: Study, beta: float, lag: int, rules: Rules) -> Outcome:
    """klrl (the premise of the stabilisation claim): the no-KL control breaks in more runs at
    `lag` than at max_lag 0 (Fisher). Contradicted, under gates, where testable and the
    difference of rates is shown below the gates' margin."""
    claim, setting = "Asynchrony breaks the no-KL control", f"beta 0, max_lag {lag} against 0"
    at_lag, on_policy = study.arm(None, None, 0.0, lag), study.arm(None, None, 0.0, 0)
    if at_lag is None or on_policy is None or lag == 0:
        return not_run(claim, "klrl", setting, "needs the no-KL control at a lag and at 0")
    more = stats.fisher(at_lag.broken, at_lag.n, on_policy.broken, on_policy.n)
    lines = [f"{at_lag.flags()} at max_lag {lag}; {on_policy.flags()} at max_lag 0: "
             f"{more.text}, {more.effect} (smallest reachable p {more.min_p:.2g})"]
    con = []
    if rules.gates is not None:
        con, line = gates.more_breaks_contradicted(at_lag, on_policy, rules)
        lines.append(line)
    return outcome(claim, "klrl", setting, [more], con, rules.alpha, lines,
                   reach=more.min_p if rules.gates is not None else 0.0)


def kl_delays_breaks(study: Study, beta: float, lag: int, rules: Rules) -> Outcome:
    """Paper (its stabilisation claim, in time): the no-KL control breaks sooner than K1 in
    the reward at the same lag (log-rank, one-sided). Not testable where nothing broke; no
    contradiction (a time-to-break has no equivalence margin here), so the gates' Tarone rule,
    which guards contradictions, has nothing to guard."""
    claim = "KL regularisation delays breaking (time-to-break)"
    setting = f"beta {beta:g} against beta 0, max_lag {lag}"
    nokl, k1r = study.arm(None, None, 0.0, lag), study.arm("k1", "reward", beta, lag)
    if nokl is None or k1r is None or lag == 0:
        return not_run(claim, "paper", setting,
                       "needs the no-KL control and K1 in the reward at a lag")
    sooner = stats.logrank(nokl.times, k1r.times)
    return outcome(claim, "paper", setting, [sooner], [], rules.alpha,
                   [f"{nokl.flags()}; {k1r.flags()}: {sooner.text} ({sooner.effect})"])


def _at_accuracy(curve: Sequence[tuple[int, float]], target: float) -> float:
    """The step at which a curve first reaches `target` (linear between evaluations); NaN when
    it never does."""
    for (s0, v0), (s1, v1) in zip(curve, curve[1:]):
        if v0 >= target:
            return float(s0)
        if v1 >= target:
            return s0 + (s1 - s0) * (target - v0) / (v1 - v0)
    return float(curve[-1][0]) if curve and curve[-1][1] >= target else math.nan


def _value_at(curve: Sequence[tuple[int, float]], step: float) -> float:
    """A curve's value at `step`, linear between evaluations."""
    for (s0, v0), (s1, v1) in zip(curve, curve[1:]):
        if s0 <= step <= s1:
            return v0 if s1 == s0 else v0 + (v1 - v0) * (step - s0) / (s1 - s0)
    return curve[-1][1] if curve and step >= curve[-1][0] else math.nan


def matched_retained(k1r: Arm, nokl: Arm, retained: str) -> tuple[list, list, int]:
    """Per seed both ran: (K1 in the reward's retained accuracy at its last evaluation, the
    no-KL run's retained accuracy where its in-domain curve first reached K1 in the reward's
    last in-domain accuracy), and how many seeds had no such point (the no-KL run never got
    there). Both from the evaluations during training: the same problems in every run."""
    ours, stopped, missed = [], [], 0
    for seed in sorted(set(k1r.curves) & set(nokl.curves)):
        mine, early = k1r.curves[seed], nokl.curves[seed]
        if not (mine.get(IN) and mine.get(retained) and early.get(IN) and early.get(retained)):
            continue
        step = _at_accuracy(early[IN], mine[IN][-1][1])
        if math.isnan(step):
            missed += 1
            continue
        ours.append(mine[retained][-1][1])
        stopped.append(_value_at(early[retained], step))
    return ours, stopped, missed


def kl_beats_early_stopping(study: Study, beta: float, lag: int, rules: Rules) -> Outcome:
    """klrl: at matched in-domain accuracy, K1 in the reward keeps more of rules.retained than
    the no-KL control stopped where its curve first reached that accuracy (one-sided paired t
    by seed). Contradicted: its lead is shown below rules.accuracy_margin. Needs the runs'
    evaluation curves (not runs.csv) and, under gates, a retained set that moved."""
    claim = "KL keeps more than early stopping at matched in-domain accuracy"
    setting = f"beta {beta:g} against beta 0, max_lag {lag}"
    k1r, nokl = study.arm("k1", "reward", beta, lag), study.arm(None, None, 0.0, lag)
    if k1r is None or nokl is None or not k1r.curves or not nokl.curves:
        return not_run(claim, "klrl", setting, "needs K1 in the reward and the no-KL control "
                       "at the same lag, with their evaluation curves")
    label = rules.retained.replace("_", " ")
    ours, stopped, missed = matched_retained(k1r, nokl, rules.retained)
    ahead = stats.paired(ours, stopped, "greater")
    short = stats.paired(ours, stopped, "less", rules.accuracy_margin)
    decidable, why = gates.moved(study, rules.retained, label, beta, lag, rules)
    lines = [*([why] if why else []),
             f"{label} at matched in-domain accuracy, {len(ours)} seed(s) ({missed} where the "
             f"no-KL run never reached K1 in the reward's accuracy): {ahead.effect}; ahead: "
             f"{ahead.text}; lead below {rules.accuracy_margin:g}: {short.text}"]
    return outcome(claim, "klrl", setting, [ahead] if decidable else [],
                   [short] if decidable else [], rules.alpha, lines)


def biased_loss_rises_with_beta(study: Study, beta: float, lag: int, rules: Rules,
                                doses: Sequence[float] = ()) -> Outcome:
    """klrl (theory: their gradient is biased off-policy, and beta scales the bias): at
    `lag`, K1 in the loss and K3 in the reward each fall further behind K1 in the reward
    in-domain at the largest of `doses` (betas) than at the smallest (one-sided paired t on
    the per-seed change of the gap; intersection-union over the two). Contradicted: for one of
    them the change is shown below rules.accuracy_margin (Bonferroni)."""
    low, high = min(doses), max(doses)
    claim = "Off-policy, the biased configurations lose more in-domain as beta rises"
    setting = f"max_lag {lag}, beta {low:g} to {high:g}"
    rep, con, lines, whole = [], [], [], True
    for est, place in BIASED:
        pair = [(study.arm("k1", "reward", b, lag), study.arm(est, place, b, lag))
                for b in (low, high)]
        if any(a is None or b is None for a, b in pair) or lag == 0:
            return not_run(claim, "klrl", setting, "needs K1 in the reward, K1 in the loss and "
                           "K3 in the reward at both betas, at a lag")
        gaps = []
        for k1r, other in pair:
            x, y = k1r.by_seed(IN), other.by_seed(IN)
            gaps.append({s: x[s] - y[s] for s in set(x) & set(y)})
        seeds = sorted(set(gaps[0]) & set(gaps[1]))
        grows = stats.paired([gaps[1][s] for s in seeds], [gaps[0][s] for s in seeds],
                             "greater")
        short = stats.paired([gaps[1][s] for s in seeds], [gaps[0][s] for s in seeds], "less",
                             rules.accuracy_margin)
        decidable, why = gates.moved(study, IN, "in-domain", high, lag, rules,
                                     [pair[1][0], pair[1][1]])
        whole &= decidable
        name = f"{est.upper()} in {place}"
        lines += [*([why] if why else []),
                  f"{name}: its gap behind K1 in the reward grows from beta {low:g} to "
                  f"{high:g} by {grows.effect.replace('mean paired difference ', '')}; grows: "
                  f"{grows.text}; below {rules.accuracy_margin:g}: {short.text}"]
        if decidable:
            rep.append(grows)
            con.append(short)
    return outcome(claim, "klrl", setting, rep if whole else [], con, rules.alpha, lines)
