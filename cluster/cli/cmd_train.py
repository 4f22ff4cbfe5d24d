"""`klrl train`, `klrl demo` and `klrl submit`: parse, call cluster.train, print the outcome."""
from __future__ import annotations

import os
import sys
from contextlib import nullcontext
from pathlib import Path

from cluster.config.loader import DEMO_CONFIG, ConfigError
from cluster.config.train_config import load_train_config
from cluster.train.continuation import Action, continuation_of
from cluster.train.door.resume import check_resume_target
from cluster.train.dry_run import dry_run
from cluster.train.error_line import error_line
from cluster.launchers.base import RunRequest, SubmitError
from cluster.launchers.job_upload import UploadError
from cluster.launchers.ray_jobs import (
    JobFailed,
    check_resubmittable,
    parse_env,
    read_runtime_env,
)
from cluster.launchers.registry import launcher
from cluster.train.progress import print_summary
from cluster.train.run_log import config_path
from cluster.train.stopping import RunStopped


def _config_for(args):
    """The TrainConfig a `klrl train` command line asks for. `--resume` is a flag that may stand
    anywhere; the one argument without `=` is the config, or with --resume a run directory,
    whose own config.yaml is then read (overrides still apply, e.g. a larger total_steps)."""
    given = [a for a in (args.config, *args.overrides) if a is not None]
    overrides = [a for a in given if "=" in a]
    paths = [a for a in given if "=" not in a]
    if len(paths) > 1:
        raise ConfigError(f"give one config file (or, with --resume, one run directory), not "
                          f"{len(paths)}: {' '.join(paths)}")
    if not paths:
        raise ConfigError("klrl train needs a config file (or --resume RUN_DIR)")
    path = Path(paths[0])
    if args.resume and (path.is_dir() or not path.exists()):
        check_resume_target(path)  # a run directory that exists (or no such file at all)
    if path.is_dir():
        if not args.resume:
            raise ConfigError(f"{path} is a directory: to continue the run in it, add --resume")
        overrides += [f"output_dir={path.parent}", f"run_name={path.name}"]
        return load_train_config(config_path(path), overrides)
    cfg = load_train_config(path, overrides)
    if args.resume and cfg.run_name is None:
        raise ConfigError("--resume with a config file needs run_name (in it or as an override) "
                          "to name the run to continue; or give the run directory instead")
    return cfg


def _report_stop(stop) -> int:
    """Say why the run stopped and how to continue it; returns the exit code."""
    msg = f"run stopped: {stop}"
    if stop.checkpoint is not None:
        msg += (f"\ncheckpoint: {stop.checkpoint}"
                f"\ncontinue with: klrl train --resume {stop.checkpoint.parent.parent}")
    elif stop.run_dir is not None:  # e.g. a learner that hung before the first checkpoint
        msg += (f"\nno checkpoint yet: klrl train --resume {stop.run_dir} starts the run afresh "
                "(checkpoint_every > 0 keeps one)")
    print(msg, file=sys.stderr)
    return stop.exit_code


def _run_train(args) -> int:
    try:
        cfg = _config_for(args)
        verdict = _continuation(cfg) if args.resume_if_started else None
    except (ConfigError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    resume = bool(args.resume)
    if verdict is not None:
        if verdict.action is Action.REFUSE:
            print(f"error: {verdict.reason}", file=sys.stderr)
            return 2
        if verdict.action is Action.SKIP:  # a job resubmitted after its run's end
            print(verdict.reason)
            return 0
        resume = verdict.action is Action.RESUME
    if args.dry_run:
        return _dry_run(cfg, resume)
    return _train_and_report(cfg, resume, args.verbose, "run finished")


def _dry_run(cfg, resume: bool) -> int:
    """`klrl train --dry-run`: every check of a real start (cluster/train/dry_run.py), what the
    start would do, and nothing started or written; exit 0, or 2 with the refusal."""
    from cluster.train.run_log import default_run_name

    if cfg.run_name is None:  # named as a start names it (a real start names it anew)
        cfg = cfg.model_copy(update={"run_name": default_run_name(cfg)})
    try:
        lines = dry_run(cfg, resume)
    except (ConfigError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("\n".join([*lines, "dry run: every check of a real start passed; nothing was "
                      "started or written"]))
    return 0


def _continuation(cfg):
    """--resume-if-started (what a resubmitted job runs): the continuation rule's verdict on
    the run (cluster/train/continuation.py): start it, resume it, nothing to do, or refused."""
    if cfg.run_name is None:
        raise ConfigError("--resume-if-started needs run_name (in the config or as an "
                          "override) to know which run to continue")
    return continuation_of(cfg)


def _run_demo(args) -> int:
    try:
        cfg = load_train_config(DEMO_CONFIG, args.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return _train_and_report(cfg, False, args.verbose, "demo finished")


def _train_and_report(cfg, resume: bool, verbose: bool, title: str) -> int:
    """Run `train(cfg)` and say how it ended: exit 0, 2 (refused before anything started), 1
    (failed after the start: one line naming what failed and the full log) or the stop's
    code. Unless `verbose`, other programs' lines go only to the run's log file
    (cluster/train/run_output.py), RUN_DIR/train.log once the run directory exists."""
    import tempfile
    import traceback

    # Ray, torch, vLLM and DeepSpeed: loaded when a run starts, not at `klrl --help`.
    from ray.exceptions import RayError

    from cluster.train.door.preflight import preflight
    from cluster.train.run import train
    from cluster.train.run_log import default_run_name
    from cluster.train.run_output import quiet_output

    if cfg.run_name is None:  # named now, so that the log's final place is known
        cfg = cfg.model_copy(update={"run_name": default_run_name(cfg)})
    try:  # the door, here on the terminal, before the run is named (train() takes its verdict)
        passed = preflight(cfg, resume)
    except (ConfigError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    run_dir = Path(cfg.output_dir) / cfg.run_name
    fd, tmp_log = tempfile.mkstemp(prefix=f"klrl-{cfg.run_name}-", suffix=".log")
    os.close(fd)
    log = Path(tmp_log)
    code = None
    if not verbose:
        print(f"run {cfg.run_name}: {run_dir}; other programs' output goes to its train.log "
              "(--verbose shows it here)", flush=True)
    # The one command that continues the run if this process is lost (docs/checkpoints.md).
    print(f"if this process is lost, continue the run with: klrl train --resume {run_dir}",
          flush=True)
    output = nullcontext() if verbose else quiet_output(log)
    try:
        with output:
            try:
                train(cfg, resume=resume, passed=passed)
            except (ConfigError, FileExistsError) as exc:
                print(f"error: {exc}", file=sys.stderr)
                code = 2
            except RunStopped as stop:
                code = _report_stop(stop)
            except AssertionError:  # a broken invariant is a bug in klrl: its whole traceback
                raise
            except Exception as exc:  # noqa: BLE001 - any failure after the start: one line
                traceback.print_exc()  # the whole story, into the log
                failed = ("the run failed and was torn down" if isinstance(exc, RayError)
                          else "the run failed")
                where = run_dir / "train.log" if run_dir.is_dir() else log
                print(f"error: {failed}: {error_line(exc)}"
                      + ("" if verbose else f" (full log: {where})"), file=sys.stderr)
                code = 1
    finally:  # the log joins the run's directory; without one it is kept only if named above
        if run_dir.is_dir() and code != 2 and not verbose:
            with open(run_dir / "train.log", "a") as kept:  # a resumed run's log goes on
                kept.write(log.read_text(errors="replace"))
            log.unlink()
        elif code != 1 or verbose or run_dir.is_dir():
            log.unlink()
    if code is not None:
        return code
    print_summary(run_dir, title)
    full_log = "" if verbose else f" (full log: {run_dir / 'train.log'})"
    print(f"run directory: {run_dir}{full_log}")
    return 0


def _run_submit(args) -> int:
    """Validate the config and build the job here (no cluster needed for any refusal), then
    submit it; exit 2 for what cannot be submitted, 1 for a job that ends failed."""
    from cluster.train.door.commands import check_submission

    try:
        cfg = load_train_config(args.config, args.overrides)  # reject bad configs before submitting
        env = parse_env(args.env)
        runtime_env = read_runtime_env(args.runtime_env) if args.runtime_env else None
        check_resubmittable(cfg, args.max_resubmits, wait=not args.no_wait)
        overrides = list(args.overrides)
        if args.max_resubmits and cfg.run_name is None:  # named here: a resubmission finds it
            from cluster.train.run_log import default_run_name

            cfg = cfg.model_copy(update={"run_name": default_run_name(cfg)})
            overrides.append(f"run_name={cfg.run_name}")
        ray_job = launcher(
            "ray-job", address=args.address, python=args.python,
            max_resubmits=args.max_resubmits, upload_list=args.upload_list,
            env=env, job_name=args.job_name, runtime_env=runtime_env,
            runtime_env_source=f"--runtime-env {args.runtime_env}")
        request = RunRequest(cfg.run_name or Path(args.config).stem, args.config,
                             tuple(overrides))
        spec = ray_job.spec(request, cfg)  # built here: no cluster needed for any refusal
        check_submission(cfg, spec.runtime_env.get("env_vars", {}))  # the door, on this side
        if args.dry_run:
            print(spec.describe())
            return 0
        job = ray_job.start(request, spec)
    except (ConfigError, SubmitError, UploadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.no_wait:
        return 0
    try:
        ray_job.follow(job)  # resubmits a job whose driver is lost (the launcher's rule)
    except JobFailed as exc:
        print(f"error: {exc}; its logs: ray job logs {exc.job_id or job.job_id} --address "
              f"{args.address}",
              file=sys.stderr)
        return 1
    except SubmitError as exc:  # the dashboard could not be reached again to follow the job
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\nstopped following; job {job.job_id} goes on on the cluster (stop it with "
              f"`ray job stop {job.job_id} --address {args.address}`)", file=sys.stderr)
        return 130
    return 0


def count_arg(text: str) -> int:
    """A non-negative count from the command line (argparse's error otherwise)."""
    import argparse

    value = int(text) if text.isdigit() else -1
    if not 0 <= value <= 1000:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number from 0 to 1000")
    return value


VERBOSE_HELP = ("show every program's output (Ray, vLLM, DeepSpeed, wandb, warnings) as well as "
                "klrl's; by default those lines go only to the run's log, RUN_DIR/train.log")


def register(subparsers) -> None:
    p = subparsers.add_parser("train", help="train a policy (local Ray, or RAY_ADDRESS)")
    p.add_argument("config", nargs="?", metavar="CONFIG|RUN_DIR", help="YAML config, e.g. "
                   "configs/tiny_cpu.yaml; with --resume, a run directory instead")
    p.add_argument("overrides", nargs="*",
                   help="key.sub=value overrides, e.g. kl.estimator=k3 max_lag=2")
    p.add_argument("--resume", action="store_true",
                   help="continue a run from its newest complete checkpoint: the RUN_DIR given, "
                   "or the run the config's run_name names; starts an unfinished run afresh if "
                   "it has no checkpoint yet (anywhere on the line: `klrl train --resume RUN_DIR "
                   "total_steps=600`)")
    p.add_argument("--resume-if-started", action="store_true",
                   help="start, resume or leave the run as its directory says (one rule for "
                   "every launcher: a run not there is started, a started one resumed, a "
                   "finished one left, one recorded with other settings refused); what a job "
                   "resubmitted by `klrl submit --max-resubmits` or requeued by SLURM runs")
    p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    p.add_argument("--dry-run", action="store_true",
                   help="make every check of a real start (config, model, data, resources, "
                   "resume target) and start nothing: no model build, no Ray (a cluster named "
                   "by ray.address is joined for its resources and left), no run directory")
    p.set_defaults(func=_run_train)

    p = subparsers.add_parser("demo", help="the CPU demo: train the tiny model on arithmetic")
    p.add_argument("overrides", nargs="*", help="overrides of configs/tiny_cpu.yaml")
    p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    p.set_defaults(func=_run_demo)

    p = subparsers.add_parser("submit", help="submit a training run to a Ray cluster as a Ray job")
    p.add_argument("config", help="YAML config; one outside this repository is sent with the job")
    p.add_argument("--address", required=True,
                   help="Ray dashboard address, e.g. http://127.0.0.1:8265")
    p.add_argument("--no-wait", action="store_true", help="return after submission")
    p.add_argument("--python", default=None, metavar="PY", help="the Python on the cluster that "
                   "runs the job's driver; checked there (it must import klrl's dependencies) "
                   "before anything is uploaded. Default: this Python's path if the cluster has "
                   "it, else `python` on the head's PATH")
    p.add_argument("--upload-list", metavar="FILE", help="upload the files FILE lists (one path "
                   "per line, relative to the project; a directory means the files in it) "
                   "instead of the project's tracked files")
    p.add_argument("--env", action="append", default=[], metavar="KEY[=VALUE]",
                   help="environment variable of the job (repeatable), e.g. --env WANDB_API_KEY "
                   "(KEY alone: its value in this shell, which must set it); values are never "
                   "printed")
    p.add_argument("--runtime-env", metavar="FILE", help="YAML or JSON Ray runtime_env merged "
                   "with klrl's (pip, py_modules, env_vars, ...; not working_dir, which is this "
                   "repository); a key that would replace one of klrl's is an error")
    p.add_argument("--job-name", metavar="NAME", help="the job's Ray submission id (unique on the "
                   "cluster, finished jobs included); default: one Ray chooses")
    p.add_argument("--dry-run", action="store_true", help="print the job (entrypoint, "
                   "runtime_env with env values as ***) and submit nothing")
    p.add_argument("--max-resubmits", type=count_arg, default=0, metavar="N",
                   help="resubmit the job, up to N times, when its driver is lost (killed, or "
                   "its node gone; not when the run itself fails or stops): each resubmission "
                   "continues the run from its last checkpoint. Needs an absolute output_dir "
                   "the cluster keeps, and this command following the job (not --no-wait)")
    p.add_argument("overrides", nargs="*")
    p.set_defaults(func=_run_submit)
