"""What every generation mode is: `GenerationMode` (what the config, the controller and the
worker pool ask of it) and `EngineDriver` (how a rollout worker drives its engine in that mode),
with the records a driver returns (`Completion`, `Generated`).

Nothing here imports Ray or vLLM at module level, nor actors/config.py: the config imports the
registry (registry.py), and the modes take the settings they read as arguments.
"""
from __future__ import annotations

import abc
import concurrent.futures
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

StaleKv = Literal["recompute", "keep"]  # rollout.stale_kv

# The engine-thread job of a weight update: loads the weights into the engine and returns
# the seconds spent by part (or None).
Reload = Callable[[], "dict[str, float] | None"]


@dataclass
class Completion:
    """One sample's response as the engine produced it.

    token_ids[t] has the sampled log-prob logprobs[t]. versions[t] is the policy version of the
    engine step that sampled token t (continuous generation); None when the whole response was
    sampled by one version, `submitted_version` (batch-level). text: vLLM's text ("" for a
    request with detokenize=False). submitted_version: the engine's version when the request
    entered it (the version of a response with no token). added_at, finished_at:
    time.perf_counter() when it entered and left the engine (continuous generation only).
    preemptions: how many weight updates preempted the request after it had sampled a token
    (continuous generation with stale_kv recompute: its KV freed and recomputed with the new
    weights; `continuous.preempted`).
    """

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] | None = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    submitted_version: int = 0
    added_at: float = 0.0
    finished_at: float = 0.0
    preemptions: int = 0

    @property
    def policy_version(self) -> int:
        """The version of the response's oldest token (of the request, when it has none)."""
        return self.versions[0] if self.versions else self.submitted_version


@dataclass(frozen=True)
class Generated:
    """What a driver's `generate` returns: for each prompt, its samples' Completions in order;
    the seconds inside the engine (`RolloutBatch.gen_seconds`); the engine's version as the
    call returned (the batch's version when it has no rollout)."""

    completions: list[list[Completion]]
    gen_seconds: float
    version: int

    @property
    def preempted(self) -> int:
        """Preemptions of the call's requests by weight updates (`RolloutBatch.preempted`)."""
        return sum(c.preemptions for done in self.completions for c in done)


class EngineDriver(abc.ABC):
    """Drives one vLLM engine on the thread that built it (see actors/rollout_worker.py on
    why every engine call stays there). Every method may be called from any thread."""

    @abc.abstractmethod
    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """fn() run on the engine thread (between two engine steps where the engine runs
        continuously); its result or exception."""

    @abc.abstractmethod
    def generate(self, prompts: Sequence[Any], params: Sequence[Any], *, min_version: int,
                 serving: Callable[[Any], Any]) -> Generated:
        """`params[i].n` samples of `prompts[i]` each, sampled with weights of a version >=
        `min_version`. serving(llm): the engine as requests must reach it (the LoRA adapter
        named in each request: `RolloutWorker._serving`)."""

    @abc.abstractmethod
    def offline(self, use: Callable[[Any], Any]) -> Any:
        """use(llm) with an `LLM`-like engine whose `generate` returns vLLM's RequestOutputs
        (evaluation), run where that engine may be driven; its result."""

    @abc.abstractmethod
    def update(self, reload: Reload, version: int) -> concurrent.futures.Future:
        """Apply a weight update: reload(), then what the mode does to cached KV; from then on
        the engine holds `version`. The future's result: reload's seconds by part, with
        "cache_reset" (and "step_wait", continuous generation: waiting for the step under
        way)."""

    @abc.abstractmethod
    def busy_seconds(self) -> float:
        """Seconds the engine has been busy since it started
        (`RolloutBatch.engine_busy_seconds`)."""

    def stop(self) -> None:
        """End what the driver runs on the engine thread (the engine itself stays)."""


class GenerationMode(abc.ABC):
    """One way of generating: what the config checks, how the controller schedules generate
    calls and weight loads, and which driver a rollout worker builds. Instances hold the
    mode's own settings (continuous: stale_kv), no run state.

    The class attributes say what the mode is, for the code that must choose without naming
    it (the docs' option table, `klrl bench`)."""

    name: ClassVar[str]
    summary: ClassVar[str]

    def __init__(self, stale_kv: StaleKv = "recompute"):
        self.stale_kv = stale_kv

    # ------------------------------------------------------------------ config

    @abc.abstractmethod
    def check(self, *, enable_prefix_caching: bool, engine_kwargs: Mapping[str, Any]) -> None:
        """Refuse (ValueError, naming the options) rollout settings this mode cannot take;
        RolloutConfig calls it."""

    def check_run(self, *, max_lag: int | None, lora: bool, multi_turn: bool = False) -> None:
        """Refuse (ValueError) a run this mode cannot serve: its max_lag (None: not known, a
        worker built by hand), whether the workers serve a LoRA adapter, whether samples are
        multi-turn episodes (task.environment). TrainConfig and the rollout worker call it."""

    @abc.abstractmethod
    def engine_options(self, enable_prefix_caching: bool) -> dict[str, Any]:
        """What the mode sets of the workers' vLLM engines (`make_llm`'s arguments)."""

    # ------------------------------------------------------------------ controller

    @abc.abstractmethod
    def concurrency_groups(self, max_lag: int) -> dict[str, int]:
        """The rollout worker actor's Ray concurrency groups the mode needs, by name."""

    @abc.abstractmethod
    def call_options(self, method: str) -> dict[str, Any]:
        """Ray `.options` of a call of the worker's `method` ({}: the default group)."""

    @abc.abstractmethod
    def min_version_args(self, version: int) -> tuple:
        """The trailing arguments of a generate call requested right after `version` was
        published: its min_version, or none."""

    @abc.abstractmethod
    def loads_queue_behind(self, in_flight: Sequence[Any]) -> Sequence[Any]:
        """The batches in flight (oldest first) a weight load published now waits behind on
        its worker: their generation must end before the load can start."""

    # ------------------------------------------------------------------ rollout worker

    @abc.abstractmethod
    def driver(self, llm, executor: concurrent.futures.Executor, version: int) -> EngineDriver:
        """The driver of `llm`, built on `executor`'s one thread, which holds `version`."""
