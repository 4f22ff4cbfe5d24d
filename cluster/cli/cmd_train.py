"""`klrl train`, `klrl demo` and `klrl submit`."""
from __future__ import annotations

import shlex
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DEMO_CONFIG = REPO_ROOT / "configs" / "tiny_cpu.yaml"


def load_train_config(path, overrides):
    from cluster.config.loader import load_config
    from cluster.config.train_config import TrainConfig

    return load_config(TrainConfig, path, overrides)


def train(cfg, resume: bool = False) -> tuple[Path, dict]:
    """Run one training job in this process (the Ray driver). Returns (run_dir, last metrics).

    resume=False: the run directory must not hold a run yet. resume=True: continue it from its
    newest complete checkpoint; with none (or no directory) start it afresh, keeping an earlier
    metrics log as metrics.jsonl.abandoned-N. Raises RunStopped (with .checkpoint set) when the
    run stops early: a signal, worker restarts used up, too many non-finite steps."""
    from cluster.train.checkpoint import latest_checkpoint
    from cluster.train.controller import Controller
    from cluster.train.launch import resolve_model, start_ray
    from cluster.train.run_log import default_run_name
    from cluster.train.stopping import GracefulStop

    run_dir = Path(cfg.output_dir) / (cfg.run_name or default_run_name(cfg))
    resume_from = latest_checkpoint(run_dir) if resume else None
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists() and resume_from is None:
        if not resume:
            raise FileExistsError(f"{run_dir} already holds a run; choose another run_name, or "
                                  f"continue it with `klrl train --resume {run_dir}`")
        n = len(list(run_dir.glob("metrics.jsonl.abandoned-*")))
        metrics.rename(run_dir / f"metrics.jsonl.abandoned-{n}")
        print(f"{run_dir} has no complete checkpoint: starting it afresh")
    model_dir = resolve_model(cfg)  # before Ray: building the tiny model uses all cores
    started = start_ray(cfg)
    try:
        with GracefulStop() as stop_requested:
            controller = Controller(cfg, run_dir, model_dir, resume_from=resume_from,
                                    stop_requested=stop_requested)
            return run_dir, controller.run()
    finally:
        if started:
            import ray

            ray.shutdown()


def _config_for(args):
    """The TrainConfig a `klrl train` command line asks for. `--resume RUN_DIR` takes the
    run's own config.yaml (overrides still apply, e.g. a larger total_steps)."""
    from cluster.config.loader import ConfigError

    overrides = list(args.overrides)
    config = args.config
    if config is not None and "=" in config:  # `--resume RUN_DIR key=value`: no config given
        overrides.insert(0, config)
        config = None
    if isinstance(args.resume, str):
        run_dir = Path(args.resume)
        if config is not None:
            raise ConfigError("give either a config or --resume RUN_DIR, not both")
        if not (run_dir / "config.yaml").is_file():
            raise ConfigError(f"--resume {run_dir}: no config.yaml there (not a run directory)")
        overrides += [f"output_dir={run_dir.parent}", f"run_name={run_dir.name}"]
        return load_train_config(run_dir / "config.yaml", overrides)
    if config is None:
        raise ConfigError("klrl train needs a config file (or --resume RUN_DIR)")
    cfg = load_train_config(config, overrides)
    if args.resume and cfg.run_name is None:
        raise ConfigError("--resume without RUN_DIR needs run_name in the config or overrides")
    return cfg


def _report_stop(stop) -> int:
    """Say why the run stopped and how to continue it; returns the exit code."""
    msg = f"run stopped: {stop}"
    if stop.checkpoint is not None:
        msg += f"\ncheckpoint: {stop.checkpoint}\ncontinue with: klrl train --resume {stop.checkpoint.parent.parent}"
    print(msg, file=sys.stderr)
    return stop.exit_code


def _run_train(args) -> int:
    from ray.exceptions import RayError

    from cluster.config.loader import ConfigError
    from cluster.train.stopping import RunStopped

    try:
        cfg = _config_for(args)
        run_dir, _last = train(cfg, resume=bool(args.resume))
    except (ConfigError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RunStopped as stop:
        return _report_stop(stop)
    except RayError as exc:  # an actor (learner rank, worker) failed: everything is torn down
        print(f"error: the run failed and was torn down: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    from cluster.train.progress import print_summary

    print_summary(run_dir)
    print(f"run directory: {run_dir}")
    return 0


def _run_demo(args) -> int:
    from cluster.config.loader import ConfigError
    from cluster.train.progress import print_summary
    from cluster.train.stopping import RunStopped

    try:
        run_dir, _ = train(load_train_config(DEMO_CONFIG, args.overrides))
    except (ConfigError, FileExistsError) as exc:
        print(exc, file=sys.stderr)
        return 2
    except RunStopped as stop:
        return _report_stop(stop)
    print_summary(run_dir, "demo finished")
    return 0


def submit(config: str, address: str, overrides: list[str], wait: bool = True,
           python: str = "python") -> str:
    """Submit `klrl train CONFIG overrides` as a Ray job with this repository as working_dir.

    The job runs `python -m cluster.cli train ...` on the head node with the repository
    uploaded as its working directory, so the cluster's Python needs klrl's dependencies
    (not klrl itself). Clusters started with token auth write ~/.ray/auth_token; its token
    is sent explicitly (see _auth_headers), so RAY_AUTH_MODE=token is not needed here."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(address, headers=_auth_headers())
    rel = Path(config).resolve().relative_to(REPO_ROOT)
    entrypoint = " ".join([shlex.quote(python), "-m cluster.cli train", shlex.quote(str(rel)),
                           *map(shlex.quote, overrides)])
    job_id = client.submit_job(entrypoint=entrypoint, runtime_env={
        "working_dir": str(REPO_ROOT),
        "excludes": [".venv", "runs", ".git", "**/__pycache__", "wandb", ".pytest_cache"]})
    print(f"submitted {job_id}: {entrypoint}")
    if wait:
        for chunk in _tail(client, job_id):
            print(chunk, end="")
        status = client.get_job_status(job_id)
        print(f"job {job_id}: {status}")
        if status != JobStatus.SUCCEEDED:
            raise RuntimeError(f"job {job_id} ended {status}")
    return job_id


def _auth_headers() -> dict:
    """Bearer token for a token-auth cluster: RAY_AUTH_TOKEN, else the file at
    RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token. Sent explicitly because Ray's client decides
    whether to attach it from process-wide state read once, before a token may exist."""
    import os

    token = os.environ.get("RAY_AUTH_TOKEN")
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    if not token and path.is_file():
        token = path.read_text().strip()
    return {"Authorization": f"Bearer {token}"} if token else {}


def _tail(client, job_id):
    import asyncio

    async def collect():
        async for lines in client.tail_job_logs(job_id):
            yield lines

    agen = collect()
    loop = asyncio.new_event_loop()
    try:
        while True:
            try:
                yield loop.run_until_complete(agen.__anext__())
            except StopAsyncIteration:
                return
    finally:
        loop.close()


def _run_submit(args) -> int:
    from cluster.config.loader import ConfigError

    try:
        load_train_config(args.config, args.overrides)  # reject bad configs before submitting
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    submit(args.config, args.address, args.overrides, wait=not args.no_wait, python=args.python)
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("train", help="train a policy (local Ray, or RAY_ADDRESS)")
    p.add_argument("config", nargs="?", help="YAML config, e.g. configs/tiny_cpu.yaml")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. kl.estimator=k3 max_lag=2")
    p.add_argument("--resume", nargs="?", const=True, default=None, metavar="RUN_DIR",
                   help="continue a run from its newest complete checkpoint: RUN_DIR, or the run "
                   "the config's run_name names; starts afresh if there is no checkpoint yet")
    p.set_defaults(func=_run_train)

    p = subparsers.add_parser("demo", help="the CPU demo: train the tiny model on arithmetic")
    p.add_argument("overrides", nargs="*", help="overrides of configs/tiny_cpu.yaml")
    p.set_defaults(func=_run_demo)

    p = subparsers.add_parser("submit", help="submit a training run with `ray job submit`")
    p.add_argument("config")
    p.add_argument("--address", required=True, help="Ray dashboard address, e.g. http://127.0.0.1:8265")
    p.add_argument("--no-wait", action="store_true", help="return after submission")
    p.add_argument("--python", default="python", help="Python on the cluster that runs the job "
                   "driver (needs klrl's dependencies)")
    p.add_argument("overrides", nargs="*")
    p.set_defaults(func=_run_submit)
