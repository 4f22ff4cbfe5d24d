"""Typed records that cross process boundaries between rollout workers, controller and learner.

Frozen dataclasses rather than pydantic models: a batch holds tens of thousands of token ids
and log-probs, and these records are built and pickled on the hot path (Ray serialises them);
field types are still explicit and checked at construction by `__post_init__`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from rewards import Problem

# `Rollout.score_failure` of every rollout of a generate call whose scoring pool itself failed
# (rewards.ScoringPoolError); the controller counts those calls as faults/scoring_pool_errors.
POOL_ERROR = "pool_error"


@dataclass(frozen=True)
class Rollout:
    """One sampled response to one prompt, as generated and scored by a rollout worker.

    Invariant (checked): one behaviour log-prob per response token. `behaviour_logprobs` are
    the log-probs of the distribution that was actually sampled (vLLM's processed log-probs
    when temperature/top-k/top-p change it); they are the denominator of every importance
    ratio. `policy_version` is the number of optimizer steps in the weights that generated it.

    With in-flight weight updates (continuous generation, actors/generation/) one response may be
    sampled by several versions: `token_versions[t]` is the policy version of the engine step
    that sampled response token t, and `behaviour_logprobs[t]` that step's log-prob of it.
    Invariant (checked) when given: one per response token, non-decreasing (weights only move
    forward), and `policy_version == token_versions[0]`, the OLDEST token's version: every
    staleness rule that reads `policy_version` then bounds the oldest token. None means every
    token is `policy_version`'s (the worker generated the whole response with one version).

    Multi-turn (task.environment; actors/multi_turn.py): `response_ids` is the whole
    trajectory after the prompt, the policy's turns and the environment's replies interleaved,
    exactly as the engine sampled and the environment's tokens were appended (the ids the next
    turn was generated from); `policy_mask[t]` is True where response token t was sampled by
    the policy, False on an environment token. `behaviour_logprobs` and `token_versions` then
    hold one entry per *policy* token, in order (an environment token has no sampler).
    Invariant (checked): one policy_mask entry per response token, and as many True as
    behaviour log-probs. None means every response token is the policy's (single-turn).
    `turns`: policy turns in the episode; `env_replies`: replies that did not end it (tool
    calls); `env_seconds`: time spent in the environment; `env_failure`: None, or why the
    environment failed on this sample (rewards.environment.FAILURE_REASONS, then ": detail"),
    in which case the sample is not trained on; `env_info`: the environment's numbers summed
    over its steps.
    """

    problem: Problem
    group_id: int                     # samples of the same prompt in a batch share it
    prompt_ids: list[int]             # one list shared by a prompt's samples: never changed
    response_ids: list[int]
    behaviour_logprobs: list[float]
    policy_version: int
    finish_reason: str                # "stop" (EOS) or "length" (max_new_tokens)
    reward: float = 0.0
    score_failure: str | None = None  # None, or why scoring failed (reward is then 0)
    worker: int = 0
    token_versions: list[int] | None = None  # per policy token; None: all policy_version
    policy_mask: list[bool] | None = None    # per response token; None: all the policy's
    turns: int = 1
    env_replies: int = 0
    env_seconds: float = 0.0
    env_failure: str | None = None
    env_info: dict[str, float] = field(default_factory=dict)

    def __post_init__(self):
        policy_tokens = self.num_policy_tokens
        if self.policy_mask is not None and len(self.policy_mask) != len(self.response_ids):
            raise ValueError(f"rollout {self.problem.uid}: {len(self.response_ids)} response "
                             f"tokens but {len(self.policy_mask)} policy_mask entries")
        if policy_tokens != len(self.behaviour_logprobs):
            raise ValueError(f"rollout {self.problem.uid}: {policy_tokens} policy "
                             f"tokens but {len(self.behaviour_logprobs)} behaviour log-probs")
        if self.policy_version < 0:
            raise ValueError(f"policy_version must be >= 0, got {self.policy_version}")
        versions = self.token_versions
        if versions is not None:
            uid = self.problem.uid
            if len(versions) != policy_tokens:
                raise ValueError(f"rollout {uid}: {policy_tokens} policy tokens but "
                                 f"{len(versions)} token versions")
            if any(b < a for a, b in zip(versions, versions[1:])):
                raise ValueError(f"rollout {uid}: token versions must not decrease, got "
                                 f"{versions}")
            if versions and versions[0] != self.policy_version:
                raise ValueError(f"rollout {uid}: policy_version ({self.policy_version}) must be "
                                 f"the oldest token's version ({versions[0]})")

    @property
    def num_policy_tokens(self) -> int:
        """Response tokens the policy sampled (all of them single-turn)."""
        if self.policy_mask is None:
            return len(self.response_ids)
        return sum(bool(m) for m in self.policy_mask)

    @property
    def num_versions(self) -> int:
        """How many policy versions sampled the response (1 when one did, or none were needed:
        an empty response)."""
        if not self.token_versions:
            return 1
        return 1 + sum(b != a for a, b in zip(self.token_versions, self.token_versions[1:]))


@dataclass(frozen=True)
class RolloutBatch:
    """What one generate call of a worker returns: n samples for each of its prompts."""

    rollouts: list[Rollout]
    # The oldest rollout's policy_version: every token here is at least this version (with
    # in-flight updates, later tokens may be newer: Rollout.token_versions).
    policy_version: int
    worker: int
    gen_seconds: float                # wall time inside the engine
    num_response_tokens: int = field(default=0)
    # The worker's engine-busy seconds since it started (generating or evaluating; with
    # in-flight updates, inside engine steps) and its monotonic clock, both read as this batch
    # was returned: two batches of one worker give the share of the time between them that
    # its engine sat idle (`engine_idle_share`).
    engine_busy_seconds: float = 0.0
    returned_at: float = 0.0
    # Preemptions of this call's requests by weight updates while they ran (in-flight updates
    # with stale_kv recompute: each update preempts every running request, whose KV the new
    # weights recompute); 0 batch-level, where no request runs through an update.
    preempted: int = 0


def engine_idle_share(earlier: RolloutBatch, later: RolloutBatch) -> float | None:
    """The share of the time between two batches of one worker (`later` returned after
    `earlier`) in which its engine was idle: waiting for a weight load, a request or the next
    call. None when they are not two batches of one worker's clock in that order, or when
    the busy time went back (a replaced worker's counter starts again)."""
    elapsed = later.returned_at - earlier.returned_at
    busy = later.engine_busy_seconds - earlier.engine_busy_seconds
    if later.worker != earlier.worker or elapsed <= 0 or busy < 0:
        return None
    return min(1.0, max(0.0, 1.0 - busy / elapsed))
