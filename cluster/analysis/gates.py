"""When a claim can be decided at all (prereg.Gates; issue 63): the claims of findings.py and
dose.py ask here before they test.

- A comparison of break rates ("X breaks more than Y", a dose trend, "KL stabilises async") is
  *contradicted* only where its own test could have reproduced it (its smallest reachable p
  reaches Holm's first level: Tarone's rule, applied in findings.decide through
  Outcome.reach) and the upper confidence bound of rate(X) - rate(Y) is below
  Gates.break_difference (stats.rate_difference_below). A configuration that truly breaks 10%
  of the time against 0% is not contradicted by seeing no break in ten runs: nothing could
  have been shown.
- An accuracy comparison on a set is decided only where the set moved: on the retained set,
  where the no-KL control at that lag lost at least Gates.retained_loss accuracy margins of it
  against the base model; on any other set, where K1 in the reward and the no-KL control at
  that setting differ by at least Gates.placement_moved margins. Otherwise nothing was
  forgotten (or placed), and no configuration can keep more of it.
- The KL equivalence margin is Gates.kl_margin_share of the paired log-KL effect of K1 in the
  reward against no KL at the same setting: "as far as no KL" within half of what a working
  regulariser does.

Without gates (Rules.gates null: the first two pre-registrations as registered) every function
here lets everything through, so their registered verdicts are recomputed exactly.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from cluster.analysis import stats
from cluster.analysis.arms import Arm, Study
from cluster.analysis.prereg import Rules

RETAINED = "retained"  # the set a model can forget (rewards.config's split of the same name)


def _mean(arm: Arm | None, key: str) -> float:
    values = arm.accuracy.get(key, ()) if arm else ()
    return statistics.fmean(values) if values else math.nan


def moved(study: Study, key: str, label: str, beta: float, lag: int, rules: Rules,
          compared: Sequence[Arm] = ()) -> tuple[bool, str]:
    """(whether an accuracy comparison on set `key` can be decided at this setting, the
    evidence line that says why or why not). Where no no-KL control ran at this lag (an
    exploratory grid), a set other than the retained one counts as moved when the `compared`
    configurations' means themselves spread by the gate's margins: something moved it."""
    gates = rules.gates
    if gates is None:
        return True, ""
    nokl = study.arm(None, None, 0.0, lag)
    if key == RETAINED:
        need = gates.retained_loss * rules.accuracy_margin
        base, end = study.base.get(key, math.nan), _mean(nokl, key)
        if not (math.isfinite(base) and math.isfinite(end)):
            return False, (f"{label} not decidable: needs the base model's evaluation and the "
                           f"no-KL control at max_lag {lag} to see whether anything was "
                           "forgotten")
        lost = base - end
        return lost >= need, (f"{label} {'decidable' if lost >= need else 'not decidable'}: "
                              f"the no-KL control lost {lost:+.3f} of it (base {base:.3f} -> "
                              f"{end:.3f}; the gate asks {need:.3f})")
    need = gates.placement_moved * rules.accuracy_margin
    k1r = study.arm("k1", "reward", beta, lag)
    if nokl is None and compared:
        means = [m for a in compared if math.isfinite(m := _mean(a, key))]
        spread = max(means) - min(means) if len(means) >= 2 else math.nan
        ok = spread >= need
        return ok, (f"{label} {'decidable' if ok else 'not decidable'}: no no-KL control at "
                    f"max_lag {lag}; the compared configurations' means spread by "
                    f"{spread:.3f} there (the gate asks {need:.3f})")
    diff = _mean(k1r, key) - _mean(nokl, key)
    if not math.isfinite(diff):
        return False, (f"{label} not decidable: needs K1 in the reward and the no-KL control "
                       f"at beta {beta:g}, max_lag {lag} to see whether the KL moved it")
    ok = abs(diff) >= need
    return ok, (f"{label} {'decidable' if ok else 'not decidable'}: K1 in the reward and no KL "
                f"differ by {diff:+.3f} there (the gate asks {need:.3f} either way)")


def more_breaks_contradicted(a: Arm, b: Arm, rules: Rules) -> tuple[list[stats.Test], str]:
    """The contradiction test of "a breaks more than b" under gates, and its evidence line:
    rate(a) - rate(b) shown below Gates.break_difference. (Only counted where the comparison
    was testable: the caller passes the comparison's min_p as Outcome.reach.)"""
    test = stats.rate_difference_below(a.broken, a.n, b.broken, b.n,
                                       rules.gates.break_difference)
    return [test], f"{a.name} against {b.name}: {test.text}, {test.effect}"


def kl_margin(study: Study, beta: float, lag: int, rules: Rules) -> tuple[float, str]:
    """The KL equivalence margin on the log scale and the line that says where it comes from:
    rules.kl_log_margin without gates; under gates a share of the paired log-KL effect of K1 in
    the reward against no KL at this beta and lag (NaN when that cannot be measured)."""
    if rules.gates is None:
        return rules.kl_log_margin, ""
    k1r, nokl = study.arm("k1", "reward", beta, lag), study.arm(None, None, 0.0, lag)
    if k1r is None or nokl is None:
        return math.nan, (f"margin not measurable: needs K1 in the reward at beta {beta:g}, "
                          f"max_lag {lag} (a working regulariser) beside no KL")
    x, y = k1r.by_seed("kl"), nokl.by_seed("kl")
    common = sorted(set(x) & set(y))
    diffs = [x[s] - y[s] for s in common] if len(common) >= 2 else []
    effect = statistics.fmean(diffs) if diffs else (
        statistics.fmean(x.values()) - statistics.fmean(y.values()) if x and y else math.nan)
    if not math.isfinite(effect) or effect == 0:
        return math.nan, "margin not measurable: no KL at the end to compare"
    margin = rules.gates.kl_margin_share * abs(effect)
    return margin, (f"margin {margin:.3g} = {rules.gates.kl_margin_share:g} x |{effect:+.3f}|, "
                    "the log-KL effect of K1 in the reward against no KL "
                    f"({'paired over ' + str(len(diffs)) + ' seeds' if diffs else 'unpaired'})")
