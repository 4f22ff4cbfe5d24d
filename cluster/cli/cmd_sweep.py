"""`klrl sweep` (a grid of training runs, resumable) and `klrl report` (plots, tables, flags)."""
from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from cluster.config.loader import ConfigError, load_config, merge, validate
from cluster.experiments.launchers import LocalLauncher, RayJobLauncher
from cluster.experiments.report import ReportConfig, write_report
from cluster.experiments.sweep import (
    SET_ASIDE_DIR,
    SweepConfig,
    changed_runs,
    describe_changed,
    expand,
    load_sweep,
    preflight_runs,
    run_state,
    run_sweep,
    set_aside,
    sweep_dir,
    train_command,
    validate_runs,
)


def _run_sweep(args) -> int:
    try:
        cfg = load_sweep(args.sweep, args.overrides)
        runs = expand(cfg)
        configs = validate_runs(cfg, runs)
        if args.address and not Path(cfg.output_dir).is_absolute():
            raise ConfigError(f"output_dir={cfg.output_dir!r}: with --address the runs are "
                              "written on the cluster; give an absolute path on storage shared "
                              "with this machine (e.g. output_dir=/shared/runs)")
        changed = changed_runs(cfg, runs, configs)  # runs recorded with other settings
        if changed and not args.rerun:
            raise ConfigError(describe_changed(cfg, changed))
        rerun = frozenset(r.name for r in changed)
        if args.address:  # each job checks its paths where it runs; its plug-ins here
            from cluster.train.door.commands import check_submission

            for config in configs.values():
                check_submission(config, {})
        else:
            preflight_runs(cfg, runs, configs, rerun)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    root = sweep_dir(cfg)
    if args.dry_run:
        for run in changed:
            print(f"{run.name} ({run.state}; {run.describe()}): would move to "
                  f"{root / SET_ASIDE_DIR}/")
        for run in runs:
            state = "new" if run.name in rerun else run_state(root / run.name)
            print(f"[{run.index}/{len(runs)}] {run.name} ({state}): "
                  + shlex.join(["klrl", *train_command(cfg, run, state)]))  # pastes into a shell
        return 0
    for run, place in zip(changed, set_aside(cfg, changed), strict=True):
        print(f"{run.name} ({run.state}; {run.describe()}): moved to {place}")
    need = max(c.reserved_cpus for c in configs.values())
    if not args.address and cfg.parallel * need > (cores := _cores()):
        print(f"warning: parallel={cfg.parallel} runs reserve {cfg.parallel * need:g} CPUs, this "
              f"machine has {cores}: they will share cores and each will run slower",
              file=sys.stderr)
    launcher = (RayJobLauncher(args.address, args.python) if args.address
                else LocalLauncher(root / "logs"))
    outcomes, signum = run_sweep(cfg, runs, configs, launcher)
    return _summarise(cfg, runs, outcomes, signum, write=not args.no_report)


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _summarise(cfg, runs, outcomes, signum, write: bool) -> int:
    """Print what happened, write the report, and choose the exit status: 128 + signal when
    stopped, 1 when a run failed, else 0."""
    count = {s: sum(o.status == s for o in outcomes)
             for s in ("finished", "skipped", "failed", "stopped")}
    print(f"sweep {cfg.name}: {count['finished']} finished, {count['skipped']} skipped (finished "
          f"before), {count['failed']} failed, {count['stopped']} stopped, "
          f"{len(runs) - len(outcomes)} not started; directory {sweep_dir(cfg)}")
    if write and count["finished"] + count["skipped"] + count["stopped"]:
        try:
            print(f"report: {write_report(sweep_dir(cfg), cfg.report)}")
        except ConfigError as exc:  # e.g. a report.kl_metric no run logged: the runs stand
            print(f"report not written: {exc}; fix it and run `klrl report {sweep_dir(cfg)}`",
                  file=sys.stderr)
    failed = [o for o in outcomes if o.status == "failed"]
    for o in failed:
        print(f"FAILED {o.run.name}: {o.detail}", file=sys.stderr)
    if signum is not None:
        print("stopped; run the same command again to continue (finished runs are skipped, "
              "interrupted ones resume from their last checkpoint)", file=sys.stderr)
        return 128 + signum
    return 1 if failed else 0


def _run_report(args) -> int:
    from cluster.train.door.commands import check_report_dir

    path = Path(args.dir)
    try:
        check_report_dir(path, args.out)  # the door: runs with metrics, --out not a file
        base = {}
        if (path / "sweep.yaml").is_file():  # the sweep's own thresholds, under the overrides
            base = load_config(SweepConfig, path / "sweep.yaml").report.model_dump()
        cfg = validate(ReportConfig, merge(base, args.overrides), source="report options",
                       overrides=args.overrides)
        report = write_report(path, cfg, out=args.out)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"report: {report}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("sweep", help="run a grid of training runs (resumable), then report",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("sweep", help="sweep YAML, e.g. configs/sweeps/offpolicy_tiny.yaml")
    p.add_argument("overrides", nargs="*", help="overrides of the sweep file, e.g. parallel=2 "
                   "output_dir=/shared/runs grid.seed=[0,1,2] overrides.total_steps=50")
    p.add_argument("--address", default=None, help="Ray dashboard address: one Ray job per run "
                   "on that cluster (default: local processes)")
    p.add_argument("--python", default="python", help="with --address: the cluster's Python")
    p.add_argument("--dry-run", action="store_true", help="list the runs, their state and "
                   "commands; run nothing")
    p.add_argument("--no-report", action="store_true", help="do not write the report at the end")
    p.add_argument("--rerun", action="store_true", help="runs in the sweep directory recorded "
                   "with settings other than the sweep's now (refused without this flag): move "
                   "them to SWEEP_DIR/replaced/ and run the grid's again with the new settings")
    p.set_defaults(func=_run_sweep)

    p = subparsers.add_parser("report", help="plots, accuracy table and instability flags of a "
                              "run or a sweep directory")
    p.add_argument("dir", help="a run directory, or a directory of runs (a sweep)")
    p.add_argument("overrides", nargs="*", help="report options, e.g. collapse_fraction=0.3 "
                   "kl_max=50 smooth=1 (default: the sweep's `report:` section)")
    p.add_argument("--out", default=None, metavar="DIR", help="write report.md and its plots "
                   "here (default DIR/report), e.g. docs/sweeps/offpolicy_tiny for the docs")
    p.set_defaults(func=_run_report)
