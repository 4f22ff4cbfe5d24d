"""Group statistics across micro-batches (what learner/rank.py does when a micro-batch cuts a
prompt's group), beta scaling of the KL advantage modes, and how the learner merges the
metrics of several updates into a step's. No engine; the batches and helpers are
test_learner_loss's."""
import pytest
import torch
from test_learner_loss import N_GLOBAL, PLAIN_PG, _batch, _grad, _with

from kl.config import AdvantageConfig, KLConfig
from learner.config import LearnerConfig
from learner.loss import policy_loss
from learner.loss_metrics import merge_metrics

ADV_CASES = [AdvantageConfig(estimator="rloo", normalize="group"),
             AdvantageConfig(estimator="grpo", normalize="group"),
             AdvantageConfig(estimator="drgrpo", normalize="none"),
             AdvantageConfig(estimator="reinforce", normalize="none")]
GROUP_CASES = [(KLConfig(estimator="k3", placement=p, beta=0.4, kl_in_advantage=mode), adv)
               for p in ("reward", "loss", "reward+loss")
               for mode in ("separate", "normalized", "centered")
               if not (mode != "separate" and p == "reward+loss")  # rejected by KLConfig
               for adv in ADV_CASES]


@pytest.mark.parametrize("micro", [1, 2, 3, 5])
@pytest.mark.parametrize("kl_cfg,adv_cfg", GROUP_CASES,
                         ids=lambda c: getattr(c, "placement", None) and
                         f"{c.placement}-{c.kl_in_advantage}" or getattr(c, "estimator", ""))
def test_micro_batches_cutting_groups_add_up_to_the_whole_batch(kl_cfg, adv_cfg, micro):
    """What learner/rank.py does: GroupStats over the whole (mini-)batch, sliced to micro-batches
    of `micro` rows that cut the groups (sizes 4, 3, 4) anywhere; the micro-batch losses and
    gradients sum to the whole batch's, and the merged metrics equal the whole batch's."""
    from learner.loss import group_stats

    batch, logp, ref = _batch(seed=6, groups=(4, 3, 4))
    lcfg = LearnerConfig(task_off_policy="tis")
    loss, grad, m = _grad(batch, logp, ref, kl_cfg, adv_cfg=adv_cfg, lcfg=lcfg)
    stats = group_stats(logp, ref, batch, kl_cfg, adv_cfg)
    total, g_sum, parts = 0.0, torch.zeros_like(grad), []
    for start in range(0, batch.num_sequences, micro):
        idx = torch.arange(start, min(batch.num_sequences, start + micro))
        part = batch.select(idx)
        x = logp[idx, :part.width].clone().requires_grad_(True)
        l_p, m_p = policy_loss(x, ref[idx, :part.width], part, kl_cfg, adv_cfg, lcfg, N_GLOBAL,
                               stats.rows(idx, part.width))
        l_p.backward()
        total += float(l_p.detach())
        g_sum[idx, :part.width] += x.grad
        parts.append(m_p)
    assert total == pytest.approx(float(loss), rel=1e-9, abs=1e-12)
    torch.testing.assert_close(g_sum, grad, rtol=1e-6, atol=1e-12)
    merged = merge_metrics(parts)
    for key in m:
        assert merged[key] == pytest.approx(m[key], rel=1e-9, abs=1e-12), key


def test_without_group_stats_a_cut_group_gives_another_gradient():
    """The control: a micro-batch left to compute its own statistics from half a group (what
    the learner did before GroupStats) does not reproduce the whole batch's gradient."""
    batch, logp, ref = _batch(seed=6, groups=(4, 3, 4))
    cfg, adv = KLConfig(estimator="k3", placement="reward", beta=0.4), AdvantageConfig()
    _, grad, _ = _grad(batch, logp, ref, cfg, adv_cfg=adv)
    g_sum = torch.zeros_like(grad)
    for idx in (torch.arange(0, 2), torch.arange(2, 11)):  # cuts the first group 2 | 2
        part = batch.select(idx)
        x = logp[idx, :part.width].clone().requires_grad_(True)
        policy_loss(x, ref[idx, :part.width], part, cfg, adv, PLAIN_PG, N_GLOBAL)[0].backward()
        g_sum[idx, :part.width] += x.grad
    assert (g_sum - grad).abs().max() > 1e-3


def test_normalized_with_reward_and_loss_is_rejected_and_separate_scales_with_beta():
    """reward+loss with the KL folded into the normalised advantage is refused at config time;
    with `separate` both parts of the KL gradient are exactly linear in beta, while a folded
    (normalized) reward part is not (the group std absorbs beta)."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="use kl_in_advantage=separate"):
        KLConfig(placement="reward+loss", kl_in_advantage="normalized")
    batch, logp, ref = _batch(seed=1, groups=(3, 4))
    batch = _with(batch, advantages=torch.zeros_like(batch.advantages),
                  rewards=torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0], dtype=torch.float64))

    def kl_grad(beta, placement, mode):
        cfg = KLConfig(estimator="k1", placement=placement, beta=beta, kl_in_advantage=mode)
        return _grad(batch, logp, ref, cfg)[1]

    for placement in ("reward", "loss", "reward+loss"):
        g1, g3 = kl_grad(0.1, placement, "separate"), kl_grad(0.3, placement, "separate")
        assert g1.abs().max() > 0
        torch.testing.assert_close(g3, 3 * g1, rtol=1e-10, atol=1e-14)
    # folded: on the first prompt (constant task reward) the KL part does not scale with beta
    g1, g3 = kl_grad(0.1, "reward", "normalized"), kl_grad(0.3, "reward", "normalized")
    first = batch.group_ids == batch.group_ids[0]
    assert not torch.allclose(g3[first], 3 * g1[first], rtol=1e-3)
    torch.testing.assert_close(g3[first], g1[first], rtol=1e-3, atol=1e-9)


def test_merge_updates_reports_each_update_and_the_step():
    from learner.loss_metrics import merge_updates

    def update(lo, hi, refused=0.0):
        return {"is/ratio_min": lo, "is/ratio_max": hi, "loss/total": hi - lo, "kl/pi_ref": 0.1,
                "response/tokens": 10.0, "response/sequences": 4.0, "grad/norm": 2.0,
                "nonfinite": refused, "time/learner_step": 1.0, "time/reference": 0.0}

    ups = [update(1.0, 1.0), update(0.9, 1.2), update(0.8, 1.1, refused=1.0), update(0.95, 1.05)]
    ups[0]["time/reference"] = 0.5  # the batch's reference forward, carried by its first update
    m = merge_updates(ups, mini_batches=2)
    assert m["is/ratio_min"] == 0.8 and m["is/ratio_max"] == 1.2
    assert m["response/sequences"] == 8.0 and m["response/tokens"] == 20.0  # one pass
    assert m["nonfinite"] == 0.0 and m["nonfinite/updates_refused"] == 1.0
    assert m["update_0/is/ratio_max"] == 1.0 and m["update_1/is/ratio_max"] == 1.2
    assert m["time/learner_step"] == 4.0 and m["time/reference"] == 0.5  # seconds add up
    assert merge_updates([update(0.8, 1.1, 1.0)] * 2, 1)["nonfinite"] == 1.0
    assert merge_updates(ups[:1], 1) == ups[0]
