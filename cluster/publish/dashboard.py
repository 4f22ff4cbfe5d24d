"""The verdict beside the curves: at the end of `klrl sweep` and of `klrl report` on a directory
of runs, one wandb run in the runs' own project and group (job type `summary`) carrying what
the report wrote, as wandb Tables and charts:

- every table of report.md under its section's name (`findings`: the claims and their
  verdicts; `final_accuracy`: per configuration; `instability_flags`; `runs`), cells as the
  report shows them;
- `configurations`: the per-configuration measures of runs.csv (the mean of each numeric
  column over the configuration's runs, with its run count), and a bar chart of each measure
  by configuration (`charts/<measure>`);
- `figures/<name>`: each PNG the report drew, captioned with its title;
- in the run's summary, how many claims got each verdict (`verdicts/<verdict>`).

It reads only the report's files (report.md, runs.csv, PNGs), so it follows whatever the report
writes, and the runs' config.yaml for where their wandb runs went: the same entity, project,
group and mode (offline by default: `wandb sync DIR/wandb/offline-run-*` uploads it, as it does
the runs). Runs logged with wandb disabled get no summary.
"""
from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from pathlib import Path

from cluster.train.run_log import config_path, has_metrics, read_config

SUMMARY_JOB_TYPE = "summary"
# runs.csv columns that describe a run rather than measure it (never averaged).
_DESCRIPTIVE = {"run", "configuration", "seed", "finished", "commit", "accuracy_source"}
_HEADING = re.compile(r"^#{2,3}\s+(.*)$")
_IMAGE = re.compile(r"!\[([^\]]*)\]\(([^)\s]+\.png)\)")


@dataclass
class Table:
    columns: list[str]
    rows: list[list]


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_") or "table"


def _cell(text: str) -> str:
    return re.sub(r"\*\*|`", "", text.strip()).replace("\\|", "|")


def report_tables(report_md: Path) -> dict[str, Table]:
    """Each markdown table of report.md, keyed by the slug of the heading above it (a second
    table under one heading gets `_2`)."""
    tables: dict[str, Table] = {}
    heading, current = "report", None
    for line in report_md.read_text().splitlines():
        if m := _HEADING.match(line):
            heading, current = slug(m.group(1)), None
            continue
        if not line.startswith("|"):
            current = None
            continue
        cells = [_cell(c) for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if current is None:
            key = heading if heading not in tables else f"{heading}_{len(tables)}"
            current = tables[key] = Table(cells, [])
        elif not all(set(c) <= set("-: ") for c in cells):  # not the |---| line
            current.rows.append(cells + [""] * (len(current.columns) - len(cells)))
    return tables


def report_figures(report_md: Path) -> list[tuple[str, Path]]:
    """(title, PNG path) of each figure report.md shows, in its order."""
    return [(title, report_md.parent / name) for title, name in _IMAGE.findall(
        report_md.read_text()) if (report_md.parent / name).is_file()]


def configuration_measures(runs_csv: Path) -> Table | None:
    """runs.csv's numeric columns averaged over each configuration's runs (blank cells left
    out), with the run count and, where the report has one, how many runs broke."""
    if not runs_csv.is_file():
        return None
    with runs_csv.open(newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or "configuration" not in rows[0]:
        return None
    numeric = [c for c in rows[0] if c not in _DESCRIPTIVE and not c.startswith("broken")
               and any(_number(r[c]) is not None for r in rows)]
    by_config: dict[str, list[dict]] = {}
    for r in rows:
        by_config.setdefault(r["configuration"], []).append(r)
    broken = "broken" in rows[0]
    columns = ["configuration", "runs", *(["broken"] if broken else []), *numeric]
    table = Table(columns, [])
    for label, runs in by_config.items():
        means = []
        for c in numeric:
            values = [v for r in runs if (v := _number(r[c])) is not None]
            means.append(sum(values) / len(values) if values else None)
        table.rows.append([label, len(runs), *([sum(bool(r["broken"]) for r in runs)]
                                               if broken else []), *means])
    return table


def _number(text: str) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def wandb_target(runs_dir: Path) -> dict | None:
    """Where the runs of `runs_dir` (one run, or a directory of them) logged to wandb: entity,
    project, group (default: the directory's name) and mode, from the first run's config.yaml.
    None when they logged nothing (wandb disabled) or there is no run."""
    import os

    runs = [runs_dir] if has_metrics(runs_dir) else sorted(
        p for p in runs_dir.iterdir() if p.is_dir() and config_path(p).is_file())
    if not runs:
        return None
    logging = read_config(runs[0]).get("logging", {})
    mode = logging.get("wandb_mode") or os.environ.get("WANDB_MODE") or "offline"
    if mode == "disabled":
        return None
    return {"entity": logging.get("wandb_entity"), "project": logging.get("wandb_project"),
            "group": logging.get("wandb_group") or runs_dir.resolve().name, "mode": mode}


def log_summary(runs_dir: str | Path, report_md: str | Path) -> Path | None:
    """Log the summary run of `runs_dir` from its report (module docstring). Returns the wandb
    run's directory (an offline run's is what `wandb sync` takes), None when the runs did not
    log to wandb."""
    runs_dir, report_md = Path(runs_dir), Path(report_md)
    target = wandb_target(runs_dir)
    if target is None:
        return None
    import wandb

    tables = report_tables(report_md)
    measures = configuration_measures(report_md.parent / "runs.csv")
    verdicts: dict[str, int] = {}
    for row in tables.get("findings", Table([], [])).rows:
        if len(row) > 3:
            verdicts[row[3]] = verdicts.get(row[3], 0) + 1
    (runs_dir / "wandb").mkdir(exist_ok=True)
    run = wandb.init(entity=target["entity"], project=target["project"], group=target["group"],
                     mode=target["mode"], job_type=SUMMARY_JOB_TYPE,
                     name=f"{target['group']} summary", dir=str(runs_dir),
                     config={"summary_of": target["group"], "report": str(report_md.resolve())})
    try:
        logged: dict = {key: wandb.Table(columns=t.columns, data=t.rows)
                        for key, t in tables.items() if t.rows}
        if measures is not None and measures.rows:
            table = wandb.Table(columns=measures.columns, data=measures.rows)
            logged["configurations"] = table
            for measure in measures.columns[2:]:
                logged[f"charts/{measure}"] = wandb.plot.bar(
                    table, "configuration", measure, title=f"{measure} by configuration")
        for title, png in report_figures(report_md):
            logged[f"figures/{png.stem}"] = wandb.Image(str(png), caption=title)
        run.log(logged)
        run.summary.update({f"verdicts/{v}": n for v, n in verdicts.items()})
        return Path(run.dir).parent
    finally:
        run.finish()
