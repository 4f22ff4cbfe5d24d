"""Each trained token's lag in the batch (`TrainBatch.token_lags`, built by the controller from
the version that sampled each token) and the mismatch measured on the fresh tokens alone
(`is/abs_log_ratio_fresh_token_mean`): the reading of the learner/sampler numerics, or of a
kept stale prefix cache, that policy drift does not swamp at max_lag > 0."""
from __future__ import annotations

import pytest
import torch

from actors.records import Rollout
from cluster.train.batching import pad_rollouts, train_batch
from kl.config import AdvantageConfig, KLConfig
from learner.config import LearnerConfig
from learner.loss import policy_loss
from learner.loss_metrics import merge_metrics, merge_updates
from rewards import Problem

PROBLEM = Problem(uid="p0", task="arithmetic", split="train", prompt="1+1=", answer="2")
FRESH = "is/abs_log_ratio_fresh_token_mean"


def _rollout(version: int, logprobs: list[float], versions: list[int] | None = None,
             group: int = 0, prompt: int = 2) -> Rollout:
    n = len(logprobs)
    return Rollout(problem=PROBLEM, group_id=group, prompt_ids=[1] * prompt,
                   response_ids=[2] * n, behaviour_logprobs=logprobs, policy_version=version,
                   finish_reason="stop", token_versions=versions, reward=float(group))


def test_token_lags_hold_each_response_tokens_lag_behind_the_learner():
    """At learner version 5: a sample of versions 3,4,5 (lags 2,1,0), one sampled wholly by
    version 4 without token versions (lag 1 each); prompt and padding columns hold 0."""
    rollouts = [_rollout(3, [-1.0, -1.0, -1.0], [3, 4, 5]), _rollout(4, [-1.0, -1.0], prompt=3)]
    batch = pad_rollouts(rollouts, [0.0, 0.0], pad_id=0, version=5)
    assert batch.token_lags.tolist() == [[0, 0, 2, 1, 0], [0, 0, 0, 1, 1]]
    assert pad_rollouts(rollouts, [0.0, 0.0], pad_id=0).token_lags is None  # nobody said
    # select trims token_lags with the other [B, L] columns
    assert batch.select(torch.tensor([1])).token_lags.tolist() == [[0, 0, 0, 1, 1]]
    assert batch.to("cpu").token_lags.tolist() == batch.token_lags.tolist()
    assert pad_rollouts(rollouts, [0.0, 0.0], pad_id=0).to("cpu").token_lags is None


def test_the_fresh_mean_covers_only_tokens_the_trained_weights_sampled():
    """|log pi - log mu| is 0.1 on the lag-0 tokens and 2.0 on the lagged ones: the plain mean
    mixes both, the fresh one reads 0.1, with their count; without token_lags neither key."""
    mu = [-1.0, -1.0, -1.0]
    rollouts = [_rollout(3, mu, [3, 4, 5], group=0), _rollout(5, mu, [5, 5, 5], group=0),
                _rollout(4, mu, group=1), _rollout(4, mu, group=1)]
    batch = train_batch(rollouts, AdvantageConfig(), pad_id=0, version=5)
    fresh = batch.token_lags == 0
    logp = torch.where(batch.response_mask & fresh, -0.9, -3.0).double()
    _, m = policy_loss(logp, logp.detach(), batch, KLConfig(), AdvantageConfig(),
                       LearnerConfig(task_off_policy="none"), 4.0)
    assert m["is/fresh_tokens"] == 4.0
    assert m[FRESH] == pytest.approx(0.1)
    assert m["is/abs_log_ratio_token_mean"] == pytest.approx((4 * 0.1 + 8 * 2.0) / 12)
    none = train_batch(rollouts, AdvantageConfig(), pad_id=0)
    _, m0 = policy_loss(logp, logp.detach(), none, KLConfig(), AdvantageConfig(),
                        LearnerConfig(task_off_policy="none"), 4.0)
    assert FRESH not in m0 and "is/fresh_tokens" not in m0


def test_parts_merge_the_fresh_mean_by_their_fresh_tokens():
    """A micro-batch without fresh tokens reports 0 over 0 tokens: it must weigh nothing, or it
    would halve the reading. Several updates: the count is the batch's (first pass), and
    update_<k>/ keeps each update's reading."""
    parts = [{FRESH: 0.3, "is/fresh_tokens": 5.0, "response/tokens": 5.0,
              "response/sequences": 1.0},
             {FRESH: 0.0, "is/fresh_tokens": 0.0, "response/tokens": 50.0,
              "response/sequences": 5.0}]
    merged = merge_metrics(parts)
    assert merged[FRESH] == pytest.approx(0.3) and merged["is/fresh_tokens"] == 5.0
    later = {**merged, FRESH: 0.5}
    steps = merge_updates([{**merged, "nonfinite": 0.0}, {**later, "nonfinite": 0.0}], 1)
    assert steps["update_0/" + FRESH] == pytest.approx(0.3)
    assert steps["update_1/" + FRESH] == pytest.approx(0.5)
    assert steps["is/fresh_tokens"] == 5.0
