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

On one GPU shared by the learner and the rollout worker (`one_core=False`, `klrl bench
--device cuda`) there are no cores to split: the reference is the max_lag 0 run itself, where
generation and training alternate on the GPU, and the GPU counts as the one "core". Then the
bound is batch / (T_gen + T_train) of that run, and the ideal at max_lag >= 1 is batch /
max(T_gen, T_train): the two phases overlapping perfectly, which their contention for the
one GPU prevents in part.
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

ONE_THREAD = ("rollout.threads_per_worker=1", "learner.threads_per_rank=1")


@dataclass
class LagRun:
    """One end-to-end run's measured means at one max_lag (its steps after the warm-up)."""

    max_lag: int
    steps: int                 # measured steps
    step_seconds: float        # mean time/step over them
    samples_per_step: int
    gen_seconds: float         # mean time/wait_for_rollouts
    train_seconds: float       # mean time/train + time/weight_publish
    engine_gen_seconds: float  # mean time/generate (inside vLLM)

    @property
    def samples_per_s(self) -> float:
        return self.samples_per_step / self.step_seconds


@dataclass
class PipelineResult:
    """A workload's end-to-end runs: the reference run and one per max_lag, from which the
    ideal overlap, the efficiency and the bound follow."""

    workload: str
    # the reference run: max_lag 0, one thread per part (GPU: the max_lag 0 run)
    one_core: LagRun
    cores: int                 # CPU cores the run has (GPU: 1, the one GPU)
    runs: list[LagRun] = field(default_factory=list)
    reference: str = "one-core"  # "one-core", or "max_lag 0" (one shared GPU)

    def run(self, lag: int) -> LagRun:
        return next(r for r in self.runs if r.max_lag == lag)

    @property
    def t_gen(self) -> float:
        return self.one_core.gen_seconds

    @property
    def t_train(self) -> float:
        return self.one_core.train_seconds

    @property
    def bound_samples_per_s(self) -> float:
        return self.one_core.samples_per_step * self.cores / (self.t_gen + self.t_train)

    def ideal_samples_per_s(self, lag: int) -> float:
        if lag == 0:
            return self.bound_samples_per_s
        return self.run(lag).samples_per_step / max(self.t_gen, self.t_train)

    def efficiency(self, lag: int) -> float:
        return self.run(lag).samples_per_s / self.ideal_samples_per_s(lag)

    def of_bound(self, lag: int) -> float:
        return self.run(lag).samples_per_s / self.bound_samples_per_s

    @property
    def best_lag(self) -> int:
        return max(self.runs, key=lambda r: r.samples_per_s).max_lag

    def to_dict(self) -> dict[str, Any]:
        return {"workload": self.workload, "reference": self.reference, "t_gen_seconds": self.t_gen,
                "t_train_seconds": self.t_train, "cores": self.cores,
                "bound_samples_per_s": self.bound_samples_per_s,
                "one_core_samples_per_s": self.one_core.samples_per_s,
                "best_lag": self.best_lag,
                "runs": [{"max_lag": r.max_lag, "measured_steps": r.steps,
                          "step_seconds": r.step_seconds, "samples_per_step": r.samples_per_step,
                          "samples_per_s": r.samples_per_s,
                          "ideal_samples_per_s": self.ideal_samples_per_s(r.max_lag),
                          "overlap_efficiency": self.efficiency(r.max_lag),
                          "of_bound": self.of_bound(r.max_lag),
                          "wait_for_rollouts_seconds": r.gen_seconds,
                          "train_plus_publish_seconds": r.train_seconds,
                          "engine_generate_seconds": r.engine_gen_seconds} for r in self.runs]}


def measure_pipeline(workload: str, overrides: list[str], out_dir: Path, measured_steps: int,
                     lags: tuple[int, ...] = (0, 1, 2), one_core: bool = True) -> PipelineResult:
    """The one-core reference run, then a run at each max_lag in `lags`, with the demo config
    plus `overrides`; Ray must already be running (the runs share it). one_core=False (one
    shared GPU): no reference run, the max_lag 0 run (which `lags` must hold) is the reference."""
    if one_core:
        reference = _measure(workload, [*overrides, *ONE_THREAD], out_dir, measured_steps, 0,
                             "-1core")
        cores = load_train_config(DEMO_CONFIG, overrides).reserved_cpus  # the cores the run has
        result = PipelineResult(workload, reference, cores=int(cores))
    elif 0 not in lags:
        raise ValueError("without the one-core run the max_lag 0 run is the reference: "
                         f"lags {lags}")
    runs = [_measure(workload, overrides, out_dir, measured_steps, lag, "") for lag in lags]
    if not one_core:
        result = PipelineResult(workload, runs[lags.index(0)], cores=1, reference="max_lag 0")
    result.runs.extend(runs)
    return result


def _measure(workload: str, overrides: list[str], out_dir: Path, measured_steps: int, lag: int,
             suffix: str) -> LagRun:
    """One run at `lag`: the means of its measured steps."""
    warmup = lag + 2
    cfg = load_train_config(DEMO_CONFIG, [
        *overrides, f"max_lag={lag}", f"total_steps={warmup + measured_steps + 1}",
        f"output_dir={out_dir}", f"run_name={workload}-lag{lag}{suffix}", "checkpoint_every=0",
        # Evaluation only at the start and the end (both outside the measured steps).
        "eval_every=0", "eval.num_problems=8", "eval.samples=0", "eval.out_of_domain=null",
        "logging.wandb_mode=disabled"])
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
        engine_gen_seconds=mean("time/generate"))
