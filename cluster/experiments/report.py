"""`klrl report DIR`: plots, a final-accuracy table and instability flags for a run or a sweep.

DIR is one run directory (it holds metrics.jsonl) or a directory of them (a sweep). Runs are
grouped into configurations by the config keys in which they differ, the seed excepted, so a
configuration's runs are its seeds. The report reads only files (config.yaml, metrics.jsonl,
final/), so it works on a sweep that is still running. It writes DIR/report/report.md and one
PNG per question beside it (report_plots.py).

Instability flags (per run; thresholds are ReportConfig fields, documented in docs/sweeps.md):
- accuracy collapse: an eval accuracy falls below `collapse_fraction` x its best earlier value
  (once that best is at least `collapse_min_peak`) and stays below at every later evaluation,
  at least `collapse_min_evals` evaluations in all.
- KL blow-up: the KL metric's trailing median over `smooth` steps exceeds `kl_growth` x its
  early level (median of the first `kl_early_fraction` of steps, at least `kl_floor`), or
  exceeds `kl_max` when set.
- non-finite: a step the learner refused (NaN/inf gradient) or any logged NaN/inf value.
"""
from __future__ import annotations

import difflib
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from cluster.config.loader import ConfigError
from cluster.experiments import findings as findings_module
from cluster.experiments.labels import SET_LABELS, configuration_keys, flatten, value_token
from cluster.experiments.report_plots import FIGURES, plot_figure
from cluster.train.run_log import (
    has_metrics,
    is_finished,
    read_config,
    read_metrics,
    read_provenance,
)
from rewards.config import EVAL_SETS

# (metric, label): greedy pass@1 first, then sampled accuracy (temperature 1).
ACCURACY_KEYS = [(f"eval/{name}/{key}", SET_LABELS[name] + suffix)
                 for key, suffix in (("accuracy", ""), ("sampled_accuracy", " sampled"))
                 for name in EVAL_SETS]


class ReportConfig(BaseModel):
    """Instability thresholds and plot smoothing of `klrl report` (a sweep file's `report:`)."""

    model_config = ConfigDict(extra="forbid")

    collapse_fraction: float = Field(0.5, gt=0, lt=1, description="Accuracy collapse: an eval "
                                     "accuracy below this fraction of its best earlier value "
                                     "that stays below it until the end of the run.")
    collapse_min_peak: float = Field(0.05, ge=0, le=1, description="An accuracy collapse counts "
                                     "only once the best earlier accuracy reached this (falls "
                                     "from near zero are noise).")
    collapse_min_evals: int = Field(2, ge=1, le=1000, description="An accuracy collapse counts "
                                    "only when at least this many evaluations (the first low "
                                    "one included) are below the level: a single low final "
                                    "evaluation is as likely noise (100 problems: +/-0.03) as a "
                                    "collapse.")
    kl_metric: str = Field("kl/pi_ref", min_length=1, description="KL metric watched for "
                           "blow-ups: the batch's importance-corrected per-sequence K1 estimate "
                           "of KL(pi||ref) (the K3 estimate's exp(-delta) has a heavy tail: in "
                           "stable runs single batches spike to 5-10x its usual value).")
    kl_growth: float = Field(20.0, gt=1, le=1e9, description="KL blow-up: the smoothed KL "
                             "exceeds this factor times its early level.")
    kl_floor: float = Field(0.05, gt=0, le=1e6, description="The early level is at least this "
                            "(nats per sequence): the KL starts at 0 (policy == reference), and "
                            "growing from 0 is what training does.")
    kl_early_fraction: float = Field(0.1, gt=0, le=1, description="The early level is the median "
                                     "KL over this fraction of the run's first steps (at least "
                                     "`smooth` steps).")
    kl_max: float | None = Field(None, gt=0, le=1e9, description="KL blow-up also when the "
                                 "smoothed KL exceeds this (nats per sequence); null: no "
                                 "absolute limit.")
    x_axis: Literal["step", "policy_version"] = Field(
        "step", description="x axis of the per-step training curves: the training step, or "
        "the policy version that sampled each step's batch (rollout/policy_version), which "
        "lines up runs at different max_lag on the data they trained on. Evaluations are "
        "always placed at the step (the version of the weights evaluated).")
    smooth: int = Field(5, ge=1, le=10_000, description="Window in steps: trailing median of "
                        "the KL test, and moving average of the per-step curves in the plots "
                        "(1: raw values; at most a fifth of a run's steps in the plots).")


@dataclass
class RunData:
    """One run directory as the report sees it."""

    name: str
    dir: Path
    config: dict[str, Any]    # the resolved TrainConfig, flattened to dotted keys
    rows: dict[int, dict]     # step -> metrics; a step logged twice (replayed after a resume)
                              # keeps the later row
    finished: bool            # final/config.json exists

    def series(self, key: str, x: str = "step") -> tuple[list[float], list[float]]:
        """Where `key` was logged and its values (NaN for a non-finite value). x "step": the
        training step; "policy_version": the version of the weights that sampled the step's
        batch (`rollout/policy_version`; the step itself for rows without one, such as the
        step-0 evaluation), so that runs at different lags line up on the data they used."""
        def where(step: int, row: dict) -> float:
            return row.get("rollout/policy_version", step) if x == "policy_version" else step

        pts = [(where(s, row), _number(row[key])) for s, row in sorted(self.rows.items())
               if key in row]
        pts = [(s, v) for s, v in pts if v is not None]
        return [s for s, _ in pts], [v for _, v in pts]

    @property
    def last_step(self) -> int:
        return max(self.rows, default=0)


@dataclass(frozen=True)
class Flag:
    """One instability of one run, at the step where it was detected."""

    run: str
    kind: str      # "accuracy collapse", "KL blow-up", "non-finite"
    step: int
    detail: str


def _number(value: Any) -> float | None:
    """A metric value as a float: run_log writes NaN/inf as the strings 'nan'/'inf'."""
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def load_run(run_dir: Path) -> RunData:
    rows: dict[int, dict] = {}
    for row in read_metrics(run_dir):
        rows[row["step"]] = rows.get(row["step"], {}) | row
    return RunData(run_dir.name, run_dir, flatten(read_config(run_dir)), rows, is_finished(run_dir))


def find_runs(path: Path) -> list[RunData]:
    """DIR itself when it is a run directory, else the run directories directly inside it."""
    path = Path(path)
    if has_metrics(path):
        return [load_run(path)]
    return [load_run(p) for p in sorted(path.iterdir()) if has_metrics(p)]


def group_runs(runs: list[RunData]) -> dict[str, list[RunData]]:
    """Configuration label (e.g. `k1-reward-lag2`) -> its runs (runs without a config.yaml:
    their directory's name for a single run, else `all runs`)."""
    keys = configuration_keys(runs)
    groups: dict[str, list[RunData]] = {}
    for run in runs:
        label = "-".join(value_token(k, run.config.get(k)) for k in keys)
        groups.setdefault(label or (run.name if len(runs) == 1 else "all runs"), []).append(run)
    return dict(sorted(groups.items()))


# ---- instability flags ----------------------------------------------------------------------


def accuracy_collapse(steps: list[int], values: list[float], cfg: ReportConfig) -> tuple[int, str] | None:
    """First eval step j with acc_j < fraction x max(acc_<j) (max >= min_peak) such that every
    later eval stays below that level too and at least `collapse_min_evals` evals (j
    included) are below it; (step, explanation) or None."""
    for j in range(1, len(values) - cfg.collapse_min_evals + 1):
        earlier = [v for v in values[:j] if math.isfinite(v)]
        if not earlier:
            continue
        best = max(earlier)
        level = cfg.collapse_fraction * best
        if best >= cfg.collapse_min_peak and all(v < level for v in values[j:] if math.isfinite(v)) \
                and math.isfinite(values[j]):
            best_step = steps[values.index(best)]
            return steps[j], (f"{values[j]:.3f} < {cfg.collapse_fraction:g} x best {best:.3f} "
                              f"(step {best_step}), below at every later evaluation (last {values[-1]:.3f})")
    return None


def kl_blowup(steps: list[int], values: list[float], cfg: ReportConfig) -> tuple[int, str] | None:
    """First step where the trailing median KL exceeds kl_growth x the early level (or kl_max)."""
    finite = [(s, v) for s, v in zip(steps, values) if math.isfinite(v) and s > 0]
    if not finite:
        return None
    kl = [v for _, v in finite]
    early_n = max(cfg.smooth, math.ceil(cfg.kl_early_fraction * len(kl)))
    early = max(statistics.median(kl[:early_n]), cfg.kl_floor)
    for i, (step, _) in enumerate(finite):
        smoothed = statistics.median(kl[max(0, i + 1 - cfg.smooth):i + 1])
        if smoothed > cfg.kl_growth * early:
            return step, (f"{cfg.kl_metric} median of {cfg.smooth} steps {smoothed:.3g} > "
                          f"{cfg.kl_growth:g} x early level {early:.3g}")
        if cfg.kl_max is not None and smoothed > cfg.kl_max:
            return step, (f"{cfg.kl_metric} median of {cfg.smooth} steps {smoothed:.3g} > "
                          f"kl_max {cfg.kl_max:g}")
    return None


def nonfinite_steps(run: RunData) -> tuple[int, str] | None:
    """First step the learner refused (`nonfinite` = 1) or that logged a NaN/inf value."""
    bad = {}
    for step, row in sorted(run.rows.items()):
        keys = [k for k, v in row.items() if (n := _number(v)) is not None and not math.isfinite(n)]
        if row.get("nonfinite"):
            keys.insert(0, "refused step")
        if keys:
            bad[step] = keys
    if not bad:
        return None
    first = min(bad)
    return first, f"{len(bad)} step(s); first: {', '.join(bad[first][:4])}"


def check_kl_metric(runs: list[RunData], cfg: ReportConfig) -> None:
    """ConfigError listing the KL metrics the runs logged when none of them logged
    `kl_metric` (a typo would otherwise silently flag no blow-up). Runs that have not trained
    a step yet (a sweep just started) say nothing either way."""
    rows = [row for r in runs for step, row in r.rows.items() if step > 0]
    if not rows or any(cfg.kl_metric in row for row in rows):
        return
    logged = sorted({k for row in rows for k in row if k.startswith("kl/")})
    close = difflib.get_close_matches(cfg.kl_metric, logged, n=1)
    raise ConfigError(f"kl_metric={cfg.kl_metric!r}: no run logged it"
                      + (f" (did you mean {close[0]!r}?)" if close else "")
                      + f"; the KL metrics logged are {', '.join(logged) or 'none'}")


def instability_flags(run: RunData, cfg: ReportConfig) -> list[Flag]:
    flags = []
    for key, label in ACCURACY_KEYS:
        if hit := accuracy_collapse(*run.series(key), cfg):
            flags.append(Flag(run.name, f"accuracy collapse ({label})", *hit))
    if hit := kl_blowup(*run.series(cfg.kl_metric), cfg):
        flags.append(Flag(run.name, "KL blow-up", *hit))
    if hit := nonfinite_steps(run):
        flags.append(Flag(run.name, "non-finite", *hit))
    return flags


# ---- report.md --------------------------------------------------------------------------------


def _mean_std(values: list[float]) -> str:
    values = [v for v in values if math.isfinite(v)]
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def _final(run: RunData, key: str) -> float | None:
    _, values = run.series(key)
    return values[-1] if values else None


def accuracy_table(groups: dict[str, list[RunData]], flags: list[Flag]) -> list[str]:
    """Markdown rows: final accuracy per configuration, mean ± std over its runs."""
    keys = [(k, label) for k, label in ACCURACY_KEYS if any(k in row for g in groups.values()
                                                           for r in g for row in r.rows.values())]
    flagged = {f.run for f in flags}
    head = ["configuration", "runs", "last step", *(label for _, label in keys), "flagged runs"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, runs in groups.items():
        unfinished = sum(not r.finished for r in runs)
        count = f"{len(runs)}" + (f" ({unfinished} unfinished)" if unfinished else "")
        steps = sorted({r.last_step for r in runs})
        cells = [_mean_std([v for r in runs if (v := _final(r, k)) is not None]) for k, _ in keys]
        n_flagged = sum(r.name in flagged for r in runs)
        lines.append("| " + " | ".join([f"`{label}`", count, "/".join(map(str, steps)), *cells,
                                        f"{n_flagged}/{len(runs)}"]) + " |")
    return lines


def write_report(path: str | Path, cfg: ReportConfig | None = None,
                 out: str | Path | None = None) -> Path:
    """Write report.md and its plots into `out` (default PATH/report); returns report.md's path."""
    cfg = cfg or ReportConfig()
    path = Path(path)
    runs = find_runs(path)
    if not runs:
        raise FileNotFoundError(f"{path}: no run directory (with metrics.jsonl) here or directly inside")
    check_kl_metric(runs, cfg)
    groups = group_runs(runs)
    flags = [f for r in runs for f in instability_flags(r, cfg)]
    out = Path(out) if out is not None else path / "report"
    out.mkdir(parents=True, exist_ok=True)
    figures = [(fig, name) for fig in FIGURES if (name := plot_figure(fig, groups, runs, cfg, out))]
    keys = configuration_keys(runs)
    seeds = sorted({str(r.config.get("seed")) for r in runs})
    md = [f"# Report: {path.resolve().name}", "",
          f"{len(runs)} run(s), {sum(r.finished for r in runs)} finished, in {len(groups)} "
          f"configuration(s)" + (f" labelled by {', '.join(f'`{k}`' for k in keys)}" if keys else "")
          + f"; seeds {', '.join(seeds)}. Written {time.strftime('%Y-%m-%d %H:%M')} by `klrl report`.",
          "", *provenance_lines(runs), "", "## Findings", "",
          ("Each claim tested on this directory's finished runs (rules: docs/sweeps.md, "
           f"Findings). A difference counts when it exceeds {findings_module.Z:g} standard "
           "errors of the difference; with 3 seeds that is a rough test."), "",
          *findings_module.findings_markdown(findings_module.findings(runs, flags)),
          "", "## Final accuracy", "",
          ("Accuracy at each run's last evaluation (greedy pass@1; *sampled*: temperature 1), "
           "mean ± sample std over the configuration's runs (seeds)."), "",
          *accuracy_table(groups, flags), ""]
    start = [(label, _mean_std([v for r in runs if (v := (r.series(k)[1] or [None])[0]) is not None]))
             for k, label in ACCURACY_KEYS if any(k in r.rows.get(0, {}) for r in runs)]
    if start:
        md += ["Before training (step 0): " + ", ".join(f"{label} {v}" for label, v in start) + ".", ""]
    md += ["## Instability flags", ""]
    if flags:
        md += ["| run | flag | step | detail |", "|---|---|---|---|"]
        md += [f"| `{f.run}` | {f.kind} | {f.step} | {f.detail} |" for f in flags]
    else:
        md += [f"No run was flagged ({len(runs)} checked)."]
    md += ["", _flag_definitions(cfg), "", "## Plots", "",
           "Lines: mean over a configuration's runs (seeds); shaded: min to max over them. "
           + (f"Per-step curves are moving averages over {cfg.smooth} steps." if cfg.smooth > 1 else ""), ""]
    md += [f"### {fig.title}\n\n{fig.caption}\n\n![{fig.title}]({name})\n" for fig, name in figures]
    md += ["## Runs", "", "| run | configuration | seed | last step | status |", "|---|---|---|---|---|"]
    md += [f"| `{r.name}` | `{label}` | {r.config.get('seed', '-')} | {r.last_step} | "
           f"{'finished' if r.finished else 'unfinished'} |" for label, g in groups.items() for r in g]
    report = out / "report.md"
    report.write_text("\n".join(md) + "\n")
    return report


def provenance_lines(runs: list[RunData]) -> list[str]:
    """Which code, machine and dates produced the runs (their provenance.jsonl)."""
    starts = [row for r in runs for row in read_provenance(r.dir)]
    if not starts:
        return []
    commits = sorted({(row.get("git_commit") or "unknown")[:12] + ("+modified" if row.get("git_dirty") else "")
                      for row in starts})
    machines = sorted({row.get("machine", "not recorded") for row in starts})
    dates = sorted(row["started_at"][:10] for row in starts if row.get("started_at"))
    when = dates[0] if dates[0] == dates[-1] else f"{dates[0]} to {dates[-1]}"
    return [(f"Runs started {when}; klrl commit(s) {', '.join(commits)}; machine(s): "
             f"{'; '.join(machines)}.")]


def _flag_definitions(cfg: ReportConfig) -> str:
    kl_max = f", or above kl_max = {cfg.kl_max:g}" if cfg.kl_max is not None else ""
    return (f"Flags: *accuracy collapse*: an eval accuracy falls below {cfg.collapse_fraction:g} x "
            f"its best earlier value (when that best is at least {cfg.collapse_min_peak:g}) and "
            f"stays below until the end, over at least {cfg.collapse_min_evals} evaluation(s); *KL blow-up*: the median of `{cfg.kl_metric}` over "
            f"{cfg.smooth} steps exceeds {cfg.kl_growth:g} x its early level (median of the "
            f"first {cfg.kl_early_fraction:.0%} of steps, at least {cfg.kl_floor:g}){kl_max}; "
            "*non-finite*: a step the learner refused (NaN/inf gradient) or a logged NaN/inf.")
