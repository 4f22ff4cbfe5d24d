"""`klrl report DIR`: findings, plots, a final-accuracy table and instability flags for a run or
a sweep.

DIR is one run directory (it holds metrics.jsonl) or a directory of them (a sweep). Runs are
grouped into configurations by the config keys in which they differ, the seed excepted, so a
configuration's runs are its seeds. The report reads only files (runs.py), so it works on a
sweep that is still running. It writes DIR/report/report.md, runs.csv (report_findings.py) and
one PNG per question beside them (report_plots.py). The instability flags are runs.py's, with
the thresholds of `ReportConfig`; the findings' failure definition is the pre-registration's
(prereg.FailureRule).
"""
from __future__ import annotations

import difflib
import time
from pathlib import Path
from typing import Literal

from pydantic import Field

from cluster.config.loader import ConfigError
from cluster.analysis.arms import Study
from cluster.analysis.dose_plot import DOSE_RESPONSE, plot_dose_response
from cluster.analysis.labels import SET_LABELS, configuration_keys
from cluster.analysis.measures import Measures, accuracy_kl_correlation
from cluster.analysis.prereg import Comparison
from cluster.analysis.report_findings import findings_section, mean_sd, provenance_lines
from cluster.analysis.report_plots import (
    ACCURACY_AGAINST_KL,
    FIGURES,
    pass_at_k_figure,
    plot_accuracy_against_kl,
    plot_figure,
    report_window,
)
from cluster.analysis.runs import (  # noqa: F401 (re-exported: the report's readers)
    ACCURACY_KEYS,
    Flag,
    InstabilityRule,
    RunData,
    accuracy_collapse,
    find_runs,
    group_runs,
    instability_flags,
    kl_blowup,
    load_run,
    faults_text,
    nonfinite_steps,
)


class ReportConfig(InstabilityRule):
    """Instability thresholds, plot options and the pre-registration of `klrl report` (a sweep
    file's `report:`)."""

    x_axis: Literal["step", "policy_version"] = Field(
        "step", description="x axis of the per-step training curves: the training step, or "
        "the policy version that sampled each step's batch (rollout/policy_version), which "
        "lines up runs at different max_lag on the data they trained on. Evaluations are "
        "always placed at the step (the version of the weights evaluated).")
    figures: bool = Field(
        True, description="Draw the plots (PNGs beside report.md, shown in its Plots section). "
        "false: report.md and runs.csv only, tables, flags and findings unchanged; drawing "
        "is most of a report's time, so this is the quick look at a sweep while it runs.")
    comparisons: list[Comparison] = Field(
        default_factory=list, max_length=50, description="Your own questions: configuration A "
        "against B on one measure, in a direction, each tested paired by seed with Holm's "
        "correction across them (docs/sweeps.md, Your comparisons). Empty: the report shows "
        "the effect and interval of each pair of configurations that differ in one key.")
    preregistration: str | None = Field(
        None, min_length=1, description="Pre-registration (YAML, docs/sweeps/preregistration."
        "yaml) whose claims, rules and seeds the findings follow, relative to the repository "
        "root or absolute; the report quotes it with the commit that last changed its rules, "
        "seeds or this sweep's claims. null: "
        "exploratory findings, with the same rules and the claims at every beta the "
        "directory ran.")


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


# ---- report.md --------------------------------------------------------------------------------


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
        cells = [mean_sd([v for r in runs if (v := _final(r, k)) is not None]) for k, _ in keys]
        n_flagged = sum(r.name in flagged for r in runs)
        lines.append("| " + " | ".join([f"`{label}`", count, "/".join(map(str, steps)), *cells,
                                        f"{n_flagged}/{len(runs)}"]) + " |")
    return lines


def gather_runs(paths: list[Path]) -> list[RunData]:
    """The runs of every path (a run directory or a directory of runs), each once. Runs of
    the same name from different directories are named by their parent too (`sweepA/r1`), so
    the report's tables and flags tell them apart."""
    runs, seen = [], set()
    for path in paths:
        found = find_runs(path)
        if not found:
            raise FileNotFoundError(f"{path}: no run directory (with metrics.jsonl) here or "
                                    "directly inside")
        for run in found:
            if run.dir.resolve() not in seen:
                seen.add(run.dir.resolve())
                runs.append(run)
    names = [r.name for r in runs]
    for run in runs:
        if names.count(run.name) > 1:
            run.name = f"{run.dir.resolve().parent.name}/{run.name}"
    return runs


def comparison_dir(paths: list[Path]) -> Path:
    """Where `klrl report A B ...` writes by default: report-A-vs-B (the directories' names)
    in the directory that holds them all."""
    resolved = [p.resolve() for p in paths]
    parent = Path(*Path(resolved[0]).parts[:len(_common_parts(resolved))])
    names = "-vs-".join(p.name for p in resolved)
    if len(names) > 80:
        names = f"{resolved[0].name}-and-{len(resolved) - 1}-more"
    return parent / f"report-{names}"


def _common_parts(paths: list[Path]) -> tuple[str, ...]:
    common = paths[0].parent.parts
    for path in paths[1:]:
        parts = path.parent.parts
        n = 0
        while n < min(len(common), len(parts)) and common[n] == parts[n]:
            n += 1
        common = common[:n]
    return common


def report_dir(paths: list[Path], out: str | Path | None) -> Path:
    """Where a report of `paths` goes: `out`, else PATH/report for one directory, else
    comparison_dir (the one rule write_report and `klrl report`'s door both follow)."""
    if out is not None:
        return Path(out)
    return paths[0] / "report" if len(paths) == 1 else comparison_dir(paths)


def write_report(path: str | Path | list[str | Path], cfg: ReportConfig | None = None,
                 out: str | Path | None = None) -> Path:
    """Write report.md, runs.csv and the plots into `out` (default PATH/report; for several
    paths, compared: comparison_dir); returns report.md's path. PATH: a run directory or a
    directory of runs (a sweep), or a list of them."""
    cfg = cfg or ReportConfig()
    paths = [Path(p) for p in path] if isinstance(path, list | tuple) else [Path(path)]
    runs = gather_runs(paths)
    path = paths[0] if len(paths) == 1 else Path(out or comparison_dir(paths))
    check_kl_metric(runs, cfg)
    groups = group_runs(runs)
    flags = [f for r in runs for f in instability_flags(r, cfg)]
    out = report_dir(paths, out)
    out.mkdir(parents=True, exist_ok=True)
    findings_md, measures, quote = findings_section(path, runs, groups, cfg, out)
    figures = _draw_figures(groups, runs, measures, cfg, out) if cfg.figures else []
    keys = configuration_keys(runs)
    seeds = sorted({str(r.config.get("seed")) for r in runs})
    title = (path.resolve().name if len(paths) == 1
             else " vs ".join(p.resolve().name for p in paths))
    md = [f"# Report: {title}", "",
          f"{len(runs)} run(s), {sum(r.finished for r in runs)} finished, in {len(groups)} "
          f"configuration(s)"
          + (f" labelled by {', '.join(f'`{k}`' for k in keys)}" if keys else "")
          + (f", from {', '.join(f'`{p}`' for p in paths)}" if len(paths) > 1 else "")
          + f"; seeds {', '.join(seeds)}. Written {time.strftime('%Y-%m-%d %H:%M')} by "
          "`klrl report`.",
          "", *provenance_lines(runs), "", *findings_md, "## Final accuracy", "",
          ("Accuracy at each run's last evaluation during training (greedy pass@1; *sampled*: "
           "temperature 1), mean ± sample std over the configuration's runs (seeds)."), "",
          *accuracy_table(groups, flags), ""]
    start = [(label, mean_sd([v for r in runs
                                if (v := (r.series(k)[1] or [None])[0]) is not None]))
             for k, label in ACCURACY_KEYS if any(k in r.rows.get(0, {}) for r in runs)]
    if start:
        md += ["Before training (step 0): "
               + ", ".join(f"{label} {v}" for label, v in start) + ".", ""]
    md += ["## Instability flags", ""]
    if flags:
        md += ["| run | flag | step | detail |", "|---|---|---|---|"]
        md += [f"| `{f.run}` | {f.kind} | {f.step} | {f.detail} |" for f in flags]
    else:
        md += [f"No run was flagged ({len(runs)} checked)."]
    md += ["", _flag_definitions(cfg), "", *faults_section(measures), "## Plots", ""]
    if cfg.figures:
        md += ["Lines: mean over a configuration's runs (seeds); band (shaded, hatched in the "
               "configuration's own pattern): min to max over them. "
               + (f"Per-step curves are centred moving averages over {window} steps, drawn "
                  "over the raw values (faint)." if (window := report_window(runs, cfg.smooth))
                  > 1 else "Per-step curves are the raw values (no moving average)."), ""]
        md += [f"### {fig.title}\n\n{fig.caption}\n\n![{fig.title}]({name})\n"
               + (_correlation_text(measures) if fig is ACCURACY_AGAINST_KL else "")
               for fig, name in figures]
    else:  # the correlation is told under its figure, and told here without it
        md += ["Not drawn (`figures=false`).", _correlation_text(measures)]
    md += ["## Runs", "", "| run | configuration | seed | last step | status |",
           "|---|---|---|---|---|"]
    md += [f"| `{r.name}` | `{label}` | {r.config.get('seed', '-')} | {r.last_step} | "
           f"{'finished' if r.finished else 'unfinished'} |"
           for label, g in groups.items() for r in g]
    md += ["", *quote]
    report = out / "report.md"
    report.write_text("\n".join(md).rstrip("\n") + "\n")
    return report


def _draw_figures(groups, runs, measures, cfg: ReportConfig, out: Path) -> list[tuple]:
    """Each figure drawn into `out` with the file name it was saved as, in the report's order
    (a figure with nothing to draw is left out)."""
    figures = [(fig, name) for fig in (*FIGURES, pass_at_k_figure(runs))
               if (name := plot_figure(fig, groups, runs, cfg, out))]
    if name := plot_accuracy_against_kl(measures, groups, out):
        figures.append((ACCURACY_AGAINST_KL, name))
    if name := plot_dose_response(Study.of(measures), out):
        figures.append((DOSE_RESPONSE, name))
    return figures


def faults_section(measures: list[Measures]) -> list[str]:
    """Every run that lost and healed something (a learner restart and the steps it redid, a
    replaced worker, reissued samples, scoring-pool errors): its results count, and a reader
    weighs them knowing it."""
    hit = [(m.run, m.faults) for m in measures if m.faults]  # measures.measure read them
    if not hit:
        return ["## Faults", "", f"No run had a fault ({len(measures)} checked: learner restarts, "
                "redone steps, worker replacements, reissued samples, scoring-pool errors).", ""]
    return ["## Faults", "", "Runs that lost something and healed (their results are in every "
            "table above; the comparisons name them):", "", "| run | faults |", "|---|---|",
            *(f"| `{run}` | {faults_text(f)} |" for run, f in hit), ""]


def _correlation_text(measures) -> str:
    found = accuracy_kl_correlation(measures)
    if not found:
        return ""
    n = max(runs for _, runs in found.values())
    return (f"\nAmong the {n} finished runs that did not break, the correlation (Pearson r) of "
            "the final accuracy with log KL at the end: "
            + ", ".join(f"{SET_LABELS[k]} {r:+.2f}" for k, (r, _) in found.items())
            + ". Descriptive, tested by no claim: a positive r out-of-domain means that "
            "runs scored higher there the further they moved from the reference.\n")


def _flag_definitions(cfg: ReportConfig) -> str:
    """The legend of the flags table: every kind `runs.instability_flags` reports, with this
    report's thresholds."""
    kl_max = f", or above kl_max = {cfg.kl_max:g}" if cfg.kl_max is not None else ""
    return (f"Flags: *accuracy collapse*: an eval accuracy falls below {cfg.collapse_fraction:g} x "
            f"its best earlier value (when that best is at least {cfg.collapse_min_peak:g}) and "
            f"stays below until the end, over at least {cfg.collapse_min_evals} evaluation(s); "
            f"*reward collapse*: the mean of `{cfg.reward_metric}` over {cfg.smooth} steps falls "
            f"below {cfg.collapse_fraction:g} x its best earlier value and stays below to the "
            f"end; *gradient-norm blow-up*: the median of `{cfg.grad_metric}` over {cfg.smooth} "
            f"steps exceeds {cfg.grad_growth:g} x its early level (median of the first "
            f"{cfg.kl_early_fraction:.0%} of steps); "
            "*non-finite*: a step the learner refused (NaN/inf gradient) or a logged NaN/inf; "
            f"*KL blow-up*: the median of `{cfg.kl_metric}` over "
            f"{cfg.smooth} steps exceeds {cfg.kl_growth:g} x its early level (median of the "
            f"first {cfg.kl_early_fraction:.0%} of steps, at least {cfg.kl_floor:g}){kl_max}. "
            "A KL blow-up is a distance, not an instability: a run can move that far from the "
            "reference with its accuracy, reward and gradients sound (findings count it as "
            "*drifted*, and as broken only where the failure definition lists it).")
