"""Environment tokens (a multi-turn trajectory's replies, out of response_mask) leave no trace
in the learner's loss: for every KL estimator, placement, importance correction, way of
folding the KL into the advantage and task term, changing the current, reference and
behaviour log-probs at the environment's positions changes neither the loss nor the gradient,
and the gradient there is zero. The prefix weights, K1-in-the-reward's KL return-to-go and the
sequence weights run across the hole in the mask (a policy token after a reply still sees
the policy tokens before it), which the exact checks over trajectories prove
(tests/test_kl_multi_turn.py); this proves nothing leaks in from the hole."""
from __future__ import annotations

import itertools
from typing import get_args

import pytest
import torch

from kl.config import AdvantageConfig, KLConfig, check_compatible
from kl.estimators import Estimator
from kl.surrogate import Importance, Placement
from learner.batch import TrainBatch
from learner.config import LearnerConfig
from learner.loss import policy_loss
from learner.task_term_traits import TASK_OFF_POLICIES

B, L, PROMPT = 4, 10, 2
ENV = [4, 5, 8]  # environment reply positions inside the response


def _batch() -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    mask = torch.zeros(B, L, dtype=torch.bool)
    mask[:, PROMPT:] = True
    mask[:, ENV] = False
    return TrainBatch(input_ids=torch.randint(4, 20, (B, L), generator=g),
                      attention_mask=torch.ones(B, L, dtype=torch.long), response_mask=mask,
                      behaviour_logp=torch.where(mask, -torch.rand(B, L, generator=g), 0.0),
                      rewards=torch.tensor([1.0, 0.0, 0.0, 1.0]),
                      advantages=torch.tensor([0.5, -0.5, -0.5, 0.5]),
                      group_ids=torch.tensor([0, 0, 1, 1]))


def _configs():
    for est, place, imp, kia in itertools.product(
            get_args(Estimator), get_args(Placement), get_args(Importance),
            ("separate", "normalized", "centered")):
        try:
            cfg = KLConfig(estimator=est, placement=place, importance=imp, beta=0.3,
                           kl_in_advantage=kia)
            check_compatible(cfg, AdvantageConfig(estimator="rloo", normalize="none"))
        except ValueError:
            continue
        yield cfg


CONFIGS = list(_configs())


@pytest.mark.parametrize("task", TASK_OFF_POLICIES)
def test_environment_positions_change_nothing(task):
    assert len(CONFIGS) >= 20
    batch = _batch()
    env = torch.zeros(B, L, dtype=torch.bool)
    env[:, ENV] = True
    g = torch.Generator().manual_seed(1)
    lp0 = -torch.rand(B, L, generator=g, dtype=torch.float64)
    ref = -torch.rand(B, L, generator=g, dtype=torch.float64)
    noise = -3 * torch.rand(B, L, generator=g, dtype=torch.float64)
    adv = AdvantageConfig(estimator="rloo", normalize="none")
    learner = LearnerConfig(task_off_policy=task)
    for cfg in CONFIGS:
        out = []
        for hole in (False, True):  # the environment's positions as they are, then changed
            lp = torch.where(env & hole, noise, lp0).requires_grad_()
            r = torch.where(env & hole, noise.flip(0), ref)
            b = TrainBatch(**{**batch.__dict__, "behaviour_logp": torch.where(
                env & hole, noise.flip(1).float(), batch.behaviour_logp)})
            loss, _ = policy_loss(lp, r, b, cfg, adv, learner, num_sequences_global=B)
            (grad,) = torch.autograd.grad(loss, lp)
            out.append((loss.detach(), grad))
        (l0, g0), (l1, g1) = out
        assert torch.equal(l0, l1) and torch.equal(g0, g1), cfg
        assert (g0[env] == 0).all() and (g0[batch.response_mask] != 0).any(), cfg
