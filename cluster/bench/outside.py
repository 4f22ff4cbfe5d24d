"""The rollout's cost outside the engine at a fixed shape, for `klrl bench`: one
`RolloutWorker.generate` call of 256 samples (32 prompts x 8) of exactly 64 new tokens.

The worker is `RolloutWorker` itself with bench-only hooks (`TimedRolloutWorker`): its requests
cannot end before max_new_tokens (vLLM's `min_tokens` set to `max_tokens`: the end-of-sequence
token and the stop strings are ignored until then, so every sample has 64 tokens whatever
the model would have said), and `generate` notes when the engine call starts and ends and
how long scoring takes. With the driver's round trip that splits one call into:

    requests  the call's start in the actor -> the engine call (SamplingParams per prompt,
              the prompts rendered to token ids);
    engine    `vllm.LLM.generate` (the worker's own `RolloutBatch.gen_seconds`);
    scoring   the task's scorer on every completion (the scoring pool);
    records   the rest of `generate` after the engine: the Rollout records, the RolloutBatch;
    ray_trip  the driver's round trip minus the actor's time in `generate`: submitting the
              call, pickling 256 Rollouts, the transfer, unpickling in the driver.

outside engine = round trip - engine = requests + scoring + records + ray_trip; "unscored" leaves
scoring out (the task's scorer is the user's code: what remains is klrl's own). Each figure
is the median over `reps` timed calls (after `warmup` untimed ones), so the parts' medians
need not add up to the total's exactly. No learner and no raw baseline: the engine table has
the ratio at the demo's own shape.
"""
from __future__ import annotations

import statistics
import time
from typing import Any

from actors.rollout_worker import RolloutWorker
from cluster.bench.engines import WARMUP_REPS
from cluster.train.worker_pool import start_worker

# The workload's shape, as overrides of the demo config.
SHAPE = ("rollout.prompts_per_step=32", "rollout.samples_per_prompt=8", "rollout.max_new_tokens=64")
PARTS = ("requests", "scoring", "records", "ray_trip")


class _ForcedLength:
    """The worker's engine with every request held to its max_tokens; notes when the engine
    call starts and ends in `marks`."""

    def __init__(self, llm, marks: dict[str, float]):
        self._llm, self._marks = llm, marks

    def generate(self, prompts, params, **kwargs):
        for p in params:  # one SamplingParams per prompt (actors.engine.request_params)
            p.min_tokens = p.max_tokens
        self._marks["engine_start"] = time.perf_counter()
        try:
            return self._llm.generate(prompts, params, **kwargs)
        finally:
            self._marks["engine_end"] = time.perf_counter()


class TimedRolloutWorker(RolloutWorker):
    """`RolloutWorker` for the fixed-shape workload (module docstring): the same `generate`,
    with its requests forced to max_new_tokens and its time split into parts. Bench only."""

    def __init__(self, *args, **kwargs):
        self._marks: dict[str, float] = {}
        self.last_parts: dict[str, float] = {}
        super().__init__(*args, **kwargs)

    def generate(self, problems: list, group_ids: list[int], seed: int):
        self._marks = {"scoring": 0.0}
        t0 = time.perf_counter()
        batch = super().generate(problems, group_ids, seed)
        t1 = time.perf_counter()
        m = self._marks
        self.last_parts = {"requests": m["engine_start"] - t0, "scoring": m["scoring"],
                           "records": t1 - m["engine_end"] - m["scoring"], "in_actor": t1 - t0}
        return batch

    def generate_parts(self) -> dict[str, float]:
        """Seconds by part of the last `generate` (requests, scoring, records, in_actor)."""
        return dict(self.last_parts)

    def _serving(self, llm):
        return _ForcedLength(super()._serving(llm), self._marks)

    def _score(self, problems, texts):
        t0 = time.perf_counter()
        try:
            return super()._score(problems, texts)
        finally:
            self._marks["scoring"] += time.perf_counter() - t0


def measure_outside(name: str, cfg, problems: list, reps: int,
                    warmup: int = WARMUP_REPS) -> dict[str, Any]:
    """The fixed-shape workload on a `TimedRolloutWorker` actor built from TrainConfig `cfg`
    (its rollout section sets the shape: `SHAPE`) generating `problems`; Ray must be running.
    Raises if a call does not generate exactly prompts x samples x max_new_tokens tokens."""
    import ray

    r = cfg.worker_rollout  # dtype and threads resolved, as the worker gets them
    # as a run starts it
    worker = start_worker(cfg, cfg.model.path, 0, worker_class=TimedRolloutWorker)
    samples = len(problems) * r.samples_per_prompt
    rows = []
    try:
        ray.get(worker.version.remote())
        group_ids = list(range(len(problems)))
        for rep in range(warmup + reps):
            t0 = time.perf_counter()
            batch = ray.get(worker.generate.remote(problems, group_ids, rep))
            total = time.perf_counter() - t0
            parts = ray.get(worker.generate_parts.remote())
            if batch.num_response_tokens != samples * r.max_new_tokens:
                raise RuntimeError(f"{name}: {batch.num_response_tokens} tokens generated, not "
                                   f"{samples} x {r.max_new_tokens}: the forced length failed")
            if rep >= warmup:
                rows.append({"klrl": total, "engine": batch.gen_seconds,
                             "outside": total - batch.gen_seconds,
                             "unscored": total - batch.gen_seconds - parts["scoring"],
                             "ray_trip": total - parts.pop("in_actor"), **parts})
    finally:
        stop_worker(worker)

    def ms(key: str) -> float:
        return statistics.median(row[key] for row in rows) * 1e3

    return {"workload": name, "prompts": len(problems), "samples": samples,
            "new_tokens": r.max_new_tokens, "tokens": samples * r.max_new_tokens, "reps": reps,
            "klrl_ms": ms("klrl"), "engine_ms": ms("engine"), "outside_engine_ms": ms("outside"),
            "outside_engine_unscored_ms": ms("unscored"),
            "parts_ms": {p: ms(p) for p in PARTS}}


def stop_worker(worker) -> None:
    """Shut a rollout worker actor down (engine and scoring pool), then kill it."""
    import ray

    if worker is None:
        return
    try:
        ray.get(worker.shutdown.remote(), timeout=60)
    finally:
        ray.kill(worker, no_restart=True)
