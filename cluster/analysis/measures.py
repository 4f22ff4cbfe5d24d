"""Per-run measures the findings compare, and the CSV every report directory keeps of them.

Per run: the final greedy accuracy of each evaluation set (the final checkpoint's evaluation,
final_eval.json, when it has the pre-registered problems and seed; else the last evaluation
during training, which the report says), the last evaluation during training, the area under
the accuracy curve (mean accuracy over the run: trapezoids between evaluations over the steps
they span), the KL to the reference at the end (mean `kl/pi_ref` over the last TAIL_STEPS
steps), how off-policy its data was (the mean over its steps of the batch's mean lag,
`lag/mean`: at max_lag > 0 it depends on timing, so the report shows it), whether the
run broke under the failure definition (prereg.FailureRule: instability, not distance) and
under each variant of the sensitivity table, the step it broke at (time-to-break), and whether
its KL drifted (a KL blow-up: reported beside the breaks, never one unless the definition
lists "kl_drift").
"""
from __future__ import annotations

import csv
import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cluster.analysis.prereg import FailureKind, Rules
from cluster.analysis.runs import (
    RunData,
    accuracy_collapse,
    grad_blowup,
    kl_blowup,
    nonfinite_steps,
    reward_collapse,
    run_faults,
)
from rewards.config import EVAL_SETS

TAIL_STEPS = 10    # training steps averaged for the KL at the end
KL = "kl/pi_ref"
LAG = "lag/mean"   # the batch's mean lag in policy versions, logged every step
PRIMARY = "as registered"  # the failure definition itself, beside its variants


@dataclass(frozen=True)
class Measures:
    """What the findings and the CSV know of one run."""

    run: str
    configuration: str
    seed: int | None
    finished: bool
    config: dict
    commit: str
    accuracy: dict[str, float]     # set -> final greedy accuracy (see source)
    source: str                    # where `accuracy` comes from
    last_eval: dict[str, float]    # set -> last greedy evaluation during training
    auc: dict[str, float]          # set -> area under the greedy accuracy curve / steps
    kl_end: float
    lag_mean: float                # mean over the steps of the batch's mean lag
    broken: dict[str, str]         # PRIMARY or variant name -> why it broke ("": it did not)
    break_step: int | None = None  # the step it broke at under PRIMARY (None: it did not)
    drifted: str = ""              # why its KL counts as blown up ("": it did not), a flag
    last_step: int | None = None   # its last logged step: where an unbroken run is censored
    # set -> (step, greedy accuracy) of each evaluation during training (empty from runs.csv)
    curve: dict[str, tuple[tuple[int, float], ...]] = field(default_factory=dict)
    # fault (as runs.run_faults names it) -> how often it happened in this run (empty: none)
    faults: dict[str, int] = field(default_factory=dict)


def final_accuracy(run: RunData, rules: Rules) -> tuple[dict[str, float], str]:
    """(set -> accuracy, source): the final checkpoint's evaluation when it has
    rules.final_problems problems (a set holding fewer distinct problems: all of them;
    cluster/sweeps/final_eval.py) and rules.final_eval_seed, else the last evaluation."""
    final = run.final_eval
    if final and (final.get("problems"), final.get("seed")) \
            == (rules.final_problems, rules.final_eval_seed):
        return ({name: s["accuracy"] for name, s in final["sets"].items()},
                f"final checkpoint, {rules.final_problems} problems (a set of fewer: whole)")
    last = {name: values[-1] for name in EVAL_SETS
            if (values := run.series(f"eval/{name}/accuracy")[1])}
    problems = run.config.get("eval.num_problems", "?")
    return last, f"last evaluation, {problems} problems"


def area_under_curve(steps: Sequence[float], values: Sequence[float]) -> float:
    """Mean of the piecewise-linear curve through (step, value) over the steps it spans."""
    pts = [(s, v) for s, v in zip(steps, values) if math.isfinite(v)]
    if len(pts) < 2:
        return pts[0][1] if pts else math.nan
    area = sum((s1 - s0) * (v0 + v1) / 2 for (s0, v0), (s1, v1) in itertools.pairwise(pts))
    return area / (pts[-1][0] - pts[0][0])


def kl_at_end(run: RunData) -> float:
    steps, values = run.series(KL)
    tail = [v for s, v in zip(steps, values) if s > 0][-TAIL_STEPS:]
    return statistics.fmean(tail) if tail else math.nan


def mean_lag(run: RunData) -> float:
    values = [v for v in run.series(LAG)[1] if math.isfinite(v)]
    return statistics.fmean(values) if values else math.nan


def first_break(run: RunData, rules: Rules, changes: dict | None = None,
                kinds: list[FailureKind] | None = None) -> tuple[str, int | None]:
    """(why the run broke, the step) under the failure definition (with a variant's `changes`
    to its thresholds and `kinds`), the earliest of its kinds; ("", None) when it did not."""
    cfg = rules.failure.thresholds.model_copy(update=changes or {})
    hits: list[tuple[int, str]] = []
    for kind in kinds or rules.failure.kinds:
        if kind == "accuracy_collapse":
            for name in rules.failure.sets:
                if hit := accuracy_collapse(*run.series(f"eval/{name}/accuracy"), cfg):
                    hits.append((hit[0], f"{name} accuracy collapse at step {hit[0]}"))
        elif kind == "reward_collapse":
            if hit := reward_collapse(*run.series(cfg.reward_metric), cfg):
                hits.append((hit[0], f"reward collapse at step {hit[0]}"))
        elif kind == "grad_blowup":
            if hit := grad_blowup(*run.series(cfg.grad_metric), cfg):
                hits.append((hit[0], f"gradient-norm blow-up at step {hit[0]}"))
        elif kind == "kl_drift":
            if hit := kl_blowup(*run.series(cfg.kl_metric), cfg):
                hits.append((hit[0], f"KL blow-up at step {hit[0]}"))
        elif hit := nonfinite_steps(run):
            hits.append((hit[0], f"non-finite at step {hit[0]}"))
    if not hits:
        return "", None
    step, why = min(hits)
    return why, step


def why_broken(run: RunData, rules: Rules, changes: dict | None = None,
               kinds: list[FailureKind] | None = None) -> str:
    """Why the run broke (first_break), or "" when it did not."""
    return first_break(run, rules, changes, kinds)[0]


def measure(run: RunData, configuration: str, commit: str, rules: Rules) -> Measures:
    accuracy, source = final_accuracy(run, rules)
    last = {name: values[-1] for name in EVAL_SETS
            if (values := run.series(f"eval/{name}/accuracy")[1])}
    auc = {name: area_under_curve(*run.series(f"eval/{name}/accuracy")) for name in last}
    why, step = first_break(run, rules)
    broken = {PRIMARY: why}
    broken |= {v.name: why_broken(run, rules, v.changes, v.kinds) for v in rules.sensitivity}
    drift = kl_blowup(*run.series(rules.failure.thresholds.kl_metric), rules.failure.thresholds)
    seed = run.config.get("seed")
    curve = {name: tuple(zip(*run.series(f"eval/{name}/accuracy"))) for name in last}
    return Measures(run.name, configuration, seed if isinstance(seed, int) else None,
                    run.finished, run.config, commit, accuracy, source, last, auc,
                    kl_at_end(run), mean_lag(run), broken, step,
                    f"KL blow-up at step {drift[0]}" if drift else "",
                    max(run.rows, default=None), curve, run_faults(run))


def trained(measures: Sequence[Measures]) -> list[Measures]:
    """The finished runs that did not break under the failure definition: those whose
    accuracy and KL say where training went (a broken run's say how it broke)."""
    return [m for m in measures if m.finished and not m.broken[PRIMARY]]


def observed_seed_sd(measures: Sequence[Measures], sets: Sequence[str]) -> dict[str, float]:
    """Set -> the pooled sd over seeds of the final accuracy: the root of the mean of the
    configurations' sample variances, over each configuration's trained runs (a break is
    another outcome, not seed noise), where it has at least two."""
    out = {}
    for key in sets:
        per: dict[str, list[float]] = {}
        for m in trained(measures):
            if math.isfinite(v := m.accuracy.get(key, math.nan)):
                per.setdefault(m.configuration, []).append(v)
        variances = [statistics.variance(v) for v in per.values() if len(v) > 1]
        if variances:
            out[key] = math.sqrt(statistics.fmean(variances))
    return out


def observed_paired_sd(measures: Sequence[Measures],
                       sets: Sequence[str]) -> dict[str, tuple[float, float]]:
    """Set -> (residual sd, sd of the seed effects) of the final accuracy under the model the
    paired design's power figures assume: configuration + seed (a block every configuration
    shares) + residual, fitted by least squares to the trained runs (a break is another
    outcome, not seed noise). The residual is what a paired test sees (the design's seed_sd),
    the seed effects what pairing removes (its seed_block_sd, here with their estimation
    noise in it). Needs two configurations, two seeds and a residual degree of freedom."""
    out = {}
    for key in sets:
        rows = [(m.configuration, m.seed, v) for m in trained(measures)
                if m.seed is not None and math.isfinite(v := m.accuracy.get(key, math.nan))]
        configs = sorted({c for c, _, _ in rows})
        seeds = sorted({s for _, s, _ in rows})
        if len(configs) < 2 or len(seeds) < 2:
            continue
        design = np.zeros((len(rows), len(configs) + len(seeds) - 1))
        for i, (c, s, _) in enumerate(rows):
            design[i, configs.index(c)] = 1.0
            if s != seeds[0]:  # the first seed's effect is the baseline: 0
                design[i, len(configs) + seeds.index(s) - 1] = 1.0
        y = np.array([v for _, _, v in rows])
        coef, _, rank, _ = np.linalg.lstsq(design, y, rcond=None)
        dof = len(rows) - rank
        if dof < 1:
            continue
        residual = float(np.sqrt(np.sum((y - design @ coef) ** 2) / dof))
        effects = [0.0, *coef[len(configs):]]
        out[key] = (residual, statistics.stdev(effects))
    return out


def accuracy_kl_correlation(measures: Sequence[Measures], within_seed: bool = False
                            ) -> dict[str, tuple[float, int]]:
    """Set -> (Pearson r, runs) of the final accuracy against log KL at the end, over the
    trained runs; `within_seed`: both centred on their seed's mean first, so that a seed that
    scores low and moves little everywhere does not make the correlation. Descriptive:
    whether scoring higher goes with moving further from the reference; no claim tests it."""
    ok = [m for m in trained(measures) if math.isfinite(m.kl_end) and m.kl_end > 0]
    out = {}
    for name in EVAL_SETS:
        rows = [(m.seed, math.log(m.kl_end), v) for m in ok
                if math.isfinite(v := m.accuracy.get(name, math.nan))]
        if within_seed:
            rows = _centred_by_seed(rows)
        xs, ys = [x for _, x, _ in rows], [y for _, _, y in rows]
        if len(rows) >= 3 and len(set(xs)) > 1 and len(set(ys)) > 1:
            out[name] = (statistics.correlation(xs, ys), len(rows))
    return out


def _centred_by_seed(rows: list[tuple]) -> list[tuple]:
    """(seed, x, y) rows with x and y less their seed's means."""
    by_seed: dict = {}
    for seed, x, y in rows:
        by_seed.setdefault(seed, []).append((x, y))
    means = {s: (statistics.fmean(x for x, _ in v), statistics.fmean(y for _, y in v))
             for s, v in by_seed.items()}
    return [(s, x - means[s][0], y - means[s][1]) for s, x, y in rows]


def seed_share(measures: Sequence[Measures], sets: Sequence[str]) -> dict[str, float]:
    """Set -> the share of the trained runs' final-accuracy variance that lies between the
    seeds' means (the between-seed sum of squares over the total): how much a test that
    ignores the seed leaves in its noise. Descriptive, like accuracy_kl_correlation."""
    out = {}
    for key in sets:
        rows = [(m.seed, 0.0, v) for m in trained(measures)  # (seed, -, accuracy)
                if math.isfinite(v := m.accuracy.get(key, math.nan))]
        if len(rows) < 2:
            continue
        mean = statistics.fmean(y for _, _, y in rows)
        total = sum((y - mean) ** 2 for _, _, y in rows)
        if total > 0:
            within = sum(y ** 2 for _, _, y in _centred_by_seed(rows))
            out[key] = 1 - within / total
    return out


def write_csv(measures: Sequence[Measures], path: Path, variants: Sequence[str]) -> Path:
    """One row per run: its finals, curve summaries and breaks (CSV, for rechecking)."""
    sets = [name for name in EVAL_SETS if any(name in m.last_eval for m in measures)]
    head = ["run", "configuration", "seed", "finished", "commit", "accuracy_source",
            *(f"final_{s}" for s in sets), *(f"last_eval_{s}" for s in sets),
            *(f"auc_{s}" for s in sets), "kl_end", "lag_mean", "broken",
            *(variant_column(v) for v in variants), "break_step", "drifted"]
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(head)
        for m in measures:
            out.writerow([m.run, m.configuration, m.seed, m.finished, m.commit, m.source,
                          *(_num(m.accuracy.get(s)) for s in sets),
                          *(_num(m.last_eval.get(s)) for s in sets),
                          *(_num(m.auc.get(s)) for s in sets), _num(m.kl_end), _num(m.lag_mean),
                          m.broken[PRIMARY], *(m.broken[v] for v in variants),
                          "" if m.break_step is None else m.break_step, m.drifted])
    return path


def variant_column(variant: str) -> str:
    """runs.csv's column of a sensitivity variant's breaks."""
    return "broken_" + "".join(c if c.isalnum() else "_" for c in
                               variant.replace("/", "over_")).strip("_").replace("__", "_")


def _num(value: float | None) -> str:
    return "" if value is None or not math.isfinite(value) else f"{value:.6g}"
