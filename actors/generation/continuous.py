"""`ContinuousEngine`: a vLLM engine that generates continuously and takes weight updates between
two engine steps while requests are in flight (the continuous generation mode, in_flight.py).

One loop drives the engine (vLLM's V1 `LLMEngine`: add_request / step / abort_request /
reset_prefix_cache) on the thread the engine was built on; other threads hand it commands
through a queue: requests to add (from any number of concurrent callers), a function to run
between two steps (`call`), a weight update (`update`). With nothing to do the loop blocks on
the queue: no spinning (a worker's CPU share is small).

What each token carries. Every request asks for its outputs as deltas (RequestOutputKind.DELTA),
so each step returns exactly the tokens that step sampled (one per running request; vLLM's
stream_interval is 1), and each is tagged with the engine's policy version at that step and its
sampled log-prob from that step (the request asks for logprobs=0: the sampled token's, in vLLM's
flat lists, actors/outputs.py). The tags are exact because a step is the unit of work: the
engine core runs in this process (no engine-core process stepping on its own) and without async
scheduling (no batch still executing when `step` returns); both are checked at construction.

A weight update runs between two steps: the transport's reload, then, with `recompute`, vLLM's
`reset_prefix_cache(reset_running_requests=True)`: every running request is preempted (its KV
blocks freed, its prefix cache hashes dropped) and rescheduled at the next step, which prefills
prompt + tokens so far with the new weights and samples the next token. Nothing is dropped: vLLM
keeps the request's tokens and its seeded sampler (the model runner keeps a preempted request's
torch.Generator), so with unchanged weights the sample is the uninterrupted one
(tests/test_continuous.py). Each token is then sampled by exactly one policy version, over a
KV cache of that version. Without `recompute` ("keep") the running requests keep the KV their
prefix was computed with, and later tokens are sampled by the new weights over that cache; the
engine must then run without prefix caching, so that no new request reuses blocks of older
weights (with recompute the reset empties the cache at every update).

That is the CPU engine's model runner, which the tests run. On a GPU, vLLM 0.26 runs dense models
on Model Runner V2 (read in its source, not yet run here): it samples with Gumbel noise keyed
by (request seed, position) rather than a per-request generator, and re-sends a preempted request
as a new one, so recompute there goes through code the CPU tests never reach. The gpu-marked
tests/test_in_flight_gpu.py checks the per-token versions and log-probs on that path.
"""
from __future__ import annotations

import concurrent.futures
import functools
import itertools
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from actors.generation.base import Completion
from actors.outputs import sampled_logprobs


def _stop_at_exit(engine_ref: weakref.ref) -> None:
    """Python's exit is under way: stop the loop (if its engine still exists), so that the
    exit's join of the engine thread returns (`ContinuousEngine.__init__`)."""
    engine = engine_ref()
    if engine is not None:
        engine._commands.put(("stop", None, concurrent.futures.Future()))


def split_samples(params) -> list:
    """The n=1 requests that sample what one request with `params.n` samples would: vLLM seeds
    sample j of a seeded request with seed + j (its ParentRequest), so each sample becomes a
    request of its own with that seed, finishing and leaving the engine on its own."""
    out = []
    for j in range(params.n):
        one = params.clone()
        one.n = 1
        if params.seed is not None:
            one.seed = params.seed + j
        out.append(one)
    return out


@dataclass
class _Job:
    """Requests of one caller: their results and the future that delivers them."""

    prompts: Sequence[Any]
    params: Sequence[Any]
    stream: bool                      # True: DELTA outputs -> Completions; False: RequestOutputs
    min_version: int
    future: concurrent.futures.Future
    results: list = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    remaining: int = 0


class ContinuousEngine:
    """Drives `llm`'s engine continuously on `executor`'s one thread (the thread that built it:
    see actors/rollout_worker.py on why every engine call stays there) until `stop`; the
    continuous mode's driver (in_flight.py) is this engine.

    version: the policy version of the weights the engine holds now. recompute: the stale-KV
    choice at an update (module docstring; False is "keep", which needs an engine built with
    enable_prefix_caching=False). Every method may be called from any thread.
    """

    def __init__(self, llm, executor: concurrent.futures.Executor, *, version: int = 0,
                 recompute: bool = True):
        engine = llm.llm_engine
        config = engine.vllm_config
        if type(engine.engine_core).__name__ != "InprocClient":
            raise ValueError("in-flight weight updates need the engine core in the worker's "
                             "process (VLLM_ENABLE_V1_MULTIPROCESSING=0, klrl's default): an "
                             "engine-core process steps on its own, so a step's tokens could "
                             "not be tagged with the version that sampled them")
        if config.scheduler_config.async_scheduling:
            raise ValueError("in-flight weight updates need async scheduling off: a batch "
                             "still executing at an update would return old weights' tokens")
        if getattr(config.scheduler_config, "stream_interval", 1) != 1:
            raise ValueError("in-flight weight updates need vLLM's stream_interval 1")
        if not recompute and config.cache_config.enable_prefix_caching:
            raise ValueError("stale_kv keep needs an engine without prefix caching: new "
                             "requests would reuse blocks computed by older weights")
        self.llm, self._engine, self._recompute = llm, engine, recompute
        self._version = version
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # Invariant: the loop never outlives its process's exit. Python's exit joins the
        # engine thread (a concurrent.futures worker) before atexit handlers run, so a loop
        # blocked on the queue would keep the process, and its engine's memory, alive after Ray
        # let it go: a graceful exit, as when the raylet went away before ray.kill landed, left
        # orphaned workers. Hooks registered here run before those joins (concurrent.futures
        # registers its own the same way, earlier, and they run in reverse order).
        threading._register_atexit(functools.partial(_stop_at_exit, weakref.ref(self)))
        self._gate = threading.Lock()      # `_closed` and putting a command, atomically
        self._closed: str | None = None    # why no command is taken any more
        self._ids = itertools.count()
        self._in_flight: dict[str, tuple[_Job, int]] = {}   # request id -> (job, index)
        self._sampled: set[str] = set()   # requests in flight that have sampled a token
        self._deferred: list[_Job] = []   # jobs waiting for a version >= their min_version
        self._stats = {"steps": 0, "tokens": 0, "updates": 0, "preempted": 0,
                       "idle_s": 0.0, "step_s": 0.0}
        self._loop = executor.submit(self._run)

    # ------------------------------------------------------------------ callers' side

    @property
    def version(self) -> int:
        """Policy version of the weights the engine steps with now."""
        return self._version

    def generate(self, prompts: Sequence[Any], params: Sequence[Any], *,
                 min_version: int = 0) -> list[Completion]:
        """One Completion per (prompt, SamplingParams with n=1), in order, once all finished.
        The requests enter the engine once it holds a version >= min_version (at once if it
        does), beside every other request in flight."""
        if any(p.n != 1 for p in params):
            raise ValueError("ContinuousEngine.generate takes n=1 requests (split_samples)")
        return self._submit(prompts, params, stream=True, min_version=min_version).result()

    def run(self, prompts: Sequence[Any], params: Sequence[Any]) -> list:
        """vLLM's final RequestOutput of each (prompt, SamplingParams), in order, as
        `LLM.generate` returns them (any n), generated beside the requests in flight."""
        return self._submit(prompts, params, stream=False, min_version=0).result()

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """fn() run by the loop between two engine steps; its result or exception."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._put(("call", fn, future))
        return future

    def update(self, reload: Callable[[], dict[str, float] | None],
               version: int) -> concurrent.futures.Future:
        """Apply a weight update between two engine steps: reload() (loads the weights into
        the engine; returns seconds by part, or None), then the stale-KV handling, then
        `version` is the engine's: every later step's tokens carry it. The future's result:
        reload's seconds with "cache_reset" (the reset's) and "step_wait" (waiting for the
        step under way). If reload raises, every request in flight or waiting fails with a
        RuntimeError (the engine may hold a mix of versions) and the version stays."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._put(("update", (reload, version, time.perf_counter()), future))
        return future

    def facade(self) -> EngineFacade:
        """An `LLM`-like view whose generate goes through this loop (evaluation)."""
        return EngineFacade(self)

    def stats(self) -> dict[str, float]:
        """Counters since the start: engine steps, tokens returned, updates applied, requests
        preempted by an update (recompute), and seconds idle (no request in the engine) and
        stepping."""
        return dict(self._stats)

    def stop(self, timeout: float | None = None) -> None:
        """Abort every request (their callers get RuntimeError) and end the loop."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            self._put(("stop", None, future))
        except RuntimeError:
            return  # already stopped
        future.result(timeout)

    def _submit(self, prompts, params, *, stream: bool, min_version: int):
        if len(prompts) != len(params):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        job = _Job(prompts, params, stream, min_version, concurrent.futures.Future())
        self._put(("add", job, job.future))
        return job.future

    def _put(self, command) -> None:
        with self._gate:
            if self._closed is not None:
                raise RuntimeError(f"the continuous engine is not running: {self._closed}")
            self._commands.put(command)

    # ------------------------------------------------------------------ the loop (engine thread)

    def _run(self) -> None:
        stop_future = None
        try:
            while stop_future is None:
                busy = self._engine.has_unfinished_requests()
                stop_future = self._take_commands(block=not busy)
                if stop_future is None and self._engine.has_unfinished_requests():
                    t0 = time.perf_counter()
                    outputs = self._engine.step()
                    self._stats["step_s"] += time.perf_counter() - t0
                    self._stats["steps"] += 1
                    self._dispatch(outputs)
        except BaseException as e:
            self._close(f"it failed: {type(e).__name__}: {e}")
            raise
        self._close("it was stopped")
        stop_future.set_result(None)

    def _take_commands(self, block: bool):
        """Handle every queued command (waiting for one if `block`); the stop command's future
        if one came."""
        while True:
            try:
                if block:
                    t0 = time.perf_counter()
                    command = self._commands.get()
                    self._stats["idle_s"] += time.perf_counter() - t0
                    block = False
                else:
                    command = self._commands.get_nowait()
            except queue.Empty:
                return None
            kind, arg, future = command
            if kind == "stop":
                return future
            if kind == "add":
                if arg.min_version > self._version:
                    self._deferred.append(arg)
                else:
                    self._add(arg)
            elif kind == "call":
                _run_into(future, arg)
            else:
                self._update(*arg, future)

    def _add(self, job: _Job) -> None:
        from vllm.sampling_params import RequestOutputKind

        kind = RequestOutputKind.DELTA if job.stream else RequestOutputKind.FINAL_ONLY
        now = time.perf_counter()
        try:
            for i, (prompt, params) in enumerate(zip(job.prompts, job.params)):
                params = params.clone()
                params.output_kind = kind
                request_id = f"klrl-{next(self._ids)}"
                self._engine.add_request(request_id, prompt, params)
                job.ids.append(request_id)
                job.results.append(Completion(submitted_version=self._version, added_at=now)
                                   if job.stream else None)
                self._in_flight[request_id] = (job, i)
        except BaseException as e:  # a request vLLM refuses (too long, say): none of the job
            self._abort(job)
            job.future.set_exception(e)
            return
        job.remaining = len(job.ids)
        if not job.ids:
            job.future.set_result([])

    def _dispatch(self, outputs) -> None:
        version, now = self._version, time.perf_counter()
        for out in outputs:
            entry = self._in_flight.get(out.request_id)
            if entry is None:  # aborted (its job failed) after the step had sampled it
                continue
            job, i = entry
            if out.outputs and out.outputs[0].token_ids:
                self._sampled.add(out.request_id)
            if job.stream:
                c, done = out.outputs[0], job.results[i]
                new = c.token_ids
                done.token_ids.extend(new)
                done.versions.extend([version] * len(new))
                if c.logprobs is not None:
                    done.logprobs.extend(sampled_logprobs(c))
                done.text += c.text
                self._stats["tokens"] += len(new)
                if out.finished:
                    done.finish_reason, done.finished_at = str(c.finish_reason), now
            elif out.finished:
                job.results[i] = out
            if out.finished:
                del self._in_flight[out.request_id]
                self._sampled.discard(out.request_id)
                job.remaining -= 1
                if job.remaining == 0:
                    job.future.set_result(job.results)

    def _update(self, reload, version: int, asked_at: float, future) -> None:
        t0 = time.perf_counter()
        try:
            seconds = dict(reload() or {})
            t1 = time.perf_counter()
            if self._recompute:  # every running request is preempted: counted per request
                hit = preempted(self._in_flight, self._sampled)
                self._stats["preempted"] += len(hit)
                for job, i in hit:
                    if job.stream:
                        job.results[i].preemptions += 1
                if not self._engine.reset_prefix_cache(reset_running_requests=True):
                    raise RuntimeError("vLLM could not reset its prefix cache")
            # keep: the engine has no prefix cache (checked at construction), nothing to reset.
        except BaseException as e:
            self._fail_everything(RuntimeError(
                f"the weight reload to version {version} failed with requests in flight "
                f"({type(e).__name__}: {e}); the engine may hold a mix of versions"))
            future.set_exception(e)
            return
        self._version = version
        self._stats["updates"] += 1
        ready = [j for j in self._deferred if j.min_version <= version]
        self._deferred = [j for j in self._deferred if j.min_version > version]
        for job in ready:
            self._add(job)
        future.set_result(seconds | {"cache_reset": time.perf_counter() - t1,
                                     "step_wait": t0 - asked_at})

    def _abort(self, job: _Job) -> None:
        ids = [r for r in job.ids if r in self._in_flight]
        for r in ids:
            del self._in_flight[r]
            self._sampled.discard(r)
        if ids:
            self._engine.abort_request(ids)

    def _fail_everything(self, error: BaseException) -> None:
        jobs = {id(j): j for j, _ in self._in_flight.values()} | {id(j): j for j in self._deferred}
        self._deferred = []
        for job in jobs.values():
            self._abort(job)
            if not job.future.done():
                job.future.set_exception(error)

    def _close(self, why: str) -> None:
        """No more commands; every request and command not done fails."""
        with self._gate:
            self._closed = why
        error = RuntimeError(f"the continuous engine stopped: {why}")
        try:
            self._fail_everything(error)
        finally:
            while True:
                try:
                    kind, arg, future = self._commands.get_nowait()
                except queue.Empty:
                    break
                if kind == "stop":
                    future.set_result(None)
                elif not future.done():
                    future.set_exception(error)


def preempted(in_flight: dict[str, Any], sampled: set[str]) -> list[Any]:
    """The entries of `in_flight` (request id -> what it belongs to) that an update with
    `stale_kv: recompute` preempts, as counted in `rollout/preempted`: those that have sampled
    a token (`sampled`). A request still waiting for the scheduler loses nothing, and one
    whose prompt is still being prefilled has sampled no token of the old weights (it
    recomputes a prefill, not counted): counting every request in flight made an update that
    met a queue look like one that met running samples."""
    return [entry for request_id, entry in in_flight.items() if request_id in sampled]


class EngineFacade:
    """What `actors.evaluate` needs of a `vllm.LLM` (generate, get_tokenizer), served by a
    ContinuousEngine: `LLM.generate` itself must not run while the loop has requests in
    flight, as its own step loop would take (and drop) their outputs."""

    def __init__(self, engine: ContinuousEngine):
        self._engine = engine

    def generate(self, prompts, sampling_params, *, use_tqdm: bool = False) -> list:
        if not isinstance(sampling_params, (list, tuple)):
            sampling_params = [sampling_params] * len(prompts)
        return self._engine.run(list(prompts), list(sampling_params))

    def get_tokenizer(self):
        return self._engine.llm.get_tokenizer()


def _run_into(future: concurrent.futures.Future, fn: Callable[[], Any]) -> None:
    try:
        future.set_result(fn())
    except BaseException as e:
        future.set_exception(e)
