"""DAPO's overlong recipe (task.overlong; rewards/shaping.py, cluster/train/batching.py): the
soft length penalty in the last `buffer` tokens of the budget, and truncated responses taken
out of the task term while their KL term stays, for every KL configuration that keeps a KL
term of its own. Pure torch: no engine."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from actors.records import Rollout
from cluster.config.train_config import TrainConfig
from cluster.train.batching import shaping_metrics, train_batch
from kl.config import AdvantageConfig, KLConfig
from learner.config import LearnerConfig
from learner.loss import policy_loss
from rewards import Problem
from rewards.config import OverlongConfig
from rewards.shaping import overlong_penalty

PROBLEM = Problem(uid="p0", task="arithmetic", split="train", prompt="1+1=", answer="2")
BUDGET = 8


def test_the_penalty_is_zero_before_the_buffer_and_grows_linearly_to_the_budget():
    assert [overlong_penalty(n, 8, 4, 1.0) for n in range(9)] == \
        [0, 0, 0, 0, 0, -0.25, -0.5, -0.75, -1.0]
    assert overlong_penalty(8, 8, 4, 0.5) == -0.5
    assert overlong_penalty(8, 8, 0, 1.0) == 0.0  # no buffer: off


def _rollouts():
    """Two groups of three; lengths 2..8 tokens, the length-8 ones truncated (finish 'length')."""
    out = []
    for i, (n, reward) in enumerate(((2, 1.0), (8, 0.0), (6, 1.0), (8, 1.0), (3, 0.0), (5, 1.0))):
        out.append(Rollout(problem=PROBLEM, group_id=i // 3, prompt_ids=[1, 1],
                           response_ids=[2] * n, behaviour_logprobs=[-1.0] * n,
                           policy_version=0, reward=reward,
                           finish_reason="length" if n == BUDGET else "stop"))
    return out


def test_the_shaped_rewards_feed_the_advantages_and_the_mask_zeroes_truncated_ones():
    rollouts = _rollouts()
    shaping = OverlongConfig(buffer=4)
    plain = train_batch(rollouts, AdvantageConfig(), 0)
    shaped = train_batch(rollouts, AdvantageConfig(), 0, overlong=shaping, budget=BUDGET)
    # penalties: 0, -1, -0.5, -1, 0, -0.25 (lengths 2, 8, 6, 8, 3, 5 in the last 4 of 8)
    assert shaped.rewards.tolist() == [1.0, -1.0, 0.5, 0.0, 0.0, 0.75]
    assert not torch.equal(shaped.advantages, plain.advantages)
    masked = train_batch(rollouts, AdvantageConfig(), 0,
                         overlong=shaping.model_copy(update={"mask_truncated": True}),
                         budget=BUDGET)
    truncated = torch.tensor([r.finish_reason == "length" for r in rollouts])
    assert masked.advantages[truncated].tolist() == [0.0, 0.0]
    # the others keep the advantages their group's baseline gave them, truncated rewards in it
    assert torch.equal(masked.advantages[~truncated], shaped.advantages[~truncated])
    m = shaping_metrics(rollouts, shaping.model_copy(update={"mask_truncated": True}), BUDGET)
    assert m == {"rollout/truncated_frac": 2 / 6, "reward/overlong_penalty": -2.75 / 6,
                 "task/masked_truncated": 2.0}
    assert shaping_metrics(rollouts, OverlongConfig(), BUDGET) == {
        "rollout/truncated_frac": 2 / 6}


KEEPS_KL = [KLConfig(estimator=e, placement=p, importance=i, beta=0.3)
            for e in ("k1", "k3") for p in ("loss", "reward")
            for i in ("none", "prefix")]


@pytest.mark.parametrize("kl_cfg", KEEPS_KL,
                         ids=lambda c: f"{c.estimator}-{c.placement}-{c.importance}")
def test_masking_a_truncated_sample_drops_its_task_gradient_and_keeps_its_kl_gradient(kl_cfg):
    """With the mask, a truncated sample's log-probs get exactly the KL term's gradient (the
    same as with no task reward at all), the other samples exactly their unmasked gradient,
    and the KL term's value is the unmasked one."""
    rollouts = _rollouts()
    on = OverlongConfig(buffer=4, mask_truncated=True)
    masked = train_batch(rollouts, AdvantageConfig(), 0, overlong=on, budget=BUDGET)
    unmasked = train_batch(rollouts, AdvantageConfig(), 0, overlong=on.model_copy(
        update={"mask_truncated": False}), budget=BUDGET)
    g = torch.Generator().manual_seed(0)
    logp = torch.where(masked.response_mask, -torch.rand(masked.input_ids.shape, generator=g,
                                                         dtype=torch.float64), 0.0)
    ref = logp - 0.3 * torch.rand(logp.shape, generator=g, dtype=torch.float64)
    lcfg = LearnerConfig(task_off_policy="none")

    def grad(batch, cfg):
        x = logp.clone().requires_grad_(True)
        loss, metrics = policy_loss(x, ref, batch, cfg, AdvantageConfig(), lcfg, 6.0)
        loss.backward()
        return x.grad, metrics

    (gm, mm), (gu, mu) = grad(masked, kl_cfg), grad(unmasked, kl_cfg)
    kl_only, _ = grad(dataclasses.replace(masked, advantages=torch.zeros(6)), kl_cfg)
    no_kl, _ = grad(masked, kl_cfg.model_copy(update={"beta": 0.0}))
    truncated = torch.tensor([r.finish_reason == "length" for r in rollouts])
    assert torch.allclose(gm[~truncated], gu[~truncated])
    assert torch.allclose(no_kl[truncated], torch.zeros_like(no_kl[truncated]))  # no task term
    assert gm[truncated].abs().sum() > 0  # the KL term still reaches them
    assert torch.allclose(gm[truncated], kl_only[truncated])
    assert mm["loss/kl"] == pytest.approx(mu["loss/kl"])


def test_the_door_refuses_a_buffer_past_the_budget_and_a_mask_beside_a_folded_kl_reward():
    base = {"rollout": {"max_new_tokens": 8}}
    with pytest.raises(ValueError, match=r"task.overlong.buffer \(8\) must be below "
                                         r"rollout.max_new_tokens \(8\)"):
        TrainConfig.model_validate(base | {"task": {"overlong": {"buffer": 8}}})
    with pytest.raises(ValueError, match="kl.kl_in_advantage=separate"):
        TrainConfig.model_validate(base | {
            "task": {"overlong": {"mask_truncated": True}},
            "kl": {"placement": "reward", "kl_in_advantage": "normalized"}})
    TrainConfig.model_validate(base | {"task": {"overlong": {"buffer": 4,
                                                             "mask_truncated": True}}})
