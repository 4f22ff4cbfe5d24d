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
token of the call is one version). Between two turns, the round of environment calls (a reset
or a step per live episode) runs on threads of the worker or in its pool of environment actors
(task.environment.pool, actors/environment_pool.py), under `turn_timeout_s`; a call past it,
or an environment that raises, replies garbage or loses its actor, costs its sample.

Sampling seeds: turn 0 of sample j of a prompt whose request seed is s is seeded s + j, as
vLLM seeds sample j of one request with n samples; turn k > 0 with `actors.seeds.turn_seed`.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from actors.environment_pool import EnvAnswer, EnvironmentPool, EnvironmentThreads
from actors.generation.base import EngineDriver
from actors.records import Rollout
from actors.seeds import turn_seed
from rewards import Problem
from rewards.config import EnvironmentConfig
from rewards.environment import EnvFailure, EnvStep, Turn, check_reply, environment_class


@dataclass
class Episode:
    """One sample's episode as it runs: the ids after the prompt, which are the policy's, the
    policy tokens' log-probs and versions, and what the environment said."""

    problem: Problem
    group_id: int
    prompt_ids: list[int]
    seed: int | None
    key: int = 0  # the episode's environment, where it runs (actors/environment_pool.py)
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
        self.envs = EnvironmentPool(cfg) if cfg.pool.enabled else EnvironmentThreads(cfg)
        self.keys = 0  # episode keys handed out: unique over the runner's life

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
        for e in episodes:
            e.key, self.keys = self.keys, self.keys + 1
        base = [sp for sp in params for _ in range(sp.n)]
        self._take_answers(episodes, self.envs.reset([(e.key, e.problem) for e in episodes]))
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
            asked = [episodes[i] for i in live]
            self._take_answers(asked, self.envs.step([(e.key, e.pending_turn) for e in asked]))
        for e in episodes:
            if e.live:  # the turn limit cut it
                e.finish_reason = "turns"
        self.envs.close([e.key for e in episodes])
        return EpisodesRun([e.rollout(worker, version) for e in episodes], spent["gen"],
                           spent["preempted"])

    def shutdown(self) -> None:
        """Stop the pool's environment actors (they would also die with the worker)."""
        if isinstance(self.envs, EnvironmentPool):
            self.envs.shutdown()

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

    def _take_answers(self, episodes: list[Episode], answers: list[EnvAnswer]) -> None:
        """Each episode's answer from its environment: a failure marks the episode, a step's
        reply is checked (`check_reply`) and applied (`_apply`)."""
        for e, a in zip(episodes, answers):
            e.env_seconds += a.seconds
            if a.failure is not None:
                e.failure = a.failure
            elif e.pending_turn is not None:  # a step's answer (a reset's is None)
                try:
                    self._apply(e, check_reply(a.out, self.vocab_size))
                except EnvFailure as failure:
                    e.failure = f"{failure.reason}: {failure.detail}"[:300]

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
