"""One training run in this process (the Ray driver): `train(cfg)`, the entry point behind
`klrl train`, `klrl demo`, the sweeps' runs and the benchmarks' end-to-end measurements."""
from __future__ import annotations

import time
from pathlib import Path

from cluster.config.train_config import TrainConfig
from cluster.train.controller import Controller
from cluster.train.door.preflight import (
    check_cluster_resources,
    preflight,
    resolve_paths,
)
from cluster.train.launch import resolve_model, start_ray, stop_ray
from cluster.train.run_log import abandon_metrics, has_metrics
from cluster.train.stopping import GracefulStop, RunStopped


def train(cfg: TrainConfig, resume: bool = False,
          passed: tuple[Path, Path | None] | None = None) -> tuple[Path, dict]:
    """Run one training job in this process (the Ray driver). Returns (run_dir, last metrics).

    resume=False: the run directory must not hold a run yet. resume=True: continue it from its
    newest complete checkpoint; with none start it afresh, keeping an earlier metrics log as
    metrics.jsonl.abandoned-N (a finished run without one, or a run that never started, is
    refused). Every check that needs no process runs first (cluster/train/door/preflight.py:
    ConfigError or FileExistsError, nothing started or written), unless the caller has just
    run it on this config and passes its result (`passed`: `klrl train`, which runs the door
    on the terminal before it names the run), so that one command passes the door once.
    Raises RunStopped (with .checkpoint set) when the run stops early: a signal, worker
    restarts used up, too many non-finite steps.

    Relative paths in `cfg` are relative to this process's working directory: they are made
    absolute here, once, so that every actor reads the same files whatever its own. The
    run_dir returned is as the config names it (under output_dir as given)."""
    given = Path(cfg.output_dir)
    cfg = resolve_paths(cfg)
    run_dir, resume_from = passed if passed is not None else preflight(cfg, resume)
    if resume and resume_from is None and has_metrics(run_dir):
        abandon_metrics(run_dir)
        print(f"{run_dir} has no complete checkpoint: starting it afresh")
    model_dir = resolve_model(cfg)  # before Ray: building the tiny model uses all cores
    session, started = start_ray(cfg), time.time()
    failed = True  # until the run returns or stops as asked (RunStopped)
    try:
        check_cluster_resources(cfg)  # needs Ray: a request no node can meet would hang the run
        with GracefulStop() as stop_requested:
            controller = Controller(cfg, run_dir, model_dir, resume_from=resume_from,
                                    stop_requested=stop_requested)
            result = controller.run()
        failed = False
        return given / run_dir.name, result
    except RunStopped:
        failed = False
        raise
    finally:
        if session is not None:
            stop_ray(session, keep_logs=failed)
        if cfg.learner.lora is not None:  # the workers were killed: none removed its adapter
            from actors.lora_serving import sweep_after_run

            sweep_after_run(started)
