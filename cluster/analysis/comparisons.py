"""A researcher's own comparisons, tested as the pre-registered claims are.

A comparison (prereg.Comparison) names configuration A and configuration B by config values,
a measure and a direction. Each is tested paired by seed where at least two seeds ran both
(stats.paired), else unpaired (Welch), with the effect (A minus B), its 95% interval, Holm's
correction across the comparisons a report names, and the seeds the observed spread needs for
80% power at Holm's strictest level. A comparison is *exploratory* unless the report's
pre-registration fixed the same question for this sweep before the runs.

Without named comparisons a report still shows, for each pair of configurations that differ in
one key, the effect and interval on each evaluated set's final accuracy and on log KL:
descriptive rows, no verdict.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cluster.config.loader import ConfigError
from cluster.analysis import stats
from cluster.analysis.measures import Measures
from cluster.analysis.prereg import Comparison
from cluster.analysis.runs import faults_text

POWER = 0.8
CONFIDENCE = 0.95


def value_of(m: Measures, measure: str) -> float | None:
    """One run's value of a prereg.COMPARED_MEASURES name (None: the run has none)."""
    kind, _, name = measure.partition(".")
    value = {"accuracy": lambda: m.accuracy.get(name), "auc": lambda: m.auc.get(name),
             "kl_end": lambda: m.kl_end, "lag_mean": lambda: m.lag_mean,
             "log_kl_end": lambda: math.log(m.kl_end) if m.kl_end > 0 else None}[kind]()
    return value if value is not None and math.isfinite(value) else None


def _same(have: Any, want: Any) -> bool:
    if isinstance(have, int | float) and isinstance(want, int | float) \
            and not isinstance(have, bool) and not isinstance(want, bool):
        return math.isclose(have, want, rel_tol=1e-9, abs_tol=1e-12)
    return have == want or str(have) == str(want)


def pick(side: str, keys: dict[str, Any], measures: Sequence[Any]) -> tuple[str, list]:
    """(configuration label, its runs' measures) that `keys` pick; ConfigError when a key is
    no config key of these runs, or the keys pick no run or runs of several configurations.
    `measures`: anything with a flattened `config` and a `configuration` label (a sweep's
    grid points too, checked before they run: check_grid)."""
    known = {k for m in measures for k in m.config}
    for key in keys:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            raise ConfigError(f"comparison {side}: {key!r} is not a config key of these runs"
                              + (f" (did you mean {close[0]!r}?)" if close else ""))
    runs = [m for m in measures if all(_same(m.config.get(k), v) for k, v in keys.items())]
    labels = sorted({m.configuration for m in runs})
    if not labels:
        seen = {k: sorted({str(m.config.get(k)) for m in measures}) for k in keys}
        raise ConfigError(f"comparison {side}: no run has {_keys_text(keys)} (these runs have "
                          + "; ".join(f"{k}: {', '.join(v)}" for k, v in seen.items()) + ")")
    if len(labels) > 1:
        raise ConfigError(f"comparison {side}: {_keys_text(keys)} picks {len(labels)} "
                          f"configurations ({', '.join(labels)}); add the key that tells them "
                          "apart")
    return labels[0], runs


def _keys_text(keys: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in keys.items())


@dataclass(frozen=True)
class GridPoint:
    """A sweep's run as a comparison's keys see it before it ran."""

    config: dict[str, Any]     # its resolved TrainConfig, flattened to dotted keys
    configuration: str         # its grid values without the seed


def check_grid(comparisons: Sequence[Comparison], points: Sequence[GridPoint]) -> None:
    """ConfigError (naming `report.comparisons[i]`) for a comparison whose A or B picks no
    configuration of the sweep, or several: the door's check, before any run starts."""
    for i, c in enumerate(comparisons):
        for side in ("a", "b"):
            try:
                pick(side, getattr(c, side), points)
            except ConfigError as exc:
                raise ConfigError(f"report.comparisons[{i}].{exc}".replace(
                    f"report.comparisons[{i}].comparison ", f"report.comparisons[{i}].")) from None


@dataclass(frozen=True)
class Result:
    """One comparison tested."""

    comparison: Comparison
    label_a: str
    label_b: str
    n_a: int                 # finished runs with a value, each side
    n_b: int
    pairs: int               # seeds both ran (paired when at least 2)
    test: stats.Test
    effect: float            # mean of A minus mean of B (paired: the mean paired difference)
    interval: tuple[float, float] | None
    spread: float | None     # sd of a paired difference (paired) or of one run (unpaired)
    registered: bool
    faults: str              # the faults of the runs used ("" when none)
    adjusted: float = math.nan

    @property
    def title(self) -> str:
        c = self.comparison
        return c.name or f"{_keys_text(c.a)} vs {_keys_text(c.b)}: {c.measure}"


def test_comparison(c: Comparison, measures: Sequence[Measures], registered: bool) -> Result:
    """Test `c` on the finished runs (a broken run keeps its value: where it ended is part of
    what the configuration does)."""
    label_a, runs_a = pick("a", c.a, measures)
    label_b, runs_b = pick("b", c.b, measures)
    a = {m.seed: v for m in runs_a if m.finished and (v := value_of(m, c.measure)) is not None}
    b = {m.seed: v for m in runs_b if m.finished and (v := value_of(m, c.measure)) is not None}
    seeds = sorted(s for s in a.keys() & b.keys() if s is not None)
    used = [m for m in (*runs_a, *runs_b) if m.finished]
    faults = "; ".join(f"`{m.run}`: {faults_text(m.faults)}" for m in used if m.faults)
    if len(seeds) >= 2:
        diffs = [a[s] - b[s] for s in seeds]
        test = stats.paired([a[s] for s in seeds], [b[s] for s in seeds], c.direction)
        effect, interval = sum(diffs) / len(diffs), stats.mean_interval(diffs, CONFIDENCE)
        spread = float(np.std(diffs, ddof=1))
    elif len(a) >= 2 and len(b) >= 2:
        test = _welch(list(a.values()), list(b.values()), c.direction)
        effect = sum(a.values()) / len(a) - sum(b.values()) / len(b)
        interval = stats.welch_interval(list(a.values()), list(b.values()), CONFIDENCE)
        spread = math.sqrt((np.var(list(a.values()), ddof=1)
                            + np.var(list(b.values()), ddof=1)) / 2)
    else:
        test = stats.Test("paired", math.nan, math.nan, f"{len(a)} and {len(b)} finished "
                          "run(s): untestable (a test needs two a side)")
        effect = (sum(a.values()) / len(a) - sum(b.values()) / len(b)) if a and b else math.nan
        interval, spread = None, None
    return Result(c, label_a, label_b, len(a), len(b), len(seeds), test, effect, interval,
                  spread, registered, faults)


def _welch(a: list[float], b: list[float], direction: str) -> stats.Test:
    if direction != "two-sided":
        return stats.welch(a, b, direction)
    up, down = stats.welch(a, b, "greater"), stats.welch(a, b, "less")
    p = min(1.0, 2 * min(up.p, down.p))
    return stats.Test("welch", p, 0.0, up.text.rsplit(",", 1)[0] + f", two-sided p = {p:.3g}",
                      up.effect)


def test_all(comparisons: Sequence[Comparison], fixed: Sequence[Comparison],
             measures: Sequence[Measures]) -> list[Result]:
    """Every comparison tested, Holm-adjusted across them; `fixed`: the pre-registration's for
    this sweep (each is tested too, named or not)."""
    todo = list(comparisons) + [f for f in fixed
                                if not any(f.same_question(c) for c in comparisons)]
    results = [test_comparison(c, measures, any(c.same_question(f) for f in fixed))
               for c in todo]
    testable = [i for i, r in enumerate(results) if r.test.testable]
    adjusted = stats.holm([results[i].test.p for i in testable])
    out = list(results)
    for i, p in zip(testable, adjusted):
        out[i] = dataclasses.replace(results[i], adjusted=p)
    return out


def one_key_pairs(measures: Sequence[Measures], keys: Sequence[str]) -> list[Comparison]:
    """The comparisons a report shows unasked: each pair of configurations whose `keys` (the
    keys the report labels configurations by) differ in exactly one, on each evaluated set's
    final accuracy and on log KL at the end."""
    settings: dict[str, dict] = {}
    for m in measures:
        settings.setdefault(m.configuration, {k: m.config.get(k) for k in keys})
    sets = {s: None for m in measures for s in m.accuracy}  # each evaluated set, in order
    names = [f"accuracy.{s}" for s in sets]
    if any(m.kl_end > 0 for m in measures):
        names.append("log_kl_end")
    labels = sorted(settings)
    out = []
    for i, x in enumerate(labels):
        for y in labels[i + 1:]:
            differ = [k for k in keys if not _same(settings[x][k], settings[y][k])]
            if len(differ) != 1:
                continue
            a = {k: settings[x][k] for k in keys if settings[x][k] is not None}
            b = {k: settings[y][k] for k in keys if settings[y][k] is not None}
            if not a or not b or a == b:
                continue
            out += [Comparison(a=a, b=b, measure=name, name=f"{differ[0]}: {name}")
                    for name in names]
    return out


def _number(x: float) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:+.3g}"


def _seeds(r: Result, alpha: float, family: int) -> str:
    """Seeds the observed effect and spread need for POWER at Holm's strictest level."""
    if r.spread is None or not math.isfinite(r.effect):
        return "- (no spread: two runs a side first)"
    sided = 1 if r.comparison.direction == "two-sided" else 0
    level = alpha / max(family, 1) / (2 if sided else 1)
    n = stats.seeds_for_power(r.effect, r.spread, level, paired=r.pairs >= 2, power=POWER)
    return f"{n}" if n else "none (no effect seen)" if r.effect == 0 else "over 10,000"


def markdown(results: Sequence[Result], alpha: float, named: bool) -> list[str]:
    """The comparisons table: named comparisons with their Holm-adjusted verdicts, or (named
    False) the unasked one-key pairs, descriptive."""
    if not results:
        return []
    family = sum(r.test.testable for r in results)
    lines = ["| comparison | A | B | runs (pairs) | effect A - B [95% interval] | test | "
             + ("Holm-adjusted p | verdict | " if named else "")
             + f"seeds for {POWER:.0%} power | status | faults in these runs |",
             "|---|---|---|---|---|---|" + ("---|---|" if named else "") + "---|---|---|"]
    for r in results:
        low, high = r.interval or (math.nan, math.nan)
        row = (f"| {r.title} | `{r.label_a}` | `{r.label_b}` | {r.n_a}, {r.n_b} ({r.pairs}) | "
               f"{_number(r.effect)} [{_number(low)}, {_number(high)}] | {r.test.text} | ")
        if named:
            shown = r.test.testable and stats.reaches(r.adjusted, alpha)
            verdict = ("not testable" if not r.test.testable else
                       f"shown ({r.comparison.direction})" if shown else "not shown")
            row += f"{_number(r.adjusted).lstrip('+')} | **{verdict}** | "
        status = "pre-registered" if r.registered else "exploratory" if named else "descriptive"
        row += f"{_seeds(r, alpha, family if named else 1)} | {status} | {r.faults or 'none'} |"
        lines.append(row)
    return lines


def comparisons_section(comparisons: Sequence[Comparison], fixed: Sequence[Comparison],
                        measures: Sequence[Measures], keys: Sequence[str], alpha: float
                        ) -> list[str]:
    """The report's "Comparisons" section (markdown lines)."""
    named = bool(comparisons or fixed)
    if named:
        results = test_all(comparisons, fixed, measures)
        head = (f"The comparisons this report was asked for (`report.comparisons`, `klrl "
                f"report --compare`{', the pre-registration' if fixed else ''}): each paired "
                f"by seed where two or more seeds ran both (else Welch's unpaired test), "
                f"Holm's correction across the {len(results)} of them at alpha {alpha:g}. "
                "*Exploratory* unless the pre-registration fixed the same question before the "
                "runs. The seeds column: how many seeds the observed effect and spread need "
                f"for {POWER:.0%} power at Holm's strictest level.")
    else:
        results = [test_comparison(c, measures, False) for c in one_key_pairs(measures, keys)]
        head = ("No comparison was named (`report.comparisons`, `klrl report --compare`): "
                "each pair of configurations that differ in one key, on each evaluated set's "
                "final accuracy and on log KL at the end; effects and intervals describe "
                "these runs, and no verdict is drawn.")
    if not results:
        return []
    return ["## Comparisons", "", head, "", *markdown(results, alpha, named), ""]
