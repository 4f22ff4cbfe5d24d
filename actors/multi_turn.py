"""Multi-turn episodes, token in and token out: the policy writes a turn, the environment
(rewards/environment.py, `task.environment`) answers, the policy writes again from the token
prefix, until the environment ends the episode or a limit cuts it.

What is kept exactly. The policy's tokens are the engine's sampled ids with their sampled
log-probs, never decoded and re-encoded; an environment reply is tokenised once (or given as
ids) and appended; each next turn is a vLLM token prompt (`prompt_token_ids`) of prompt ids +
every id so far, so the trained sequence is the sampled one token for token
(tests/test_multi_turn.py checks it on a real engine). The engine's prefix cache makes the
re-sent prefix cheap.

Where it runs, first version. Batch-level generation only (TrainConfig refuses
rollout.in_flight_updates with an environment): a generate call runs its episodes turn by turn,
each turn one engine call over every live episode, with the weights the worker holds (so every
token of the call is one version). The environment runs on threads of the rollout worker, a
thread per reset or step, each under `turn_timeout_s`; a step past it costs its sample,
and its thread is left to finish on its own (Python cannot stop a thread): an environment that
hangs for good keeps one thread per hung sample. Environments in a pool of Ray actors beside
the workers, so that a slow tool does not hold the engine, are not built yet
(docs/multi-turn.md).

Sampling seeds: turn 0 of sample j of a prompt whose request seed is s is seeded s + j, as
vLLM seeds sample j of one request with n samples; turn k > 0 with `actors.seeds.turn_seed`.
"""
from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from actors.generation.base import EngineDriver
from actors.records import Rollout
from actors.seeds import turn_seed
from rewards import Problem
from rewards.config import EnvironmentConfig
from rewards.environment import (
    Environment,
    EnvFailure,
    EnvStep,
    Turn,
    check_reply,
    environment_class,
)


@dataclass
class Episode:
    """One sample's episode as it runs: the ids after the prompt, which are the policy's, the
    policy tokens' log-probs and versions, and what the environment said."""

    problem: Problem
    group_id: int
    prompt_ids: list[int]
    seed: int | None
    env: Environment | None = None
    ids: list[int] = field(default_factory=list)
    policy_mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: int = 0
    replies: int = 0
    env_seconds: float = 0.0
    failure: str | None = None
    info: dict[str, float] = field(default_factory=dict)
    finish_reason: str | None = None  # set when the episode is over
    reward: float = 0.0
    pending_turn: Turn | None = None  # the last policy turn, for the environment to answer

    @property
    def live(self) -> bool:
        return self.finish_reason is None and self.failure is None

    def rollout(self, worker: int, submitted_version: int) -> Rollout:
        return Rollout(
            problem=self.problem, group_id=self.group_id, prompt_ids=self.prompt_ids,
            response_ids=self.ids, behaviour_logprobs=self.logprobs,
            policy_version=self.versions[0] if self.versions else submitted_version,
            finish_reason=self.finish_reason or "failed", reward=self.reward, worker=worker,
            token_versions=None if len(set(self.versions)) <= 1 else self.versions,
            policy_mask=self.policy_mask, turns=self.turns, env_replies=self.replies,
            env_seconds=self.env_seconds, env_failure=self.failure, env_info=dict(self.info))


@dataclass(frozen=True)
class EpisodesRun:
    """A generate call's episodes: their rollouts, the seconds inside the engine over all
    turns, and the preemptions of its requests (`RolloutBatch`'s fields)."""

    rollouts: list[Rollout]
    gen_seconds: float
    preempted: int


class EpisodeRunner:
    """Runs a generate call's episodes through the worker's engine driver
    (actors/generation/: batch-level, one version); `params` are the call's SamplingParams,
    one per problem (`request_params`), whose sampler, seed and stop strings each turn
    reuses; budget: rollout.max_new_tokens, the whole episode's."""

    def __init__(self, cfg: EnvironmentConfig, tokenizer: Any, budget: int):
        if not cfg.enabled:
            raise ValueError("EpisodeRunner needs task.environment.name")
        self.cfg, self.tokenizer, self.budget = cfg, tokenizer, budget
        self.env_class = environment_class(cfg.name)
        self.vocab_size = len(tokenizer)

    def run(self, driver: EngineDriver, problems: Sequence[Problem], group_ids: Sequence[int],
            prompts: Sequence[dict], params: Sequence[Any], *, worker: int, version: int,
            min_version: int = 0, serving: Callable[[Any], Any] = lambda llm: llm
            ) -> EpisodesRun:
        """The episodes of `problems` (`params[i].n` samples each), every turn one
        `driver.generate` call over the live episodes (min_version, serving: as the worker's
        generate passes them); `version`: the engine's, for a rollout without tokens."""
        spent = {"gen": 0.0, "preempted": 0}

        def generate(requests, turn_params):
            out = driver.generate(requests, turn_params, min_version=min_version,
                                  serving=serving)
            spent["gen"] += out.gen_seconds
            spent["preempted"] += out.preempted
            return out.completions

        episodes = [Episode(p, g, list(pr["prompt_token_ids"]),
                            None if sp.seed is None else sp.seed + j)
                    for p, g, pr, sp in zip(problems, group_ids, prompts, params)
                    for j in range(sp.n)]
        base = [sp for sp in params for _ in range(sp.n)]
        self._on_envs(episodes, self._reset)
        for k in range(self.cfg.max_turns):
            live = [i for i, e in enumerate(episodes) if e.live]
            if not live:
                break
            requests = [{"prompt_token_ids": episodes[i].prompt_ids + episodes[i].ids}
                        for i in live]
            turn_params = [self._turn_params(base[i], episodes[i], k) for i in live]
            done = generate(requests, turn_params)
            for i, completions in zip(live, done):
                self._take_turn(episodes[i], completions[0], version)
            self._on_envs([episodes[i] for i in live], self._step)
        for e in episodes:
            if e.live:  # the turn limit cut it
                e.finish_reason = "turns"
        return EpisodesRun([e.rollout(worker, version) for e in episodes], spent["gen"],
                           spent["preempted"])

    # ------------------------------------------------------------------ turns

    def _turn_params(self, base, episode: Episode, k: int):
        one = base.clone()
        one.n = 1
        one.seed = None if episode.seed is None else turn_seed(episode.seed, k)
        one.max_tokens = min(self.cfg.max_tokens_per_turn, self.budget - len(episode.ids))
        one.stop = list(dict.fromkeys([*(base.stop or []), *self.env_class.stop])) or None
        # The turn's text is decoded here from its ids; vLLM needs its own only to find the
        # stop strings, and keeps every sampled id (the stop string's included).
        one.include_stop_str_in_output = True
        one.detokenize = True
        return one

    def _take_turn(self, e: Episode, c, version: int) -> None:
        ids = list(c.token_ids)
        e.ids += ids
        e.policy_mask += [True] * len(ids)
        e.logprobs += list(c.logprobs)
        e.versions += list(c.versions) if c.versions else [c.submitted_version] * len(ids)
        e.turns += 1
        e.pending_turn = Turn(text=self.tokenizer.decode(ids, skip_special_tokens=True),
                              token_ids=tuple(ids), index=e.turns - 1,
                              finish_reason=str(c.finish_reason),
                              episode_ids=tuple(e.ids))

    def _reset(self, e: Episode) -> None:
        e.env = self.env_class(**self.cfg.options)
        e.env.reset(e.problem)

    def _step(self, e: Episode) -> EnvStep:
        return check_reply(e.env.step(e.pending_turn), self.vocab_size)

    def _on_envs(self, episodes: list[Episode], fn) -> None:
        """fn(e) for each episode, each on a daemon thread of its own under the turn timeout
        (a hung one neither blocks the call nor the process's exit); a step's answer is
        applied (`_apply`), a failure marks its episode."""
        timeout = self.cfg.turn_timeout_s
        started = time.monotonic()

        # Each thread only computes; the episode is updated here, once its answer is taken
        # (a timed-out thread that finishes later changes nothing).
        futures = [(e, _on_daemon_thread(fn, e), time.monotonic()) for e in episodes]
        for e, f, t0 in futures:
            try:
                out = f.result(timeout=max(0.0, started + timeout - time.monotonic()))
            except concurrent.futures.TimeoutError:
                e.failure = f"timeout: no answer within {timeout:g} s"
                e.env_seconds += timeout
                continue
            except EnvFailure as failure:
                e.failure = f"{failure.reason}: {failure.detail}"[:300]
            except Exception as exc:  # noqa: BLE001 - the environment's code: it costs the sample
                e.failure = f"exception: {type(exc).__name__}: {exc}"[:300]
            else:
                if out is not None:
                    self._apply(e, out)
            e.env_seconds += f.finished_at - t0

    def _apply(self, e: Episode, out: EnvStep) -> None:
        """The environment's answer to e's last turn: end the episode or append its reply."""
        for key, value in out.info.items():
            e.info[key] = e.info.get(key, 0.0) + float(value)
        if out.reward is not None:
            e.reward = float(out.reward)
        if out.done:
            e.finish_reason = "stop"
            return
        if e.turns >= self.cfg.max_turns:
            e.finish_reason = "turns"
            return
        if len(e.ids) >= self.budget:
            e.finish_reason = "length"
            return
        e.replies += 1
        reply = (list(out.reply_ids) if out.reply_ids is not None else
                 self.tokenizer.encode(out.reply or "", add_special_tokens=False))
        room = self.budget - len(e.ids)
        e.ids += reply[:room]
        e.policy_mask += [False] * len(reply[:room])
        if len(reply) >= room:  # nothing left for the policy's next turn
            e.finish_reason = "length"


def _on_daemon_thread(fn, *args) -> concurrent.futures.Future:
    """fn(*args) on a new daemon thread; its result or exception in the future, and when it
    ended (time.monotonic()) in the future's `finished_at`."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run():
        try:
            out = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            future.finished_at = time.monotonic()
            future.set_exception(e)
        else:
            future.finished_at = time.monotonic()
            future.set_result(out)

    threading.Thread(target=run, name="klrl-environment", daemon=True).start()
    return future
