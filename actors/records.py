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

    def __post_init__(self):
        if len(self.response_ids) != len(self.behaviour_logprobs):
            raise ValueError(f"rollout {self.problem.uid}: {len(self.response_ids)} response "
                             f"tokens but {len(self.behaviour_logprobs)} behaviour log-probs")
        if self.policy_version < 0:
            raise ValueError(f"policy_version must be >= 0, got {self.policy_version}")


@dataclass(frozen=True)
class RolloutBatch:
    """What one generate call of a worker returns: n samples for each of its prompts."""

    rollouts: list[Rollout]
    policy_version: int               # version of the weights every rollout here was sampled with
    worker: int
    gen_seconds: float                # wall time inside the engine
    num_response_tokens: int = field(default=0)
