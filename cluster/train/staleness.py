"""Per-token staleness of a training batch: how many policy versions each trained token's
sampler lags the learner that trains it.

With `rollout.in_flight_updates` a sample's tokens may come from several versions (a weight
update lands while the request is in flight); `Rollout.token_versions` gives each token's,
non-decreasing, and `Rollout.policy_version` is the oldest of them. The lag rule
(`Controller._take_batch`) reads `policy_version`, so the oldest token decides and every
token's lag is within `max_lag` whenever the sample's is. A rollout without token_versions
was sampled by one version: each of its tokens has `policy_version`.
"""
from __future__ import annotations

from collections.abc import Sequence

from actors.records import Rollout


def token_versions(rollout: Rollout) -> list[int]:
    """The version that sampled each policy token of `rollout` (oldest first): every response
    token single-turn; multi-turn, the policy's tokens only (an environment token has no
    sampler, `Rollout.policy_mask`)."""
    if rollout.token_versions is not None:
        return list(rollout.token_versions)
    return [rollout.policy_version] * rollout.num_policy_tokens


def token_lag_metrics(rollouts: Sequence[Rollout], step: int) -> dict[str, float]:
    """The batch's staleness per token, for learner version `step`:
    lag/token_mean and lag/token_max (step - version, over every response token of the
    batch), lag/multi_version_share (share of samples whose tokens span more than one
    version) and lag/versions_per_sample (mean count of distinct versions in a sample).
    A sample without response tokens counts as one version, `policy_version`; a batch
    without any token has the token lags of its samples' versions."""
    if not rollouts:
        raise ValueError("a training batch holds at least one rollout")
    lags: list[int] = []
    distinct: list[int] = []
    for r in rollouts:
        lags += [step - v for v in token_versions(r)]
        distinct.append(r.num_versions)
    if not lags:
        lags = [step - r.policy_version for r in rollouts]
    return {"lag/token_mean": sum(lags) / len(lags), "lag/token_max": max(lags),
            "lag/multi_version_share": sum(d > 1 for d in distinct) / len(distinct),
            "lag/versions_per_sample": sum(distinct) / len(distinct)}
