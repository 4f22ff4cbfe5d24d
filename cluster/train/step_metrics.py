"""What a step logs of the batch it trains: its lags (per sample and per token,
cluster/train/staleness.py), rewards and scoring failures, generation time and throughput,
response lengths, in-flight preemptions and the engines' idle share. One function per part of
the controller's step that measures, so each reads on one screen."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from actors.records import POOL_ERROR, Rollout, RolloutBatch, engine_idle_share
from cluster.train.staleness import token_lag_metrics


def batch_metrics(batches: Sequence[RolloutBatch], rollouts: Sequence[Rollout], step: int, *,
                  dropped_total: int, updates_per_batch: int, wait_s: float,
                  last_batches: dict[int, RolloutBatch]) -> dict:
    """The metrics of the rollouts a step trains (`rollouts`, those of `batches` within
    max_lag) at learner version `step`; `wait_s`: how long the controller waited for them;
    `last_batches`: each worker's previous batch (`engine_idle_metrics`)."""
    lags = [step - r.policy_version for r in rollouts]
    gen_s = max(b.gen_seconds for b in batches)
    tokens = sum(b.num_response_tokens for b in batches)
    rewards = [r.reward for r in rollouts]
    lengths = [len(r.response_ids) for r in rollouts]
    idle = engine_idle_metrics(last_batches, batches)
    return token_lag_metrics(rollouts, step) | idle | {
        "lag/max": max(lags), "lag/mean": sum(lags) / len(lags),
        "lag/dropped_total": dropped_total,
        # In optimizer steps: update k of this batch trains on data lag * updates + k steps
        # older than its weights (equal to lag/max with one update per batch).
        "lag/max_optimizer_steps": max(lags) * updates_per_batch + updates_per_batch - 1,
        "rollout/policy_version": sum(r.policy_version for r in rollouts) / len(rollouts),
        "reward/mean": sum(rewards) / len(rewards),
        "reward/score_failures": sum(r.score_failure is not None for r in rollouts),
        # generate calls whose scoring pool failed
        "faults/scoring_pool_errors": sum(any(r.score_failure == POOL_ERROR for r in b.rollouts)
                                          for b in batches),
        "time/generate": gen_s, "time/wait_for_rollouts": wait_s,
        "throughput/gen_tokens_per_s": tokens / gen_s if gen_s > 0 else 0.0,
        "rollout/response_tokens_mean": sum(lengths) / len(lengths),
        "rollout/response_tokens_max": max(lengths),
        # requests of the step's batches preempted by in-flight weight updates (0
        # batch-level): with lag/multi_version_share, whether anything was in flight
        "rollout/preempted": sum(b.preempted for b in batches),
    }


def engine_idle_metrics(last_batches: dict[int, RolloutBatch],
                        batches: Sequence[RolloutBatch]) -> dict:
    """rollout/engine_idle_share: the mean over workers of the share of the time since
    their previous batch (`last_batches`, per worker, updated here) that their engine sat idle
    (actors.records.engine_idle_share; none on a worker's first batch, or its replacement's)."""
    shares = [share for b in batches if (before := last_batches.get(b.worker))
              and (share := engine_idle_share(before, b)) is not None]
    last_batches |= {b.worker: dataclasses.replace(b, rollouts=[]) for b in batches}
    return {"rollout/engine_idle_share": sum(shares) / len(shares)} if shares else {}
