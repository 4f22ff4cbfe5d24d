"""End-to-end throughput and overlap efficiency for `klrl bench`.

Each max_lag runs the real trainer (`cluster.train.run.train`) for warm-up + measured + 1
steps and reads its metrics.jsonl. Only the measured steps count: start-up, the initial
evaluation, the steps that fill the pipeline (max_lag + 2 warm-up steps) and the last step
(it includes the final evaluation) are left out.

The ideal comes from the max_lag 0 run, where generation and training alternate, so each is
measured alone on the resources it has inside the pipeline (one core each here):
    T_gen   = time/wait_for_rollouts: the worker's weight load + generate + scoring, as the
              controller waits for it;
    T_train = time/train + time/weight_publish: advantages, batch, learner step, export.
Ideal samples/s = batch / (T_gen + T_train) at max_lag 0 and batch / max(T_gen, T_train) at
max_lag >= 1 (generation hidden behind training or the reverse); overlap efficiency =
measured samples/s / ideal.
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


@dataclass
class LagRun:
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
    workload: str
    runs: list[LagRun] = field(default_factory=list)

    def run(self, lag: int) -> LagRun:
        return next(r for r in self.runs if r.max_lag == lag)

    @property
    def t_gen(self) -> float:
        return self.run(0).gen_seconds

    @property
    def t_train(self) -> float:
        return self.run(0).train_seconds

    def ideal_samples_per_s(self, lag: int) -> float:
        n = self.run(lag).samples_per_step
        return n / (self.t_gen + self.t_train if lag == 0 else max(self.t_gen, self.t_train))

    def efficiency(self, lag: int) -> float:
        return self.run(lag).samples_per_s / self.ideal_samples_per_s(lag)

    def to_dict(self) -> dict[str, Any]:
        return {"workload": self.workload, "t_gen_seconds": self.t_gen,
                "t_train_seconds": self.t_train,
                "runs": [{"max_lag": r.max_lag, "measured_steps": r.steps,
                          "step_seconds": r.step_seconds, "samples_per_step": r.samples_per_step,
                          "samples_per_s": r.samples_per_s,
                          "ideal_samples_per_s": self.ideal_samples_per_s(r.max_lag),
                          "overlap_efficiency": self.efficiency(r.max_lag),
                          "wait_for_rollouts_seconds": r.gen_seconds,
                          "train_plus_publish_seconds": r.train_seconds,
                          "engine_generate_seconds": r.engine_gen_seconds} for r in self.runs]}


def measure_pipeline(workload: str, overrides: list[str], out_dir: Path, measured_steps: int,
                     lags: tuple[int, ...] = (0, 1, 2)) -> PipelineResult:
    """Train at each max_lag in `lags` (0 must be among them) with the demo config plus
    `overrides`; Ray must already be running (the runs share it)."""
    result = PipelineResult(workload)
    for lag in lags:
        warmup = lag + 2
        cfg = load_train_config(DEMO_CONFIG, [
            *overrides, f"max_lag={lag}", f"total_steps={warmup + measured_steps + 1}",
            f"output_dir={out_dir}", f"run_name={workload}-lag{lag}", "checkpoint_every=0",
            # Evaluation only at the start and the end (both outside the measured steps).
            "eval_every=0", "eval.num_problems=8", "eval.samples=0", "eval.out_of_domain=null",
            "logging.wandb_mode=disabled"])
        run_dir, _ = train(cfg)
        rows = [m for m in read_metrics(run_dir) if warmup < m["step"] <= warmup + measured_steps]
        assert len(rows) == measured_steps, f"{run_dir}: expected {measured_steps} measured steps"

        def mean(key, rows=rows):
            return statistics.fmean(m.get(key, 0.0) for m in rows)

        result.runs.append(LagRun(
            max_lag=lag, steps=len(rows), step_seconds=mean("time/step"),
            samples_per_step=cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt,
            gen_seconds=mean("time/wait_for_rollouts"),
            train_seconds=mean("time/train") + mean("time/weight_publish"),
            engine_gen_seconds=mean("time/generate")))
    return result
