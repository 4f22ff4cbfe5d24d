"""End-to-end throughput for `klrl bench`: against the ideal overlap and the core bound.

Each max_lag runs the real trainer (`cluster.train.run.train`) for warm-up + measured + 1
steps and reads its metrics.jsonl. Only the measured steps count: start-up, the initial
evaluation, the steps that fill the pipeline (max_lag + 2 warm-up steps) and the last step
(it includes the final evaluation) are left out.

One-core phase times come from a reference run at max_lag 0 with one thread per part
(`rollout.threads_per_worker=1 learner.threads_per_rank=1`), where generation and training
alternate and each is measured alone on one core:
    T_gen   = time/wait_for_rollouts: the worker's weight load + generate + scoring, as the
              controller waits for it;
    T_train = time/train + time/weight_publish: advantages, batch, learner step, export.
Then the runs at max_lag 0, 1, 2 use the default thread rule (TrainConfig: at max_lag 0 each
phase gets every core, above each part its own). Two yardsticks:
- the bound: batch x cores / (T_gen + T_train), the work of one step spread perfectly over
  every core; no schedule beats it while the phases are compute. `of_bound` = measured /
  bound (a tiny model's phases are mostly waiting on calls, which overlap hides: above 1 there);
- the ideal overlap at max_lag >= 1 if each part kept a core of its own: batch /
  max(T_gen, T_train); overlap efficiency = measured / that (the thread rule lets the learner
  share the worker's core too, which can beat it: above 1 then). At max_lag 0 the ideal is the
  bound (each phase perfectly parallel on every core).

On one GPU shared by the learner and the rollout worker (`reference="max_lag 0"`, `klrl
bench --device cuda`) there are no cores to split: the reference is the max_lag 0 run itself, where
generation and training alternate on the GPU, and the GPU counts as the one "core". Then the
bound is batch / (T_gen + T_train) of that run, and the ideal at max_lag >= 1 is batch /
max(T_gen, T_train): the two phases overlapping perfectly, which their contention for the
one GPU prevents in part.

In-flight weight updates (`in_flight_lags`, `rollout.in_flight_updates=true`): the same
workload and steps at each of those max_lags with the workers generating continuously and
taking each new version between two engine steps, named `<workload>-lag<k>-inflight`. They get
the same bound, ideal and efficiency (one step's work is the same work); the speed-up is their
samples/s over the batch-level run's at that lag. Each run also keeps the means of what the
controller logs per step about the engines and the batch (`STEP_MEANS`): the share of the time
between a worker's two batches in which its engine sat idle (what in-flight updates are meant
to shrink), the tokens' lag, the share of samples that span several versions and the requests
an update preempted per step (what they cost, and whether anything was in flight at all: both
0 means every update found the engines idle), and the responses' mean and longest length (how
much a batch-level step waits for its longest response).

`reference="none"` (`klrl bench --quick`, which checks the machinery, not the figures) runs no
reference: the runs' samples/s, lags and step means are measured; the bound, the ideal and the
efficiency are None. The reference run goes through the same `_measure` as every other run,
and the arithmetic on it is tests/test_bench_in_flight.py's, so the quick bench saves a whole
run (engine and learner start-up: about 30 s on 2 cores) and checks nothing less.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.config.loader import DEMO_CONFIG
from cluster.config.train_config import load_train_config
from cluster.train.run import train
from cluster.train.run_log import read_metrics

REFERENCES = ("one-core", "max_lag 0", "none")  # PipelineResult.reference; docstring above
ONE_THREAD = ("rollout.threads_per_worker=1", "learner.threads_per_rank=1")
IN_FLIGHT = "rollout.in_flight_updates=true"
# LagRun field <- the metric whose mean over the measured steps it holds. None where no
# measured step logged it (a controller from before the metric; engine idle share: a worker's
# first batch has none). response_tokens_max is the mean of each batch's longest response.
STEP_MEANS = {"engine_idle_share": "rollout/engine_idle_share",
              "token_lag_mean": "lag/token_mean",
              "multi_version_share": "lag/multi_version_share",
              "preempted": "rollout/preempted",
              "response_tokens_mean": "rollout/response_tokens_mean",
              "response_tokens_max": "rollout/response_tokens_max"}


@dataclass
class LagRun:
    """One end-to-end run's measured means at one max_lag (its steps after the warm-up),
    batch-level or with in-flight weight updates (`in_flight`)."""

    max_lag: int
    steps: int                 # measured steps
    step_seconds: float        # mean time/step over them
    samples_per_step: int
    gen_seconds: float         # mean time/wait_for_rollouts
    train_seconds: float       # mean time/train + time/weight_publish
    engine_gen_seconds: float  # mean time/generate (inside vLLM)
    in_flight: bool = False    # rollout.in_flight_updates
    # STEP_MEANS: means over the measured steps, None where no step logged the metric
    engine_idle_share: float | None = None
    token_lag_mean: float | None = None
    multi_version_share: float | None = None
    preempted: float | None = None    # requests preempted by weight updates, per step
    response_tokens_mean: float | None = None
    response_tokens_max: float | None = None

    @property
    def samples_per_s(self) -> float:
        return self.samples_per_step / self.step_seconds


@dataclass
class PipelineResult:
    """A workload's end-to-end runs: the reference run, one per max_lag and one per in-flight
    max_lag, from which the ideal overlap, the efficiency, the bound and the in-flight
    speed-up follow (the first three None without a reference run). A run is named by its
    max_lag and whether it is in flight."""

    workload: str
    # the reference run: max_lag 0, one thread per part (GPU: the max_lag 0 run; None: none)
    one_core: LagRun | None
    cores: int                 # CPU cores the run has (GPU: 1, the one GPU)
    runs: list[LagRun] = field(default_factory=list)
    reference: str = "one-core"  # REFERENCES: "one-core", "max_lag 0" (one shared GPU), "none"

    def __post_init__(self) -> None:
        no_run = self.one_core is None
        if self.reference not in REFERENCES or no_run != (self.reference == "none"):
            raise ValueError(f"reference {self.reference!r} with reference run {self.one_core}")

    def run(self, lag: int, in_flight: bool = False) -> LagRun:
        return next(r for r in self.runs if r.max_lag == lag and r.in_flight == in_flight)

    def has(self, lag: int, in_flight: bool = False) -> bool:
        return any(r.max_lag == lag and r.in_flight == in_flight for r in self.runs)

    @property
    def t_gen(self) -> float | None:
        return None if self.one_core is None else self.one_core.gen_seconds

    @property
    def t_train(self) -> float | None:
        return None if self.one_core is None else self.one_core.train_seconds

    @property
    def bound_samples_per_s(self) -> float | None:
        if self.one_core is None:
            return None
        return self.one_core.samples_per_step * self.cores / (self.t_gen + self.t_train)

    def ideal_samples_per_s(self, lag: int, in_flight: bool = False) -> float | None:
        if self.one_core is None or lag == 0:
            return self.bound_samples_per_s
        return self.run(lag, in_flight).samples_per_step / max(self.t_gen, self.t_train)

    def efficiency(self, lag: int, in_flight: bool = False) -> float | None:
        ideal = self.ideal_samples_per_s(lag, in_flight)
        return None if ideal is None else self.run(lag, in_flight).samples_per_s / ideal

    def of_bound(self, lag: int, in_flight: bool = False) -> float | None:
        bound = self.bound_samples_per_s
        return None if bound is None else self.run(lag, in_flight).samples_per_s / bound

    def in_flight_speedup(self, lag: int) -> float | None:
        """In-flight samples/s over batch-level samples/s at `lag` (None unless both ran)."""
        if not (self.has(lag) and self.has(lag, in_flight=True)):
            return None
        return self.run(lag, in_flight=True).samples_per_s / self.run(lag).samples_per_s

    @property
    def best_lag(self) -> int:
        """The batch-level max_lag of the most samples/s (of_bound_best_lag's run)."""
        return max((r for r in self.runs if not r.in_flight),
                   key=lambda r: r.samples_per_s).max_lag

    def to_dict(self) -> dict[str, Any]:
        return {"workload": self.workload, "reference": self.reference, "t_gen_seconds": self.t_gen,
                "t_train_seconds": self.t_train, "cores": self.cores,
                "bound_samples_per_s": self.bound_samples_per_s,
                "one_core_samples_per_s": None if self.one_core is None
                else self.one_core.samples_per_s,
                "best_lag": self.best_lag,
                "runs": [self._run_dict(r) for r in self.runs]}

    def _run_dict(self, r: LagRun) -> dict[str, Any]:
        lag, fly = r.max_lag, r.in_flight
        return {"max_lag": lag, "in_flight": fly, "measured_steps": r.steps,
                "step_seconds": r.step_seconds, "samples_per_step": r.samples_per_step,
                "samples_per_s": r.samples_per_s,
                "ideal_samples_per_s": self.ideal_samples_per_s(lag, fly),
                "overlap_efficiency": self.efficiency(lag, fly),
                "of_bound": self.of_bound(lag, fly),
                "wait_for_rollouts_seconds": r.gen_seconds,
                "train_plus_publish_seconds": r.train_seconds,
                "engine_generate_seconds": r.engine_gen_seconds,
                **{name: getattr(r, name) for name in STEP_MEANS},
                **({"in_flight_speedup": self.in_flight_speedup(lag)} if fly else {})}


def measure_pipeline(workload: str, overrides: list[str], out_dir: Path, measured_steps: int,
                     lags: tuple[int, ...] = (0, 1, 2), reference: str = "one-core",
                     in_flight_lags: tuple[int, ...] = ()) -> PipelineResult:
    """The one-core reference run, then a run at each max_lag in `lags`, then one with
    in-flight weight updates at each max_lag in `in_flight_lags`, with the demo config plus
    `overrides`; Ray must already be running (the runs share it). reference "max_lag 0" (one
    shared GPU): no reference run, the max_lag 0 run (which `lags` must hold) is the
    reference; "none": no reference at all (the module's docstring)."""
    if 0 in in_flight_lags:  # the config refuses it too, but only once the runs before it ran
        raise ValueError("in-flight weight updates need max_lag >= 1 (at max_lag 0 nothing is "
                         f"in flight at an update): in_flight_lags {in_flight_lags}")
    if reference not in REFERENCES:
        raise ValueError(f"reference {reference!r}: one of {', '.join(REFERENCES)}")
    if reference == "max_lag 0" and 0 not in lags:
        raise ValueError("without the one-core run the max_lag 0 run is the reference: "
                         f"lags {lags}")
    cores = int(load_train_config(DEMO_CONFIG, overrides).reserved_cpus)  # the run's cores
    if reference == "one-core":
        one_core = _measure(workload, [*overrides, *ONE_THREAD], out_dir, measured_steps, 0,
                            "-1core")
        result = PipelineResult(workload, one_core, cores=cores)
    runs = [_measure(workload, overrides, out_dir, measured_steps, lag, "") for lag in lags]
    if reference == "max_lag 0":
        result = PipelineResult(workload, runs[lags.index(0)], cores=1, reference=reference)
    elif reference == "none":
        result = PipelineResult(workload, None, cores=cores, reference=reference)
    runs += [_measure(workload, [*overrides, IN_FLIGHT], out_dir, measured_steps, lag,
                      "-inflight", in_flight=True) for lag in in_flight_lags]
    result.runs.extend(runs)
    return result


def _measure(workload: str, overrides: list[str], out_dir: Path, measured_steps: int, lag: int,
             suffix: str, in_flight: bool = False) -> LagRun:
    """One run at `lag`: the means of its measured steps."""
    warmup = lag + 2
    cfg = load_train_config(DEMO_CONFIG, [
        *overrides, f"max_lag={lag}", f"total_steps={warmup + measured_steps + 1}",
        f"output_dir={out_dir}", f"run_name={workload}-lag{lag}{suffix}", "checkpoint_every=0",
        # Evaluation only at the start and the end (both outside the measured steps).
        "eval_every=0", "eval.num_problems=8", "eval.samples=0", "eval.out_of_domain=null",
        "logging.wandb_mode=disabled"])
    assert cfg.rollout.generation.name == ("continuous" if in_flight else "batch"), \
        (suffix, overrides)
    run_dir, _ = train(cfg)
    rows = [m for m in read_metrics(run_dir) if warmup < m["step"] <= warmup + measured_steps]
    assert len(rows) == measured_steps, f"{run_dir}: expected {measured_steps} measured steps"

    def mean(key, rows=rows):
        return statistics.fmean(m.get(key, 0.0) for m in rows)

    return LagRun(
        max_lag=lag, steps=len(rows), step_seconds=mean("time/step"),
        samples_per_step=cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt,
        gen_seconds=mean("time/wait_for_rollouts"),
        train_seconds=mean("time/train") + mean("time/weight_publish"),
        engine_gen_seconds=mean("time/generate"), in_flight=in_flight,
        **{name: step_mean(rows, key) for name, key in STEP_MEANS.items()})


def step_mean(rows: list[dict[str, Any]], key: str) -> float | None:
    """The mean of `key` over the steps that logged it; None where none did."""
    values = [m[key] for m in rows if m.get(key) is not None]
    return statistics.fmean(values) if values else None
