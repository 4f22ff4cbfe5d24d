"""`klrl slurm`: a training run (or a sweep) as one SLURM batch job that survives preemption.
Validates the config here, fixes the run's name, writes the sbatch script (cluster/slurm/) and
submits it with `sbatch`."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

from cluster.config.loader import ConfigError
from cluster.config.train_config import load_train_config


# SlurmJob's fields whose flag is not the field's name with dashes (the rest are).
FLAGS = {"signal_lead_s": "--signal-lead", "sbatch_args": "--sbatch-arg",
         "ray_start_args": "--ray-start-arg"}


def _request(args):
    """The launcher and the request the command line asks for, the config validated and the
    job built (ConfigError otherwise)."""
    from pydantic import ValidationError

    from cluster.launchers.base import RunRequest
    from cluster.launchers.registry import launcher
    from cluster.train.door.commands import check_submission
    from cluster.train.door.resources import check_allocation

    config = Path(args.config).absolute()
    overrides = list(args.overrides)
    if args.sweep:
        from cluster.sweeps.sweep import expand, load_sweep, validate_runs

        cfg = load_sweep(config, overrides)
        runs = list(validate_runs(cfg, expand(cfg)).values())
        for run_cfg in runs:
            check_submission(run_cfg, {})
        check_allocation(runs, args.nodes, args.gpus_per_node, args.cpus_per_node, cfg.parallel)
        name, output_dir = cfg.name, cfg.output_dir
    else:
        from cluster.train.run_log import default_run_name

        cfg = load_train_config(config, overrides)
        check_submission(cfg, {})  # plug-ins import here; paths and resources are the nodes'
        check_allocation([cfg], args.nodes, args.gpus_per_node, args.cpus_per_node)
        if cfg.run_name is None:  # fixed now: every attempt of the job must find the same run
            cfg = cfg.model_copy(update={"run_name": default_run_name(cfg)})
            overrides.append(f"run_name={cfg.run_name}")
        name, output_dir = cfg.run_name, cfg.output_dir
    slurm = launcher(
        "slurm", workdir=Path.cwd(), slurm_dir=(Path(output_dir) / "slurm").absolute(),
        python=args.python, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
        cpus_per_node=args.cpus_per_node, partition=args.partition, time=args.time,
        signal_lead_s=args.signal_lead, sbatch_args=args.sbatch_arg,
        ray_start_args=args.ray_start_arg)
    request = RunRequest(name, str(config), tuple(overrides),
                         command="sweep" if args.sweep else "train")
    try:
        return slurm, request, slurm.job(request)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = str(err["loc"][0])
        raise ConfigError(f"{FLAGS.get(field, '--' + field.replace('_', '-'))}: "
                          f"{err['msg'].removeprefix('Value error, ')}") from None


def _run_slurm(args) -> int:
    from cluster.launchers.base import SubmitError
    from cluster.slurm.script import render
    from cluster.train.door.commands import check_slurm_dir

    try:
        slurm, request, job = _request(args)
        if args.dry_run:
            print(render(job), end="")
            return 0
        if shutil.which("sbatch") is not None:  # the script is written here, on the login node
            check_slurm_dir(job.slurm_dir)
        job_id, job = slurm.start(request)
    except (ConfigError, SubmitError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"submitted job {job_id} ({job.script_path})\n"
          f"output: {job.output_file(job_id)}\n"
          f"stop it: scancel {job_id} (the run checkpoints first); a requeued or preempted "
          "attempt resumes the run by itself")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "slurm", help="run `klrl train` (or a sweep) as a SLURM job that survives preemption",
        description=__doc__.split("\n")[0])
    p.add_argument("config", help="the run's config (with --sweep, a sweep file)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, as for `klrl train` "
                   "(or `klrl sweep`)")
    p.add_argument("--sweep", action="store_true", help="CONFIG is a sweep file: the job runs "
                   "`klrl sweep` on it (its runs on the job's Ray cluster)")
    p.add_argument("--nodes", type=int, default=1, help="nodes; Ray's head runs on the first "
                   "(default 1)")
    p.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node (default 0)")
    p.add_argument("--cpus-per-node", type=int, default=None, help="CPUs per node (default: "
                   "what SLURM allocates)")
    p.add_argument("--partition", default=None, help="SLURM partition")
    p.add_argument("--time", default=None, help="time limit, e.g. 4:00:00 or 2-00:00:00")
    p.add_argument("--signal-lead", type=int, default=300, metavar="SECONDS",
                   help="checkpoint and requeue this long before the time limit (SIGUSR1 from "
                   "SLURM; default 300; 0: never)")
    p.add_argument("--sbatch-arg", action="append", default=[], metavar="--KEY=VALUE",
                   help="another sbatch option (repeatable), e.g. --sbatch-arg=--account=proj")
    p.add_argument("--ray-start-arg", action="append", default=[], metavar="--KEY=VALUE",
                   help="another `ray start` option for every node (repeatable)")
    p.add_argument("--python", default=sys.executable, help="the Python on the nodes "
                   "(default: this one, which must be at the same path there)")
    p.add_argument("--dry-run", action="store_true", help="print the sbatch script; submit "
                   "nothing")
    p.set_defaults(func=_run_slurm)
