"""Continuous generation with in-flight weight updates (`rollout.in_flight_updates: true`, with
its `rollout.stale_kv`): the engine generates continuously (continuous.py) and takes each weight
update between two engine steps while requests are in flight.

Several generate calls run at once on a worker (a Ray concurrency group of their own, max_lag + 1
threads), each waiting for the version it asks for (`min_version`: the version published last
when it was requested), beside `load_weights` and `evaluate`, which go through the same loop.
A weight load therefore waits behind nothing, and its sync.timeout_s counts from the publish.
"""
from __future__ import annotations

from actors.generation.base import EngineDriver, GenerationMode, Generated
from actors.generation.continuous import ContinuousEngine, split_samples

GENERATE_GROUP = "generate"  # the worker's concurrency group of generate calls


class Continuous(GenerationMode):
    """Owns in-flight updates: the generate calls' concurrency group and min_version, loads
    that queue behind nothing, the engine options and rules that keep each token's version
    exact, what it refuses (max_lag 0, LoRA), and the driver, a `ContinuousEngine`."""

    name = "continuous"
    summary = ("workers generate continuously and take each weight update between two engine "
               "steps while requests are in flight")

    @property
    def recomputes_stale_kv(self) -> bool:
        """stale_kv's one reading: True for recompute (an update preempts the running
        requests), False for keep (their KV stays, and the engine runs without a prefix
        cache)."""
        return self.stale_kv == "recompute"

    def check(self, *, enable_prefix_caching, engine_kwargs) -> None:
        if not self.recomputes_stale_kv and enable_prefix_caching:
            raise ValueError("rollout.stale_kv=keep needs rollout.enable_prefix_caching=false: "
                             "cached prefix blocks computed by older weights would be reused by "
                             "new requests (with recompute, the cache is reset at every update)")
        # Each token's version is the engine's at the step that returned it: that needs every
        # step's tokens returned by that step (`engine_options` sets both).
        if engine_kwargs.get("async_scheduling"):
            raise ValueError("rollout.engine_kwargs.async_scheduling=true is refused with "
                             "rollout.in_flight_updates: a batch still executing when the "
                             "weights change would return tokens of the old weights after "
                             "the update, tagged with the new version")
        if engine_kwargs.get("stream_interval", 1) != 1:
            raise ValueError("rollout.engine_kwargs.stream_interval must be 1 with "
                             "rollout.in_flight_updates: every step's tokens are tagged with "
                             "the version of that step")

    def check_run(self, *, max_lag, lora, multi_turn=False) -> None:
        """In-flight updates need batches in flight while the weights change (max_lag >= 1)
        and full-weight syncs: a LoRA adapter is served per request (vLLM's LoRARequest,
        actors/lora_serving.py), so a request in flight keeps the adapter it started with and
        no update could reach it. Every transport loads a version the same way in either mode
        (the load just runs sooner), so none is refused."""
        if multi_turn:
            raise ValueError("rollout.in_flight_updates with task.environment: multi-turn "
                             "episodes run batch-level only for now (actors/multi_turn.py: each "
                             "turn one engine call with the version the worker holds); drop "
                             "rollout.in_flight_updates, or task.environment.name")
        if max_lag == 0:
            raise ValueError("rollout.in_flight_updates with max_lag=0: generation and training "
                             "alternate, so no request is in flight when the weights change and "
                             "the option changes nothing; set max_lag >= 1, or drop "
                             "rollout.in_flight_updates")
        if lora:
            raise ValueError("rollout.in_flight_updates with learner.lora (a worker's "
                             "lora_rank): in_flight_updates does not support LoRA, as the "
                             "workers serve an adapter per request, so a request in flight "
                             "keeps the adapter it started with and cannot take a new version; "
                             "train the full weights (learner.lora: null), or drop "
                             "rollout.in_flight_updates")

    def engine_options(self, enable_prefix_caching):
        # Async scheduling off (GPU; CPU has none): a step must return the tokens it sampled,
        # for each to be tagged with its version. keep: no prefix cache, so that no new request
        # reuses KV an older version made (`check` refuses keep with the cache on).
        return {"async_scheduling": False,
                "enable_prefix_caching": enable_prefix_caching and self.recomputes_stale_kv}

    def concurrency_groups(self, max_lag):
        return {GENERATE_GROUP: max_lag + 1}  # the max_lag + 1 batches in flight side by side

    def call_options(self, method):
        return {"concurrency_group": GENERATE_GROUP} if method == "generate" else {}

    def min_version_args(self, version):
        return (version,)

    def loads_queue_behind(self, in_flight):
        return ()  # applied between two engine steps while the batches are generated

    def driver(self, llm, executor, version) -> ContinuousDriver:
        return ContinuousDriver(ContinuousEngine(llm, executor, version=version,
                                                 recompute=self.recomputes_stale_kv))


class ContinuousDriver(EngineDriver):
    """A `ContinuousEngine`: from its start the loop holds the engine thread, and every engine
    call goes through it."""

    def __init__(self, engine: ContinuousEngine):
        self.engine = engine

    def call(self, fn):
        return self.engine.call(fn)

    def generate(self, prompts, params, *, min_version, serving) -> Generated:
        """Each sample is a request of its own (n=1, the seed vLLM would give it:
        `split_samples`), so it leaves the engine as soon as it finishes. gen_seconds: from the
        first request entering the engine to the last one leaving it."""
        per_prompt = [split_samples(p) for p in params]
        done = self.engine.generate([pr for pr, ps in zip(prompts, per_prompt) for _ in ps],
                                    [one for ps in per_prompt for one in ps],
                                    min_version=min_version)
        gen_s = (max(c.finished_at for c in done) - min(c.added_at for c in done)) if done else 0.0
        grouped, i = [], 0
        for ps in per_prompt:
            grouped.append(done[i:i + len(ps)])
            i += len(ps)
        return Generated(grouped, gen_s, self.engine.version)

    def offline(self, use):
        return use(self.engine.facade())  # on this thread: its requests go through the loop

    def update(self, reload, version):
        return self.engine.update(reload, version)

    def busy_seconds(self) -> float:
        return self.engine.stats()["step_s"]

    def stop(self) -> None:
        self.engine.stop()
