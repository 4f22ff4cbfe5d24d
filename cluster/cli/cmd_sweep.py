"""`klrl sweep` (a grid of training runs, resumable) and `klrl report` (plots, tables, flags)."""
from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

import yaml

from cluster.config.loader import ConfigError, load_config, merge, validate
from cluster.cli.arg_types import whole_in
from cluster.cli.cmd_train import count_arg
from cluster.analysis.prereg import Comparison
from cluster.analysis.report import ReportConfig, report_dir, write_report
from cluster.sweeps.sweep import (
    SET_ASIDE_DIR,
    SweepConfig,
    changed_runs,
    describe_changed,
    expand,
    load_sweep,
    preflight_runs,
    set_aside,
    sweep_dir,
    train_command,
    validate_runs,
)
from cluster.sweeps.sweep_run import run_sweep
from cluster.train.continuation import Action, Continuation, RunState, continuation
from cluster.launchers.base import SubmitError
from cluster.launchers.ray_jobs import check_reachable, dashboard_url
from cluster.launchers.registry import launcher as make_launcher


def _run_sweep(args) -> int:
    try:
        cfg = load_sweep(args.sweep, args.overrides)
        runs = expand(cfg)
        configs = validate_runs(cfg, runs)
        if args.max_resubmits and not args.address:
            raise ConfigError("--max-resubmits resubmits Ray jobs: it needs --address (a local "
                              "sweep's runs are its own processes; run the sweep again to "
                              "resume them)")
        if args.address and not Path(cfg.output_dir).is_absolute():
            raise ConfigError(f"output_dir={cfg.output_dir!r}: with --address the runs are "
                              "written on the cluster; give an absolute path on storage shared "
                              "with this machine (e.g. output_dir=/shared/runs)")
        if unknown := sorted(set(args.leave_out) - {r.name for r in runs}):
            raise ConfigError(f"--leave-out {', '.join(unknown)}: no run of sweep {cfg.name} "
                              f"has that name; its runs: {', '.join(r.name for r in runs)}")
        changed = changed_runs(cfg, runs, configs)  # runs recorded with other settings
        if changed and not args.rerun:
            raise ConfigError(describe_changed(cfg, changed))
        rerun = frozenset(r.name for r in changed)
        if args.address:  # each job checks its paths where it runs; its plug-ins here
            from cluster.train.door.commands import check_submission

            for config in configs.values():
                check_submission(config, {})
            if not args.dry_run:  # the cluster answers, before a run is set aside or started
                check_reachable(dashboard_url(args.address))
        else:
            preflight_runs(cfg, runs, configs, rerun)
    except (ConfigError, SubmitError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    root = sweep_dir(cfg)
    if args.dry_run:
        for run in changed:
            print(f"{run.name} ({run.state}; {run.describe()}): would move to "
                  f"{root / SET_ASIDE_DIR}/")
        for run in runs:  # a run to rerun is started anew once set aside
            verdict = (continuation(root / run.name) if run.name not in rerun else
                       Continuation(root / run.name, RunState.ABSENT, Action.START))
            print(f"[{run.index}/{len(runs)}] {run.name} ({verdict.state.value}): "
                  + (f"{verdict.action.value}: {verdict.reason}" if not verdict.runs else
                     shlex.join(["klrl", *train_command(cfg, run, verdict)])))  # for a shell
        return 0
    try:  # the client probes the dashboard again: one lost since is still refused here
        launcher = _launcher(args, root)
    except SubmitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for run, place in zip(changed, set_aside(cfg, changed), strict=True):
        print(f"{run.name} ({run.state}; {run.describe()}): moved to {place}")
    need = max(c.reserved_cpus for c in configs.values())
    if not args.address and cfg.parallel * need > (cores := _cores()):
        print(f"warning: parallel={cfg.parallel} runs reserve {cfg.parallel * need:g} CPUs, this "
              f"machine has {cores}: they will share cores and each will run slower",
              file=sys.stderr)
    outcomes, signum = run_sweep(cfg, runs, configs, launcher, args.max_runs,
                                 frozenset(args.leave_out))
    return _summarise(cfg, runs, outcomes, signum, write=not args.no_report)


def _launcher(args, root: Path):
    """The sweep's launcher (cluster/launchers/): one Ray job per run with --address (the
    cluster's Python checked once, before any run is uploaded), else local processes."""
    if not args.address:
        return make_launcher("local", log_dir=root / "logs")
    launcher = make_launcher("ray-job", address=args.address, python=args.python,
                             max_resubmits=args.max_resubmits, upload_list=args.upload_list)
    launcher.connect()
    return launcher


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
            report = write_report(sweep_dir(cfg), cfg.report)
            print(f"report: {report}")
            _wandb_summary(sweep_dir(cfg), report)
        except ConfigError as exc:  # e.g. a report.kl_metric no run logged: the runs stand
            print(f"report not written: {exc}; fix it and run `klrl report {sweep_dir(cfg)}`",
                  file=sys.stderr)
        except FileNotFoundError:  # stopped before any run logged a step: nothing to report
            print("report not written: no run has logged a step yet", file=sys.stderr)
    failed = [o for o in outcomes if o.status == "failed"]
    for o in failed:
        print(f"FAILED {o.run.name}: {o.detail}", file=sys.stderr)
    if signum is not None:
        print("stopped; run the same command again to continue (finished runs are skipped, "
              "interrupted ones resume from their last checkpoint)", file=sys.stderr)
        return 128 + signum
    return 1 if failed else 0


def _is_override(arg: str) -> bool:
    """`key=value` (a report option) rather than a directory; a directory that exists wins."""
    return bool(re.match(r"^[A-Za-z_][\w.]*=", arg)) and not Path(arg).is_dir()


_COMPARISON = re.compile(r"^\s*(?P<a>.+?)\s+vs\s+(?P<b>.+?)\s+on\s+(?P<measure>\S+)"
                         r"(?:\s+(?P<direction>\S+))?\s*$")


def parse_comparison(text: str) -> Comparison:
    """`--compare 'A vs B on MEASURE [DIRECTION]'` as a Comparison (A, B: key=value pairs
    separated by commas, each value read as YAML); ConfigError saying the form."""
    form = ("write --compare 'KEY=VALUE[,KEY=VALUE] vs KEY=VALUE[,KEY=VALUE] on MEASURE "
            "[greater|less|two-sided]'")
    match = _COMPARISON.match(text)
    if not match:
        raise ConfigError(f"--compare {text!r}: {form}")

    def side(part: str) -> dict:
        pairs = [p.partition("=") for p in part.split(",")]
        if any(not k.strip() or not eq for k, eq, _ in pairs):
            raise ConfigError(f"--compare {text!r}: {part!r} is not KEY=VALUE pairs; {form}")
        return {k.strip(): yaml.safe_load(v.strip()) for k, _, v in pairs}

    fields = {"a": side(match["a"]), "b": side(match["b"]), "measure": match["measure"]}
    if match["direction"]:
        fields["direction"] = match["direction"]
    return validate(Comparison, fields, source=f"--compare {text!r}")


def _run_report(args) -> int:
    from cluster.train.door.commands import check_report_dir, check_report_out

    overrides = [a for a in args.dirs if _is_override(a)] + args.overrides
    paths = [Path(a) for a in args.dirs if not _is_override(a)]
    try:
        if not paths:
            raise ConfigError("give a run directory or a directory of runs (a sweep's) to "
                              "report on, e.g. `klrl report runs/r1` or `klrl report runs/r1 "
                              "runs/r2` to compare runs")
        for path in paths:  # the door: runs with metrics, --out not a file
            check_report_dir(path, args.out)
        check_report_out(report_dir(paths, args.out), args.out)  # and it can be written
        base = {}
        sweep = paths[0] / "sweep.yaml"
        if len(paths) == 1 and sweep.is_file():  # the sweep's thresholds, under the overrides
            base = load_config(SweepConfig, sweep).report.model_dump()
        cfg = validate(ReportConfig, merge(base, overrides), source="report options",
                       overrides=overrides)
        if args.compare:
            cfg = cfg.model_copy(update={"comparisons": [*cfg.comparisons,
                                                         *map(parse_comparison, args.compare)]})
        report = write_report(paths[0] if len(paths) == 1 else paths, cfg, out=args.out)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"report: {report}")
    # One directory of runs (a sweep's) gets its summary run; a comparison of several does not.
    if not args.no_wandb and len(paths) == 1 and not (paths[0] / "metrics.jsonl").is_file():
        _wandb_summary(paths[0], report)
    return 0


def _wandb_summary(runs_dir: Path, report: Path) -> None:
    """The report as one summary run in the runs' wandb project (publish/dashboard.py);
    a wandb failure is a warning: the report on disk stands."""
    from cluster.publish.dashboard import log_summary

    try:
        where = log_summary(runs_dir, report)
    except Exception as exc:  # noqa: BLE001 - wandb's errors are many; the report is written
        print(f"warning: the wandb summary was not logged: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        return
    if where is not None:
        offline = where.name.startswith("offline-")
        print(f"wandb summary: {where}" + (f" (upload: wandb sync {where})" if offline else ""))


def register(subparsers) -> None:
    p = subparsers.add_parser("sweep", help="run a grid of training runs (resumable), then report",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("sweep", help="sweep YAML, e.g. configs/sweeps/offpolicy_tiny.yaml")
    p.add_argument("overrides", nargs="*", help="overrides of the sweep file, e.g. parallel=2 "
                   "output_dir=/shared/runs grid.seed=[0,1,2] overrides.total_steps=50")
    p.add_argument("--address", default=None, help="Ray dashboard address: one Ray job per run "
                   "on that cluster (default: local processes)")
    p.add_argument("--python", default=None, metavar="PY", help="with --address: the cluster's "
                   "Python, checked there before any run's files are uploaded (default: this "
                   "Python's path if the cluster has it, else `python`)")
    p.add_argument("--upload-list", metavar="FILE", help="with --address: upload the files FILE "
                   "lists (one path per line, relative to the project) with each run's job "
                   "instead of the project's tracked files")
    p.add_argument("--max-resubmits", type=count_arg, default=0, metavar="N",
                   help="with --address: resubmit a run's job, up to N times per run, when its "
                   "driver is lost (killed, or its node gone; not when the run fails or stops by "
                   "itself); the run resumes from its last checkpoint")
    p.add_argument("--dry-run", action="store_true", help="list the runs, their state and "
                   "commands; run nothing")
    p.add_argument("--no-report", action="store_true", help="do not write the report at the end")
    p.add_argument("--max-runs", type=whole_in(1, 100_000), default=None, metavar="N",
                   help="start at most N of the unfinished runs, in the sweep's order, then "
                   "stop (the rest are 'not started'; the same command again goes on)")
    p.add_argument("--leave-out", action="append", default=[], metavar="RUN",
                   help="neither start nor resume run RUN this time (repeatable); it stays as "
                   "it is, and the same command without the flag goes on with it (`make "
                   "results --keep` leaves out the runs that failed in it)")
    p.add_argument("--rerun", action="store_true", help="runs in the sweep directory recorded "
                   "with settings other than the sweep's now (refused without this flag): move "
                   "them to SWEEP_DIR/replaced/ and run the grid's again with the new settings")
    p.set_defaults(func=_run_sweep)

    p = subparsers.add_parser("report", help="plots, accuracy table and instability flags of a "
                              "run or a sweep directory, or of several compared")
    p.add_argument("dirs", nargs="+", metavar="DIR", help="a run directory, or a directory of "
                   "runs (a sweep); several: their runs compared in one report, each labelled "
                   "by the config keys in which the runs differ")
    p.add_argument("overrides", nargs="*", help="report options, e.g. collapse_fraction=0.3 "
                   "kl_max=50 smooth=1 (default: the sweep's `report:` section, for one sweep "
                   "directory)")
    p.add_argument("--out", default=None, metavar="DIR", help="write report.md and its plots "
                   "here (default DIR/report; for several directories report-A-vs-B beside "
                   "them), e.g. docs/sweeps/offpolicy_tiny for the docs")
    p.add_argument("--compare", action="append", default=[], metavar="'A vs B on MEASURE [DIR]'",
                   help="test your own comparison (repeatable), e.g. --compare "
                   "'kl.estimator=k3,max_lag=8 vs kl.estimator=k1,max_lag=8 on log_kl_end "
                   "greater': A and B pick one configuration each by config values; MEASURE is "
                   "accuracy.<set>, auc.<set>, kl_end, log_kl_end or lag_mean; DIR greater, "
                   "less or two-sided (default); added to the sweep's report.comparisons")
    p.add_argument("--no-wandb", action="store_true", help="do not log the report as a summary "
                   "run in the runs' wandb project (a directory of runs logs one by default, "
                   "unless the runs had wandb disabled)")
    p.set_defaults(func=_run_report)
