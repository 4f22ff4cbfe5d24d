"""Batch-level generation (`rollout.in_flight_updates: false`, the default): a worker generates a
whole generate call with one policy version, and weight loads run between calls.

The worker actor stays serial (Ray's default, one call at a time): the controller relies on a
worker running `load_weights` and `generate` calls in the order they were sent, which is what
bounds the policy lag, so a load queues behind the generate calls sent before it.
"""
from __future__ import annotations

import concurrent.futures
import time

from actors.generation.base import Completion, EngineDriver, GenerationMode, Generated
from actors.outputs import sampled_logprobs


class BatchLevel(GenerationMode):
    """Owns the serial schedule: no concurrency group of its own, no min_version (a resumed
    run replays the same calls), loads behind the batches in flight, and the driver that runs
    each call on the engine thread in turn, resetting the prefix cache after each reload."""

    name = "batch"
    summary = "a worker generates a whole batch with one version"

    def check(self, *, enable_prefix_caching, engine_kwargs) -> None:
        if self.stale_kv != "recompute":
            raise ValueError(f"rollout.stale_kv={self.stale_kv} needs rollout.in_flight_updates: "
                             "without it no request is in flight at a weight update")

    def engine_options(self, enable_prefix_caching):
        return {"enable_prefix_caching": enable_prefix_caching}

    def concurrency_groups(self, max_lag):
        return {}

    def call_options(self, method):
        return {}

    def min_version_args(self, version):
        return ()  # the arguments (and order) of the calls stay those a resumed run replays

    def loads_queue_behind(self, in_flight):
        return in_flight

    def driver(self, llm, executor, version) -> BatchDriver:
        return BatchDriver(llm, executor, version)


class BatchDriver(EngineDriver):
    """Each call a job of its own on the engine thread; the engine holds one version at a time
    and generates with it, which must be at least the version a call asks for."""

    def __init__(self, llm, executor: concurrent.futures.Executor, version: int):
        self.llm, self._executor, self.version = llm, executor, version
        self._busy_s = 0.0  # seconds generating or evaluating

    def call(self, fn):
        return self._executor.submit(fn)

    def generate(self, prompts, params, *, min_version, serving) -> Generated:
        if min_version > self.version:
            raise ValueError(f"the engine holds policy version {self.version}, below the "
                             f"version asked for ({min_version})")
        t0 = time.perf_counter()
        outputs = self.call(
            lambda: serving(self.llm).generate(prompts, params, use_tqdm=False)).result()
        gen_s = time.perf_counter() - t0
        self._busy_s += gen_s
        version = self.version
        return Generated([[Completion(token_ids=list(c.token_ids), logprobs=sampled_logprobs(c),
                                      versions=None, text=c.text,
                                      finish_reason=str(c.finish_reason),
                                      submitted_version=version) for c in out.outputs]
                          for out in outputs], gen_s, version)

    def offline(self, use):
        t0 = time.perf_counter()
        try:
            return self.call(lambda: use(self.llm)).result()
        finally:  # the engine is busy evaluating
            self._busy_s += time.perf_counter() - t0

    def update(self, reload, version):
        def job() -> dict[str, float]:
            seconds = dict(reload() or {})
            # Cached prefix KV blocks were computed with the old weights. vLLM keeps them, and
            # says so only in a warning klrl's log level hides, when blocks are still held
            # (vLLM 0.26 returns False then): new prompts would reuse old-weight KV, so fail.
            t0 = time.perf_counter()
            if not self.llm.reset_prefix_cache():
                raise RuntimeError(
                    f"vLLM could not reset its prefix cache after the update to version "
                    f"{version} (KV blocks still held): the next requests would reuse KV of "
                    "the old weights")
            self.version = version
            return seconds | {"cache_reset": time.perf_counter() - t0}

        return self.call(job)

    def busy_seconds(self) -> float:
        return self._busy_s
