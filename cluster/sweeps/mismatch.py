"""The learner/sampler mismatch of each configuration of a sweep, from its runs' metrics: what
`configs/sweeps/stale_kv_tiny.yaml` measures (issue 36: a prefix cache kept from the old
weights against one recomputed after each in-flight update).

    python -m cluster.cli.mismatch configs/sweeps/stale_kv_tiny.yaml [key=value ...]

runs the sweep's missing runs (`klrl sweep ... --no-report`), then prints one row per
configuration and writes the table to docs/sweeps/<name>/mismatch.md (or --out). Per run,
over its training steps: the mean |log pi - log mu| over the tokens sampled by the weights
being trained (`is/abs_log_ratio_fresh_token_mean` of the batch's first update, weighted by
`is/fresh_tokens`: no policy drift in it, so it is the numerics mismatch plus, with
`stale_kv: keep`, what the kept cache changed), the same over every token (drift included),
the share of tokens that are fresh, the mean token lag and the share of samples spanning
several versions. Across a configuration's runs (its seeds): the mean, and the spread as
min-max.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from cluster.config.loader import REPO_ROOT, ConfigError
from cluster.analysis.report_findings import provenance_lines
from cluster.analysis.runs import RunData, find_runs, group_runs
from cluster.sweeps.sweep import load_sweep, sweep_dir

FRESH = "is/abs_log_ratio_fresh_token_mean"
COLUMNS = (  # (heading, per-run figure)
    ("fresh-token mismatch", "fresh"),
    ("all-token mismatch", "all"),
    ("fresh share", "fresh_share"),
    ("token lag", "token_lag"),
    ("multi-version share", "multi_version"),
)


def run_figures(run: RunData) -> dict[str, float | None]:
    """One run's figures over its training steps (module docstring); None where no step had
    the metric (a fresh-token mismatch needs at least one fresh token)."""
    # training rows (evaluation-only rows have no response tokens); runs from before the
    # fresh-token metric have the other figures
    steps = [row for step, row in sorted(run.rows.items()) if step > 0
             and "response/tokens" in row]
    fresh_rows = [row for row in steps if FRESH in row]
    fresh_w = [row.get("is/fresh_tokens", 0.0) for row in fresh_rows]
    # With several updates per batch the plain key merges them all: update 0 is the batch as
    # sampled, before the learner moved.
    fresh_v = [row.get("update_0/" + FRESH, row[FRESH]) for row in fresh_rows]
    tokens = sum(row.get("response/tokens", 0.0) for row in steps)

    def mean(key: str) -> float | None:
        vals = [row[key] for row in steps if key in row]
        return sum(vals) / len(vals) if vals else None

    return {
        "fresh": (sum(v * w for v, w in zip(fresh_v, fresh_w)) / sum(fresh_w)
                  if sum(fresh_w) else None),
        "all": mean("is/abs_log_ratio_token_mean"),
        "fresh_share": (sum(fresh_w) / tokens if tokens and fresh_rows else None),
        "token_lag": mean("lag/token_mean"),
        "multi_version": mean("lag/multi_version_share"),
    }


def _cell(values: list[float | None]) -> str:
    vals = [v for v in values if v is not None]
    if not vals:
        return "-"
    mean = sum(vals) / len(vals)
    if len(vals) == 1:
        return f"{mean:.3g}"
    return f"{mean:.3g} ({min(vals):.3g}-{max(vals):.3g})"


def mismatch_table(runs: list[RunData]) -> str:
    """Markdown: one row per configuration (runs grouped by what differs between them)."""
    head = "| configuration | runs | " + " | ".join(h for h, _ in COLUMNS) + " |"
    lines = [head, "|---|---:|" + "---:|" * len(COLUMNS)]
    for label, group in group_runs(runs).items():
        figures = [run_figures(r) for r in group]
        cells = [_cell([f[key] for f in figures]) for _, key in COLUMNS]
        lines.append(f"| {label} | {len(group)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def mismatch_page(name: str, command: str, runs: list[RunData]) -> str:
    """mismatch.md: the command that wrote it, where the runs ran (the sweep report's
    provenance lines) and the table."""
    return "\n".join([
        f"# {name}: the learner/sampler mismatch", "",
        f"Written by `{command}` from {len(runs)} finished runs; what each column is: the "
        "module's docstring (cluster/sweeps/mismatch.py).", "",
        *provenance_lines(runs), "", mismatch_table(runs)])


COMMAND = "python -m cluster.cli.mismatch"  # its command line (cluster/cli/mismatch.py)


def write_mismatch(sweep_file: str, overrides: list[str], out: Path | None = None,
                   run: bool = True) -> int:
    """The module docstring's command: the sweep's missing runs run (unless not `run`), the
    table printed and written to `out`/mismatch.md (default docs/sweeps/<sweep name>); returns
    the exit status (2: the sweep file refused, 1: a run failed or none finished)."""
    try:
        cfg = load_sweep(sweep_file, overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    status = 0
    if run:
        status = subprocess.call([sys.executable, "-m", "cluster.cli", "sweep", sweep_file,
                                  *overrides, "--no-report"])
        if status not in (0, 1):
            return status
    runs = [r for r in find_runs(sweep_dir(cfg)) if r.finished]
    if not runs:
        print(f"no finished run in {sweep_dir(cfg)}", file=sys.stderr)
        return 1
    command = " ".join([COMMAND, sweep_file, *overrides])
    page = mismatch_page(cfg.name, command, runs)
    print(page)
    out = out if out is not None else REPO_ROOT / "docs" / "sweeps" / cfg.name
    out.mkdir(parents=True, exist_ok=True)
    (out / "mismatch.md").write_text(page)
    return status
