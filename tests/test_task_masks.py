"""The masks of the task term (learner/task_terms.py: icepop, mis, seq_mask_geo, seq_mask_prod),
without any engine: each one's gradient written here from its formula, what it logs, its
interaction with the KL term, and the refusals of its band. Their bias in expectation is
learner/exact_masks.py's (`klrl kl-table`, tests/test_cli_kl_table.py)."""
import pytest
import torch
from pydantic import ValidationError

from kl.config import AdvantageConfig, KLConfig
from learner.config import LearnerConfig
from learner.loss import policy_loss
from learner.task_term_traits import MASKING_TERMS, TASK_OFF_POLICIES
from test_learner_loss import N_GLOBAL, _batch, _grad, _with

NO_KL = KLConfig(beta=0.0)


def _ratios(batch, logp):
    mask = batch.response_mask
    log_rho = torch.where(mask, logp - batch.behaviour_logp, 0.0)
    return mask, log_rho, torch.exp(log_rho)


def test_icepop_weights_tokens_inside_the_band_and_drops_the_others():
    """-sg(rho_t 1[low <= rho_t <= high]) A logp_t: the gradient of a token is -A rho_t / N
    inside the band and exactly 0 outside, on both sides (the seed has tokens below, inside and
    above [0.5, 2])."""
    batch, logp, ref = _batch(seed=3)
    lcfg = LearnerConfig(task_off_policy="icepop")
    loss, grad, m = _grad(batch, logp, ref, NO_KL, lcfg=lcfg)
    mask, _, rho = _ratios(batch, logp)
    inside = (rho >= 0.5) & (rho <= 2.0)
    A = batch.advantages[:, None]
    expected = torch.where(mask & inside, -A * rho / N_GLOBAL, 0.0)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-14)
    assert float(loss) == pytest.approx(float((expected * logp).sum()), rel=1e-12)
    out = mask & ~inside
    assert (out & (rho < 0.5)).any() and (out & (rho > 2)).any() and (mask & inside).any()
    assert m["is/masked_token_frac"] == pytest.approx(float(out.sum() / mask.sum()))
    assert m["is/masked_sample_frac"] == pytest.approx(float(out.any(-1).double().mean()))
    assert "is/icepop_clipped_frac" not in m  # a mask reweights nothing it keeps


def test_mis_weights_every_token_by_its_sequence_ratio_inside_the_band():
    """-sg(R_i 1[low <= R_i <= high]) A logp_t, R_i = prod_t rho_t (TRL's sequence_mask)."""
    batch, logp, ref = _batch(seed=1)
    lcfg = LearnerConfig(task_off_policy="mis", mask_low=0.2, mask_high=5.0)
    _, grad, m = _grad(batch, logp, ref, NO_KL, lcfg=lcfg)
    mask, log_rho, _ = _ratios(batch, logp)
    R = torch.exp(log_rho.sum(-1, keepdim=True))
    kept = (R >= 0.2) & (R <= 5.0)
    assert kept.any() and not kept.all()
    expected = torch.where(mask & kept, -batch.advantages[:, None] * R / N_GLOBAL, 0.0)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-14)
    assert m["is/masked_sample_frac"] == pytest.approx(float((~kept).double().mean()))


@pytest.mark.parametrize("name", ["seq_mask_geo", "seq_mask_prod"])
def test_sequence_masks_drop_whole_samples_and_keep_tis_weights(name):
    """A sample whose geometric-mean (or product) ratio leaves the band loses every token's
    gradient; the others keep tis's -sg(min(rho_t, C)) A logp_t. The two criteria differ on
    this batch, so each is the one its name says."""
    batch, logp, ref = _batch(seed=4)
    lcfg = LearnerConfig(task_off_policy=name, tis_cap=1.5, mask_low=0.6, mask_high=1.6)
    _, grad, m = _grad(batch, logp, ref, NO_KL, lcfg=lcfg)
    mask, log_rho, rho = _ratios(batch, logp)
    geo = torch.exp(log_rho.sum(-1) / mask.sum(-1))
    prod = torch.exp(log_rho.sum(-1))
    keep = {"seq_mask_geo": (geo >= 0.6) & (geo <= 1.6),
            "seq_mask_prod": (prod >= 0.6) & (prod <= 1.6)}
    assert not torch.equal(keep["seq_mask_geo"], keep["seq_mask_prod"])
    kept = keep[name][:, None]
    assert kept.any() and not kept.all()
    w = rho.clamp(max=1.5)
    expected = torch.where(mask & kept, -batch.advantages[:, None] * w / N_GLOBAL, 0.0)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-14)
    dropped = (~kept).squeeze(-1)
    assert m["is/masked_sample_frac"] == pytest.approx(float(dropped.double().mean()))
    assert m["is/masked_token_frac"] == pytest.approx(
        float((mask & ~kept).sum() / mask.sum()))
    assert m[f"is/{name}_clipped_frac"] == pytest.approx(
        float((mask & kept & (rho > 1.5)).sum() / mask.sum()))


@pytest.mark.parametrize("name", MASKING_TERMS)
def test_masks_survive_extreme_log_ratios(name):
    """A ratio of e^+-200 (a token the sampler all but never draws, or the reverse) is masked
    without forming an inf or a NaN anywhere."""
    batch, logp, ref = _batch()
    mask = batch.response_mask
    sign = torch.where(torch.arange(mask.shape[0])[:, None] % 2 == 0, 1.0, -1.0)
    far = torch.where(mask, logp + sign * 200.0, 0.0).to(logp.dtype)
    loss, grad, m = _grad(_with(batch, behaviour_logp=far), logp, ref, NO_KL,
                          lcfg=LearnerConfig(task_off_policy=name))
    assert torch.isfinite(loss) and torch.all(torch.isfinite(grad)) and torch.all(grad == 0)
    assert m["is/masked_token_frac"] == 1.0 and m["is/masked_sample_frac"] == 1.0


SEPARATE_KL = [KLConfig(beta=0.3, importance="prefix"),
               KLConfig(estimator="k3", placement="loss", beta=0.3),
               KLConfig(estimator="k3", placement="reward+loss", importance="prefix", beta=0.3)]


@pytest.mark.parametrize("kl_cfg", SEPARATE_KL, ids=lambda c: f"{c.estimator}-{c.placement}")
def test_masks_leave_the_separate_kl_term_whole(kl_cfg):
    """With kl_in_advantage separate the KL's share of the gradient (beta > 0 minus beta 0,
    real advantages) is the same under every task term, masked tokens included: a mask drops
    the task gradient of a token, never its KL term (that term's off-policy handling is
    kl.importance)."""
    batch, logp, ref = _batch(seed=3)
    shares = {}
    for off in TASK_OFF_POLICIES:
        lcfg = LearnerConfig(task_off_policy=off)
        shares[off] = (_grad(batch, logp, ref, kl_cfg, lcfg=lcfg)[1]
                       - _grad(batch, logp, ref, NO_KL, lcfg=lcfg)[1])
    masked = _grad(batch, logp, ref, NO_KL, lcfg=LearnerConfig(task_off_policy="icepop"))[2]
    assert masked["is/masked_token_frac"] > 0.2
    for off, share in shares.items():
        torch.testing.assert_close(share, shares["none"], rtol=1e-10, atol=1e-13, msg=off)
    assert shares["none"][batch.response_mask].abs().min() > 0


@pytest.mark.parametrize("kia", ["normalized", "centered"])
def test_a_folded_kl_reward_is_masked_with_its_token(kia):
    """With kl_in_advantage normalized / centered the KL reward is part of the per-token
    advantage, so a masked token's whole gradient, KL part included, is 0, as in OpenRLHF's and
    AReaL's in-reward KL; under tis the same tokens keep a non-zero one."""
    batch, logp, ref = _batch(seed=3)
    kl_cfg = KLConfig(beta=0.3, kl_in_advantage=kia)
    adv = AdvantageConfig(estimator="drgrpo", normalize="none") if kia == "centered" else \
        AdvantageConfig()
    mask, _, rho = _ratios(batch, logp)
    out = mask & ((rho < 0.5) | (rho > 2.0))

    def grad(off):
        x = logp.clone().requires_grad_(True)
        loss, _ = policy_loss(x, ref, batch, kl_cfg, adv, LearnerConfig(task_off_policy=off),
                              N_GLOBAL)
        loss.backward()
        return x.grad

    assert out.any()
    assert torch.all(grad("icepop")[out] == 0)
    assert torch.all(grad("tis")[out] != 0)


def test_mask_band_bounds_and_refusals():
    """The band holds 1 (so that on-policy nothing is masked), and a band moved from its
    default is refused where the task term masks nothing (it would be silently ignored)."""
    for bad in ({"mask_low": 1.0}, {"mask_low": -0.1}, {"mask_high": 1.0},
                {"mask_high": 2e6}):
        with pytest.raises(ValidationError):
            LearnerConfig(task_off_policy="icepop", **bad)
    LearnerConfig(task_off_policy="seq_mask_prod", mask_low=0.0, mask_high=1e6)
    for off in ("none", "tis", "ppo_clip"):
        with pytest.raises(ValidationError, match=f"learner.mask_high=5 bound the masks, and "
                                                  f"learner.task_off_policy={off} masks nothing"):
            LearnerConfig(task_off_policy=off, mask_high=5.0)
    LearnerConfig(task_off_policy="tis", mask_low=0.5, mask_high=2.0)  # the defaults: fine


def test_the_report_plots_the_masked_shares_a_mask_logs():
    """`klrl report`'s importance-ratio figure has a panel for each share a mask logs (a
    renamed metric would silently drop its panel)."""
    from cluster.analysis.report_plots import FIGURES

    panels = {p.key for f in FIGURES if f.file == "importance_ratio.png" for p in f.panels}
    batch, logp, ref = _batch(seed=3)
    logged = _grad(batch, logp, ref, NO_KL, lcfg=LearnerConfig(task_off_policy="icepop"))[2]
    shares = {k for k in logged if k.startswith("is/masked_")}
    assert shares == {"is/masked_token_frac", "is/masked_sample_frac"} and shares <= panels
