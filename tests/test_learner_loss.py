"""learner.loss and learner.batch without any engine: gradients of each term, normalisation,
off-policy task handling, normalized vs separate KL advantage, sharding (micro-batches and
merging: test_learner_microbatches.py)."""
import math
import re

import pytest
import torch

import kl
from kl.config import AdvantageConfig, KLConfig
from learner.batch import TrainBatch
from learner.config import LearnerConfig
from learner.loss import PolicyLoss, policy_loss, sequence_logprobs
from learner.loss_metrics import merge_metrics
from learner.task_term_traits import TASK_OFF_POLICIES

N_GLOBAL = 10.0  # a constant normaliser deliberately different from the batch size


def _batch(seed=0, groups=(3, 3), prompt=2, max_resp=5, dtype=torch.float64, adv=None):
    """Random batch: groups of samples, variable response lengths, right padding."""
    g = torch.Generator().manual_seed(seed)
    b = sum(groups)
    L = prompt + max_resp + 1  # one padding column at least
    lengths = torch.randint(1, max_resp + 1, (b,), generator=g)
    pos = torch.arange(L)[None, :]
    resp = (pos >= prompt) & (pos < prompt + lengths[:, None])
    attn = (pos < prompt + lengths[:, None]).long()
    group_ids = torch.cat([torch.full((n,), 7 * i + 1) for i, n in enumerate(groups)])
    batch = TrainBatch(
        input_ids=torch.randint(0, 20, (b, L), generator=g),
        attention_mask=attn,
        response_mask=resp,
        behaviour_logp=torch.where(resp, -torch.rand(b, L, generator=g, dtype=dtype) * 2, 0.0),
        rewards=torch.rand(b, generator=g, dtype=dtype),
        advantages=(torch.randn(b, generator=g, dtype=dtype) if adv is None else adv),
        group_ids=group_ids,
    )
    logp = -torch.rand(b, L, generator=g, dtype=dtype) * 2
    ref = -torch.rand(b, L, generator=g, dtype=dtype) * 2
    return batch, logp, ref


RLOO = AdvantageConfig()
PLAIN_PG = LearnerConfig(task_off_policy="none")


def _grad(batch, logp, ref, kl_cfg, adv_cfg=RLOO, lcfg=PLAIN_PG, n=N_GLOBAL):
    x = logp.clone().requires_grad_(True)
    loss, metrics = policy_loss(x, ref, batch, kl_cfg, adv_cfg, lcfg, n)
    loss.backward()
    return loss.detach(), x.grad, metrics


def _with(batch, **kw):
    d = {f: getattr(batch, f) for f in batch.__dataclass_fields__}
    d.update(kw)
    return TrainBatch(**d)


KL_CASES = [
    KLConfig(estimator=e, placement=p, importance=i, truncate=t, beta=0.3)
    for e in ("k1", "k2", "k3")
    for p in ("reward", "loss", "reward+loss")
    for i, t in (("none", None), ("token", None), ("sequence", 1.5), ("prefix", None),
                 ("prefix", 1.2))
]


@pytest.mark.parametrize("kl_cfg", KL_CASES,
                         ids=lambda c: f"{c.estimator}-{c.placement}-{c.importance}-{c.truncate}")
@pytest.mark.parametrize("off_policy", TASK_OFF_POLICIES)
def test_kl_gradient_is_beta_times_surrogate_gradient(kl_cfg, off_policy):
    batch, logp, ref = _batch()
    batch = _with(batch, advantages=torch.zeros_like(batch.advantages))  # isolate the KL term
    _, grad, m = _grad(batch, logp, ref, kl_cfg, lcfg=LearnerConfig(task_off_policy=off_policy))

    x = logp.clone().requires_grad_(True)
    mask = batch.response_mask
    baseline = None
    if "reward" in kl_cfg.placement:
        seq_kl = torch.where(mask, kl.estimate(logp, ref, kl_cfg.estimator), 0.0).sum(-1)
        baseline = kl.group_baseline(seq_kl, batch.group_ids, "rloo")
    s = kl.surrogate(x, ref, mask, estimator=kl_cfg.estimator, placement=kl_cfg.placement,
                     importance=kl_cfg.importance, behaviour_logp=batch.behaviour_logp,
                     truncate=kl_cfg.truncate, baseline=baseline)
    (kl_cfg.beta * s.sum() / N_GLOBAL).backward()
    torch.testing.assert_close(grad, x.grad, rtol=1e-12, atol=1e-14)
    assert m["loss/kl"] == pytest.approx(float(kl_cfg.beta * s.detach().sum() / N_GLOBAL),
                                         rel=1e-12)


def test_k1_in_reward_gradient_matches_the_rloo_formula():
    """Explicit: d/d logp_t = beta/N * (R_t - b_i), b_i the leave-one-out mean sequence K1."""
    batch, logp, ref = _batch(groups=(4, 2))
    batch = _with(batch, advantages=torch.zeros_like(batch.advantages))
    beta = 0.7
    _, grad, _ = _grad(batch, logp, ref, KLConfig(estimator="k1", placement="reward", beta=beta))
    mask = batch.response_mask
    k = torch.where(mask, logp - ref, 0.0)
    to_go = k.flip(-1).cumsum(-1).flip(-1)
    seq = k.sum(-1)
    b = torch.empty_like(seq)
    for i in range(len(seq)):
        same = (batch.group_ids == batch.group_ids[i]) & (torch.arange(len(seq)) != i)
        b[i] = seq[same].mean()
    expected = torch.where(mask, beta / N_GLOBAL * (to_go - b[:, None]), 0.0)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-14)


def test_reinforce_estimator_uses_no_kl_baseline():
    batch, logp, ref = _batch()
    batch = _with(batch, advantages=torch.zeros_like(batch.advantages))
    _, grad, _ = _grad(batch, logp, ref, KLConfig(placement="reward", beta=1.0),
                       adv_cfg=AdvantageConfig(estimator="reinforce", normalize="none"))
    k = torch.where(batch.response_mask, logp - ref, 0.0)
    expected = torch.where(batch.response_mask, k.flip(-1).cumsum(-1).flip(-1) / N_GLOBAL, 0.0)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-14)


def test_task_term_sums_over_tokens_and_divides_by_the_constant():
    """Every response token of sequence i gets gradient -A_i/N, whatever the sequence length
    (a per-sequence mean would give -A_i/(N |y_i|))."""
    batch, logp, ref = _batch()
    loss, grad, _ = _grad(batch, logp, ref, KLConfig(beta=0.0))
    mask = batch.response_mask
    expected = torch.where(mask, -batch.advantages[:, None] / N_GLOBAL, 0.0)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-14)
    expected_loss = -(batch.advantages[:, None] * logp * mask).sum() / N_GLOBAL
    assert float(loss) == pytest.approx(float(expected_loss))


@pytest.mark.parametrize("off_policy", ["none", "tis", "ppo_clip"])
@pytest.mark.parametrize("kl_cfg", [
    KLConfig(beta=0.2),
    KLConfig(estimator="k3", placement="reward+loss", importance="prefix", truncate=2.0, beta=0.5)])
def test_padding_and_garbage_do_not_change_loss_or_gradients(off_policy, kl_cfg):
    batch, logp, ref = _batch()
    lcfg = LearnerConfig(task_off_policy=off_policy)
    loss_a, grad_a, m_a = _grad(batch, logp, ref, kl_cfg, lcfg=lcfg)
    extra, B = 4, batch.num_sequences

    def nan(x):  # garbage off-response
        return torch.where(batch.response_mask, x, float("nan"))

    def pad(x, v):
        return torch.cat([x, torch.full((B, extra), v, dtype=x.dtype)], dim=1)

    padded = _with(batch, input_ids=pad(batch.input_ids, 0),
                   attention_mask=pad(batch.attention_mask, 0),
                   response_mask=pad(batch.response_mask, False),
                   behaviour_logp=pad(nan(batch.behaviour_logp), float("inf")))
    loss_b, grad_b, m_b = _grad(padded, pad(nan(logp), float("nan")), pad(nan(ref), -float("inf")),
                                kl_cfg, lcfg=lcfg)
    assert float(loss_b) == pytest.approx(float(loss_a), rel=1e-12)
    torch.testing.assert_close(grad_b[:, : logp.shape[1]], grad_a, rtol=1e-12, atol=1e-14)
    assert torch.all(grad_b[~padded.response_mask] == 0)
    for key in m_a:
        assert m_b[key] == pytest.approx(m_a[key], rel=1e-9), key


def test_tis_weights_are_capped_and_detached():
    batch, logp, ref = _batch(seed=3)
    cap = 1.3
    loss, grad, m = _grad(batch, logp, ref, KLConfig(beta=0.0),
                          lcfg=LearnerConfig(task_off_policy="tis", tis_cap=cap))
    mask = batch.response_mask
    rho = torch.exp(logp - batch.behaviour_logp)
    w = torch.clamp(rho, max=cap)
    expected = torch.where(mask, -w * batch.advantages[:, None] / N_GLOBAL, 0.0)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-14)
    assert float(loss) == pytest.approx(float((expected * logp).sum()), rel=1e-12)
    assert m["is/tis_clipped_frac"] == pytest.approx(float(((rho > cap) & mask).sum() / mask.sum()))
    assert 0 < m["is/tis_clipped_frac"] < 1  # the seed exercises both branches


def test_ppo_clip_objective_and_gradient():
    batch, logp, ref = _batch(seed=5)
    eps = 0.15
    loss, grad, m = _grad(batch, logp, ref, KLConfig(beta=0.0),
                          lcfg=LearnerConfig(task_off_policy="ppo_clip", ppo_clip_eps=eps))
    mask = batch.response_mask
    rho = torch.exp(logp - batch.behaviour_logp)
    A = batch.advantages[:, None].expand_as(rho)
    obj = torch.minimum(rho * A, rho.clamp(1 - eps, 1 + eps) * A)
    assert float(loss) == pytest.approx(float(-(obj * mask).sum() / N_GLOBAL), rel=1e-12)
    # gradient: -A rho / N where the unclipped branch is active, 0 where the clip binds
    clipped = ((A > 0) & (rho > 1 + eps)) | ((A < 0) & (rho < 1 - eps))
    expected = torch.where(mask & ~clipped, -A * rho / N_GLOBAL, 0.0)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-14)
    clipped_frac = float((clipped & mask).sum() / mask.sum())
    assert m["is/ppo_clip_clipped_frac"] == pytest.approx(clipped_frac)
    assert 0 < float((clipped & mask).sum()) < float(mask.sum())


@pytest.mark.parametrize("kl_cfg", [KLConfig(beta=0.4),
                                    KLConfig(estimator="k3", placement="loss", beta=0.4)])
def test_on_policy_all_task_modes_agree(kl_cfg):
    batch, logp, ref = _batch(seed=2)
    batch = _with(batch, behaviour_logp=torch.where(batch.response_mask, logp, 0.0))
    grads = [_grad(batch, logp, ref, kl_cfg, lcfg=LearnerConfig(task_off_policy=o))
             for o in TASK_OFF_POLICIES]
    for _, g, m in grads[1:]:
        torch.testing.assert_close(g, grads[0][1], rtol=1e-12, atol=1e-14)
        assert m["is/ratio_min"] == m["is/ratio_max"] == 1.0
        assert m.get("is/masked_token_frac", 0.0) == m.get("is/masked_sample_frac", 0.0) == 0.0


def test_ppo_clip_survives_extreme_log_ratios():
    batch, logp, ref = _batch()
    huge = torch.where(batch.response_mask, torch.full_like(logp, -200.0), 0.0)  # rho = e^200
    batch = _with(batch, behaviour_logp=huge, advantages=batch.advantages.abs())  # A > 0: clipped
    loss, grad, m = _grad(batch, logp, ref, KLConfig(beta=0.0),
                          lcfg=LearnerConfig(task_off_policy="ppo_clip"))
    assert torch.isfinite(loss) and torch.all(torch.isfinite(grad)) and torch.all(grad == 0)
    assert math.isinf(m["is/ratio_max"]) or m["is/ratio_max"] > 1e80


def test_normalized_folds_the_kl_reward_into_the_task_advantage():
    batch, logp, ref = _batch(groups=(3, 4))
    beta, adv_cfg = 0.5, AdvantageConfig(estimator="rloo", normalize="group")
    cfg = KLConfig(estimator="k3", placement="reward", beta=beta, kl_in_advantage="normalized")
    _, grad, m = _grad(batch, logp, ref, cfg, adv_cfg=adv_cfg)
    mask = batch.response_mask
    k = torch.where(mask, kl.estimate(logp, ref, "k3"), 0.0)
    a_tok = kl.compute_advantages(batch.rewards, batch.group_ids, estimator="rloo",
                                  normalize="group", kl_tokens=k, mask=mask, beta=beta,
                                  kl_in_advantage="normalized")
    expected = torch.where(mask, -a_tok / N_GLOBAL, 0.0)  # batch.advantages is NOT used
    assert m["loss/kl"] == 0.0
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-14)


def test_separate_keeps_the_controller_advantage_and_an_unnormalised_kl_reward():
    """separate: grad = -A_i/N + beta/N (R_t - b_i), i.e. the same as per-token advantages from
    kl.compute_advantages(kl_in_advantage='separate') when A_i is the task part."""
    batch, logp, ref = _batch(groups=(3, 4))
    beta, adv_cfg = 0.5, AdvantageConfig()
    task_adv = kl.compute_advantages(batch.rewards, batch.group_ids)
    batch = _with(batch, advantages=task_adv)
    _, grad, _ = _grad(batch, logp, ref, KLConfig(placement="reward", beta=beta), adv_cfg=adv_cfg)
    mask = batch.response_mask
    a_tok = kl.compute_advantages(batch.rewards, batch.group_ids, kl_tokens=logp - ref, mask=mask,
                                  beta=beta, kl_in_advantage="separate")
    torch.testing.assert_close(grad, torch.where(mask, -a_tok / N_GLOBAL, 0.0), rtol=1e-12,
                               atol=1e-14)


def test_normalized_with_ignored_options_is_rejected():
    from pydantic import ValidationError

    batch, logp, ref = _batch()
    with pytest.raises(ValidationError, match="does not reach a KL reward folded"):
        KLConfig(placement="reward", importance="token", kl_in_advantage="normalized")
    cfg = KLConfig(placement="reward", kl_in_advantage="normalized")
    with pytest.raises(ValueError, match="normalize=batch"):
        policy_loss(logp, ref, batch, cfg, AdvantageConfig(normalize="batch"), LearnerConfig(),
                    N_GLOBAL)


def test_the_loss_is_checked_when_built_and_takes_only_tensors():
    """PolicyLoss refuses incompatible settings at construction (before any batch), and one
    object gives exactly the one-off policy_loss on every call."""
    with pytest.raises(ValueError, match="normalize=batch"):
        PolicyLoss(KLConfig(placement="reward", kl_in_advantage="normalized"),
                   AdvantageConfig(normalize="batch"), LearnerConfig())
    kl_cfg, adv, lcfg = KLConfig(placement="reward", beta=0.3), AdvantageConfig(), LearnerConfig()
    loss = PolicyLoss(kl_cfg, adv, lcfg)
    for seed in (1, 2):
        batch, logp, ref = _batch(seed=seed)
        got, m = loss(logp, ref, batch, N_GLOBAL)
        want, m_want = policy_loss(logp, ref, batch, kl_cfg, adv, lcfg, N_GLOBAL)
        assert float(got) == float(want) and m == m_want


@pytest.mark.parametrize("lcfg", [
    LearnerConfig(task_off_policy="tis", tis_cap=1.2),
    LearnerConfig(task_off_policy="seq_mask_geo", mask_high=1.5),
    LearnerConfig(task_off_policy="icepop", mask_low=0.3, mask_high=3.0)],
    ids=lambda c: c.task_off_policy)
def test_split_batch_losses_gradients_and_metrics_add_up(lcfg):
    """What shards and micro-batches rely on: with the same N, the parts' losses and gradients
    sum to the whole batch's, and merge_metrics reproduces the whole batch's metrics (the masked
    share of samples weighted by the parts' samples, of tokens by their tokens)."""
    batch, logp, ref = _batch(groups=(2, 2, 3, 3))
    cfg = KLConfig(estimator="k3", placement="reward+loss", importance="prefix", truncate=1.5,
                   beta=0.3)
    loss, grad, m = _grad(batch, logp, ref, cfg, lcfg=lcfg)
    parts, total, g_sum = [], 0.0, torch.zeros_like(grad)
    for r in range(2):
        idx = batch.shard_indices(r, 2)
        part = batch.select(idx)
        width = part.input_ids.shape[1]
        l_r, g_r, m_r = _grad(part, logp[idx, :width], ref[idx, :width], cfg, lcfg=lcfg)
        total += float(l_r)
        g_sum[idx, :width] += g_r
        parts.append(m_r)
    assert total == pytest.approx(float(loss), rel=1e-12)
    torch.testing.assert_close(g_sum, grad, rtol=1e-12, atol=1e-14)
    merged = merge_metrics(parts)
    assert merged.keys() == m.keys()
    if lcfg.task_off_policy != "tis":  # the seed masks some but not all in each part
        assert all(0 < p["is/masked_sample_frac"] < 1 for p in parts)
        assert parts[0]["response/tokens"] / parts[0]["response/sequences"] != \
            parts[1]["response/tokens"] / parts[1]["response/sequences"]
    for key in m:
        assert merged[key] == pytest.approx(m[key], rel=1e-9, abs=1e-12), key


def test_metrics_ratio_and_truncation():
    batch, logp, ref = _batch(seed=4)
    cfg = KLConfig(importance="prefix", truncate=1.1, beta=0.1)
    _, _, m = _grad(batch, logp, ref, cfg)
    mask = batch.response_mask
    log_rho = torch.where(mask, logp - batch.behaviour_logp, 0.0)
    rho = torch.exp(log_rho)[mask]
    assert m["is/ratio_min"] == pytest.approx(float(rho.min()))
    assert m["is/ratio_max"] == pytest.approx(float(rho.max()))
    w = torch.exp(log_rho.cumsum(-1))
    assert m["is/truncated_frac"] == pytest.approx(float(((w > 1.1) & mask).sum() / mask.sum()))
    w = torch.exp(torch.where(mask, logp - batch.behaviour_logp, 0.0).cumsum(-1))
    k1 = torch.where(mask, w * (logp - ref), 0.0).sum(-1)
    assert m["kl/pi_ref"] == pytest.approx(float(k1.mean()))
    mu_ref = torch.where(mask, batch.behaviour_logp - ref, 0.0).sum(-1)
    assert m["kl/mu_ref"] == pytest.approx(float(mu_ref.mean()))
    assert m["response/length_mean"] == pytest.approx(float(mask.sum(-1).double().mean()))


def test_abs_log_ratio_metrics_measure_the_learner_sampler_mismatch():
    """is/abs_log_ratio_token_mean and _max: mean and max of |log pi - log mu| over response
    tokens (padding and prompt excluded), 0 when pi = mu; merged across parts as a token mean
    (a sequence-weighted mean would be wrong when parts differ in tokens per sequence)."""
    batch, logp, ref = _batch(seed=5)
    mask = batch.response_mask
    _, _, m = _grad(batch, logp, ref, KLConfig())
    diff = (logp - batch.behaviour_logp)[mask].abs()
    assert m["is/abs_log_ratio_token_mean"] == pytest.approx(float(diff.mean()))
    assert m["is/abs_log_ratio_max"] == pytest.approx(float(diff.max()))
    on_policy = torch.where(mask, batch.behaviour_logp, logp)  # pi = mu on every response token
    _, _, m0 = _grad(batch, on_policy, ref, KLConfig())
    assert m0["is/abs_log_ratio_token_mean"] == 0.0 == m0["is/abs_log_ratio_max"]
    _, _, empty = _grad(_with(batch, response_mask=torch.zeros_like(mask)), logp, ref, KLConfig())
    assert empty["is/abs_log_ratio_token_mean"] == 0.0 == empty["is/abs_log_ratio_max"]

    # One part of 1 sequence x 10 tokens at 0.5, one of 3 sequences x 1 token at 0.1.
    parts = [{"is/abs_log_ratio_token_mean": 0.5, "is/abs_log_ratio_max": 0.5,
              "response/tokens": 10.0, "response/sequences": 1.0},
             {"is/abs_log_ratio_token_mean": 0.1, "is/abs_log_ratio_max": 0.2,
              "response/tokens": 3.0, "response/sequences": 3.0}]
    merged = merge_metrics(parts)
    assert merged["is/abs_log_ratio_token_mean"] == pytest.approx((10 * 0.5 + 3 * 0.1) / 13)
    assert merged["is/abs_log_ratio_max"] == 0.5


def test_nan_advantage_gives_a_nonfinite_loss():
    """The rank refuses such a step; the loss must not hide the NaN."""
    batch, logp, ref = _batch()
    adv = batch.advantages.clone()
    adv[1] = float("nan")
    loss, _, _ = _grad(_with(batch, advantages=adv), logp, ref, KLConfig())
    assert not torch.isfinite(loss)


def test_sequence_logprobs_alignment():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g)
    ids = torch.randint(0, 11, (2, 5), generator=g)
    out = sequence_logprobs(logits, ids)
    ref = torch.log_softmax(logits, -1)
    assert torch.all(out[:, 0] == 0)
    for t in range(1, 5):
        torch.testing.assert_close(out[:, t], ref[torch.arange(2), t - 1, ids[:, t]])


def test_shard_keeps_groups_whole_and_sizes_equal():
    batch, _, _ = _batch(groups=(2, 2, 2, 2, 2, 2))
    batch = _with(batch, group_ids=torch.tensor([5, 5, 3, 3, 9, 9, 1, 1, 4, 4, 0, 0]))
    seen = []
    for r in range(3):
        s = batch.shard(r, 3)
        assert s.num_sequences == 4
        assert s.input_ids.shape[1] == int(s.attention_mask.sum(-1).max())  # padding trimmed
        seen += s.group_ids.tolist()
    assert sorted(seen) == sorted(batch.group_ids.tolist())
    with pytest.raises(ValueError, match="multiple of learner.num_ranks"):
        batch.shard(0, 5)
    uneven = _with(batch, group_ids=torch.tensor([1, 1, 1, 2, 2, 2, 3, 3, 4, 4, 5, 5]))
    assert uneven.shard(0, 2).group_ids.tolist() == [1, 1, 1, 2, 2, 2]  # 6 + 6, in order
    packed, _, _ = _batch(groups=(2, 2, 3, 3))  # in order 2+2 | 3+3 fails; packing gives 3+2 | 3+2
    for r in range(2):
        sizes = torch.unique(packed.shard(r, 2).group_ids, return_counts=True)[1]
        assert sorted(sizes.tolist()) == [2, 3]
    with pytest.raises(ValueError, match="without splitting a group"):
        _with(batch, group_ids=torch.tensor([1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 3, 3])).shard(0, 3)


def test_learner_config_bounds():
    from pydantic import ValidationError

    LearnerConfig(zero_stage=3, num_ranks=2, task_off_policy="ppo_clip")
    for bad in ({"zero_stage": 4}, {"lr": 0}, {"num_ranks": 0}, {"tis_cap": 0},
                {"ppo_clip_eps": 1.0}, {"unknown": 1}, {"dtype": "bfloat16"},
                {"task_off_policy": "clip"}):
        with pytest.raises(ValidationError):
            LearnerConfig(**bad)
    LearnerConfig(dtype="bfloat16", num_gpus_per_rank=1)


def test_the_task_term_table_names_exactly_the_configs_choices():
    """learner.task_off_policy: one TASK_TERMS entry per name of the config's Literal, and a
    name outside the table (a config built without validation) is refused with the supported
    names listed."""
    from typing import get_args

    from learner.config import TaskOffPolicy
    from learner.task_terms import TASK_TERMS

    assert TASK_OFF_POLICIES == tuple(TASK_TERMS) == get_args(TaskOffPolicy)
    assert [n for n, t in TASK_TERMS.items() if not t.uses_ratio] == ["none"]
    batch, logp, ref = _batch()
    unchecked = LearnerConfig.model_construct(task_off_policy="clip")
    with pytest.raises(ValueError, match=r"learner.task_off_policy must be one of "
                                         + re.escape(f"{TASK_OFF_POLICIES}, got 'clip'")):
        _grad(batch, logp, ref, KLConfig(beta=0.0), lcfg=unchecked)
