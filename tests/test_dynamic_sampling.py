"""Dynamic sampling (cluster/train/dynamic_sampling.py) without Ray: real Rollout records, the
step's batches handed in as the controller's `_take_batch` would. Every step trains exactly a
batch of groups with spread in the task's (unshaped) reward; the replacements' lag is logged;
the cost and the bias are logged; the refusals; and, by the loss itself, that a zero-spread
group's task term is exactly 0 under every group baseline while its KL term is not."""
import pytest
import torch
from pydantic import ValidationError

from actors.records import Rollout
from cluster.config.train_config import TrainConfig
from cluster.train.batching import train_batch
from cluster.train.dynamic_sampling import DynamicSampler, has_spread
from kl.config import AdvantageConfig, KLConfig
from learner.config import LearnerConfig
from learner.loss import policy_loss
from rewards.config import OverlongConfig
from rewards.records import Problem

N = 3  # samples per prompt


def _group(gid, rewards, version=0, lengths=None):
    p = Problem(uid=f"p{gid}", task="t", split="train", prompt="x", answer="1")
    lengths = lengths or [2] * len(rewards)
    return [Rollout(problem=p, group_id=gid, prompt_ids=[1, 2], response_ids=[3] * n,
                    behaviour_logprobs=[-0.5] * n, policy_version=version,
                    finish_reason="stop", reward=r) for r, n in zip(rewards, lengths)]


FLAT, MIXED = [1.0] * N, [1.0, 0.0, 0.0]


def _stream(batches):
    """take(): the batches in order (rollouts, generation metrics), then None."""
    it = iter(batches)

    def take():
        b = next(it, None)
        return None if b is None else (b, {"time/generate": 1.0})
    return take


def test_zero_spread_groups_are_replaced_and_the_batch_stays_full():
    step = 5
    batches = [
        _group(0, FLAT, 4) + _group(1, MIXED, 4) + _group(2, [0.0] * N, 4) + _group(3, MIXED, 3),
        _group(4, FLAT, 5) + _group(5, MIXED, 5) + _group(6, MIXED, 5) + _group(7, MIXED, 5),
        _group(8, MIXED, 5) + _group(9, MIXED, 5) + _group(10, MIXED, 5) + _group(11, MIXED, 5),
    ]
    out, m = DynamicSampler(prompts=4, max_batches=4).fill(_stream(batches), step)
    assert [r.group_id for r in out[::N]] == [1, 3, 5, 6]  # first come, with spread
    assert len(out) == 4 * N and all(has_spread(out[i:i + N]) for i in range(0, len(out), N))
    assert m["dynamic_sampling/extra_batches"] == 1            # the third was never taken
    assert m["dynamic_sampling/dropped_share"] == pytest.approx(3 / 8)
    assert m["dynamic_sampling/extra_samples"] == 8 * N - 4 * N
    assert m["dynamic_sampling/filled_zero_spread"] == 0
    assert m["dynamic_sampling/replacement_lag_max"] == 0      # generated at the current step
    assert m["lag/max"] == 2 and m["lag/mean"] == pytest.approx((1 + 2 + 0 + 0) / 4)
    assert m["lag/token_max"] == 2
    # the bias toward harder prompts, logged: the trained samples' mean reward vs all generated
    assert m["dynamic_sampling/trained_reward_mean"] == pytest.approx(1 / 3)
    generated = [r.reward for b in batches[:2] for r in b]
    assert m["dynamic_sampling/generated_reward_mean"] == pytest.approx(
        sum(generated) / len(generated))


def test_spread_is_the_task_reward_not_the_shaped_one():
    """A group of equally right samples of different lengths: overlong shaping gives them
    different rewards (spread in the shaped reward), the task's reward has none: dropped."""
    group = _group(0, FLAT, lengths=[2, 7, 8])
    shaped = train_batch(group, AdvantageConfig(), pad_id=0,
                         overlong=OverlongConfig(buffer=4), budget=8).rewards
    assert float(shaped.max() - shaped.min()) > 0
    assert not has_spread(group)


@pytest.mark.parametrize("why", ["cap", "data"])
def test_a_step_without_enough_spread_is_completed_with_flat_groups(why):
    batches = [_group(0, FLAT) + _group(1, MIXED), _group(2, FLAT) + _group(3, FLAT)]
    cap = 2 if why == "cap" else 10
    out, m = DynamicSampler(prompts=2, max_batches=cap).fill(_stream(batches), 0)
    assert [r.group_id for r in out[::N]] == [1, 0]  # full: the earliest flat group fills it
    assert m["dynamic_sampling/filled_zero_spread"] == 1
    assert m["dynamic_sampling/extra_batches"] == 1


def test_refusals_where_it_means_nothing():
    with pytest.raises(ValidationError, match="samples_per_prompt=1"):
        TrainConfig(dynamic_sampling={"enabled": True},
                    rollout={"samples_per_prompt": 1}, advantage={"estimator": "reinforce",
                                                                  "normalize": "none"})
    with pytest.raises(ValidationError, match="without a group baseline"):
        TrainConfig(dynamic_sampling={"enabled": True},
                    advantage={"estimator": "reinforce", "normalize": "none"})
    assert TrainConfig(dynamic_sampling={"enabled": True}).dynamic_sampling.enabled


@pytest.mark.parametrize("adv", [AdvantageConfig(estimator="rloo"),
                                 AdvantageConfig(estimator="grpo", normalize="group"),
                                 AdvantageConfig(estimator="drgrpo", normalize="none")])
def test_under_a_group_baseline_a_dropped_group_carries_no_task_gradient(adv):
    """The batch with a zero-spread group, and without it, at the same N: the task term's
    gradient on every other sequence is the same and 0 on the flat group's; with a KL term
    the flat group's gradient is not 0 (dropping it drops its KL pull)."""
    rollouts = _group(0, MIXED, lengths=[2, 3, 4]) + _group(1, FLAT, lengths=[3, 2, 4]) \
        + _group(2, [0.0, 0.5, 1.0], lengths=[4, 4, 1])
    keep = [r for r in rollouts if r.group_id != 1]
    full, part = train_batch(rollouts, adv, pad_id=0), train_batch(keep, adv, pad_id=0)
    assert not full.advantages[N:2 * N].any()
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(full.input_ids.shape, generator=g, dtype=torch.float64)
    ref = -torch.rand(full.input_ids.shape, generator=g, dtype=torch.float64)
    rows = torch.tensor([i for i in range(3 * N) if not N <= i < 2 * N])

    def grad(batch, lp, rf, kl_cfg):
        x = lp.clone().requires_grad_(True)
        policy_loss(x, rf, batch, kl_cfg, adv, LearnerConfig(task_off_policy="none"),
                    9.0)[0].backward()
        return x.grad

    task_only = KLConfig(beta=0.0)
    g_full = grad(full, logp, ref, task_only)
    g_part = grad(part, logp[rows, :part.width], ref[rows, :part.width], task_only)
    assert not g_full[N:2 * N].any()
    torch.testing.assert_close(g_full[rows, :part.width], g_part, rtol=0, atol=1e-15)
    with_kl = grad(full, logp, ref, KLConfig(placement="loss", beta=0.1))
    assert with_kl[N:2 * N].abs().sum() > 0
