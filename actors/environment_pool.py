"""Where a multi-turn episode's environment runs (task.environment.pool): on threads of the
rollout worker (the default) or in a pool of Ray actors beside it. actors/multi_turn.py sends
each round of resets or steps (one per live episode) to one of them and takes the answers.

Both run the same `EnvironmentHost`, which holds the environments of the episodes it serves
(one instance per episode key) and answers each call with what the environment returned, the
error it raised (as text) and its seconds. Every round is under task.environment.turn_timeout_s
from its start; what is not answered by then costs its sample ("timeout"). An environment's
error costs its sample ("exception"); what it returns is checked by the episode runner.

- `EnvironmentThreads`: a daemon thread per call, in the worker's process. Nothing to start,
  and no round trip (a calculator's step takes microseconds). A step that hangs keeps its
  thread: Python cannot stop one.
- `EnvironmentPool`: `actors_per_worker` Ray actors started by the worker (they die with it),
  each running up to `concurrency` calls at once on threads of its own, with
  `cpus_per_actor` Ray CPUs. Episodes are dealt to the actors in turn and stay on theirs (an
  environment's state is in its actor). A tool that computes runs in a process of its own,
  not beside the engine; an actor with a call past the timeout is killed and replaced, and
  an actor that died is replaced: the samples whose environments were on it are dropped
  ("actor_lost"), never the run.

Both wait for the whole round before the next turn's engine call (batch-level generation:
docs/multi-turn.md), so a slow tool's time is on the step either way; `klrl bench`'s
environment part measures it.
"""
from __future__ import annotations

import concurrent.futures
import threading
import time
from dataclasses import dataclass
from typing import Any

from rewards import Problem
from rewards.config import EnvironmentConfig
from rewards.environment import Environment, Turn, environment_class


START_TIMEOUT_S = 120  # an environment actor's start (a Python process importing its module)


@dataclass(frozen=True)
class EnvAnswer:
    """One call's outcome: what the environment returned (None for a reset), or why the
    sample failed ("reason: detail", reason one of rewards.environment.FAILURE_REASONS), and
    the seconds it took."""

    out: Any = None
    failure: str | None = None
    seconds: float = 0.0


class EnvironmentHost:
    """The environments of the episodes sent here, by episode key; a Ray actor in the pool, a
    plain object under threads. An environment's exception is answered as text (a class
    that cannot be pickled never leaves the host)."""

    def __init__(self, name: str, options: dict[str, Any]):
        self.env_class = environment_class(name)
        self.options = options
        self.envs: dict[int, Environment] = {}

    def reset(self, key: int, problem: Problem) -> tuple[None, str | None, float]:
        def start():
            env = self.env_class(**self.options)
            env.reset(problem)
            self.envs[key] = env
        return self._timed(start)

    def step(self, key: int, turn: Turn) -> tuple[Any, str | None, float]:
        return self._timed(lambda: self.envs[key].step(turn))

    def close(self, keys: list[int]) -> None:
        for key in keys:
            self.envs.pop(key, None)

    @staticmethod
    def _timed(fn) -> tuple[Any, str | None, float]:
        t0 = time.monotonic()
        try:
            out = fn()
        except Exception as exc:  # noqa: BLE001 - the environment's code: it costs the sample
            return None, f"exception: {type(exc).__name__}: {exc}"[:300], time.monotonic() - t0
        return out, None, time.monotonic() - t0


def _timeout(seconds: float) -> EnvAnswer:
    return EnvAnswer(failure=f"timeout: no answer within {seconds:g} s", seconds=seconds)


class EnvironmentThreads:
    """The environment on daemon threads of this process, one per call (a hung one neither
    blocks the round nor the process's exit). One host per generate call, so a call that
    ends after its timeout changes nothing the next call sees."""

    def __init__(self, cfg: EnvironmentConfig):
        self.cfg = cfg
        self.host = EnvironmentHost(cfg.name, cfg.options)

    def reset(self, items: list[tuple[int, Problem]]) -> list[EnvAnswer]:
        self.host = EnvironmentHost(self.cfg.name, self.cfg.options)
        return self._round(self.host.reset, items)

    def step(self, items: list[tuple[int, Turn]]) -> list[EnvAnswer]:
        return self._round(self.host.step, items)

    def close(self, keys: list[int]) -> None:
        self.host.close(keys)

    def _round(self, method, items) -> list[EnvAnswer]:
        timeout = self.cfg.turn_timeout_s
        deadline = time.monotonic() + timeout
        futures = [_on_daemon_thread(method, key, arg) for key, arg in items]
        answers = []
        for f in futures:
            try:
                out, failure, seconds = f.result(timeout=max(0.0, deadline - time.monotonic()))
            except concurrent.futures.TimeoutError:
                answers.append(_timeout(timeout))
            else:
                answers.append(EnvAnswer(out, failure, seconds))
        return answers


def _on_daemon_thread(fn, *args) -> concurrent.futures.Future:
    """fn(*args) on a new daemon thread, its result in the future (fn never raises: the
    host answers errors as text)."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run():
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            future.set_exception(e)

    threading.Thread(target=run, name="klrl-environment", daemon=True).start()
    return future


class EnvironmentPool:
    """task.environment.pool.actors_per_worker environment actors, started here (in the
    rollout worker: the actors are its children and die with it)."""

    def __init__(self, cfg: EnvironmentConfig):
        if not cfg.pool.enabled:
            raise ValueError("EnvironmentPool needs task.environment.pool.actors_per_worker")
        self.cfg = cfg
        self.hosts = self._started(cfg.pool.actors_per_worker)
        self.where: dict[int, int] = {}  # episode key -> the index of its actor
        self.dealt = 0
        self.replaced = 0  # actors replaced (hung or dead) over the pool's life

    def _started(self, n: int) -> list:
        """n new environment actors, up: a round's timeout then never counts an actor's
        start. RuntimeError if they are not up within START_TIMEOUT_S (Ray cannot place
        them: the node lacks the CPUs)."""
        import ray

        pool = self.cfg.pool
        hosts = [ray.remote(EnvironmentHost).options(
            num_cpus=pool.cpus_per_actor, max_concurrency=pool.concurrency,
            max_restarts=0).remote(self.cfg.name, self.cfg.options) for _ in range(n)]
        try:
            ray.get([h.__ray_ready__.remote() for h in hosts], timeout=START_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(
                f"{n} environment actor(s) of {self.cfg.pool.cpus_per_actor:g} CPUs each did "
                f"not start within {START_TIMEOUT_S} s: lower task.environment.pool."
                "cpus_per_actor or actors_per_worker, or give Ray more CPUs") from None
        return hosts

    def reset(self, items: list[tuple[int, Problem]]) -> list[EnvAnswer]:
        for key, _ in items:
            self.where[key] = self.dealt % len(self.hosts)
            self.dealt += 1
        return self._round("reset", items)

    def step(self, items: list[tuple[int, Turn]]) -> list[EnvAnswer]:
        return self._round("step", items)

    def close(self, keys: list[int]) -> None:
        by_host: dict[int, list[int]] = {}
        for key in keys:
            if (slot := self.where.pop(key, None)) is not None:
                by_host.setdefault(slot, []).append(key)
        for slot, its_keys in by_host.items():
            self.hosts[slot].close.remote(its_keys)  # nothing waits on it

    def _round(self, method: str, items) -> list[EnvAnswer]:
        import ray
        from ray.exceptions import RayActorError

        timeout = self.cfg.turn_timeout_s
        refs = [getattr(self.hosts[self.where[key]], method).remote(key, arg)
                for key, arg in items]
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=timeout)[0]) if refs else set()
        lost: dict[int, str] = {}  # actor index -> why it is replaced
        answers = []
        for (key, _), ref in zip(items, refs):
            slot = self.where[key]
            if ref not in ready:
                answers.append(_timeout(timeout))
                lost.setdefault(slot, f"its environment actor was replaced: another sample's "
                                      f"call on it took longer than {timeout:g} s")
                continue
            try:
                out, failure, seconds = ray.get(ref)
            except RayActorError as exc:
                why = f"its environment actor died: {type(exc).__name__}: {exc}"[:300]
                lost.setdefault(slot, why)
                answers.append(EnvAnswer(failure=f"actor_lost: {why}"))
            except ray.exceptions.RayTaskError as exc:  # e.g. a reply that cannot be pickled
                cause = exc.cause if exc.cause is not None else exc
                answers.append(EnvAnswer(
                    failure=f"exception: {type(cause).__name__}: {cause}"[:300]))
            else:
                answers.append(EnvAnswer(out, failure, seconds))
        for slot in lost:
            ray.kill(self.hosts[slot], no_restart=True)
        for slot, host in zip(lost, self._started(len(lost))):
            self.hosts[slot] = host
            self.replaced += 1
        # The environments of the replaced actors are gone: their episodes end here.
        return [EnvAnswer(failure=f"actor_lost: {lost[self.where[key]]}", seconds=a.seconds)
                if a.failure is None and self.where[key] in lost else a
                for (key, _), a in zip(items, answers)]

    def shutdown(self) -> None:
        import ray

        for host in self.hosts:
            ray.kill(host, no_restart=True)
        self.hosts = []
