"""The trainer's own loss, summed exactly over every group of n toy sequences (learner.exact):
the KL's share of the expected update is what the README says, for every advantage estimator,
normalisation and off-policy handling; plus the config rules that keep the claims honest."""
from pathlib import Path

import pytest
import torch

import kl
from cluster.config.loader import ConfigError, load_config
from kl import toy as T
from kl.analysis import reference_grads, relative_error
from kl.config import AdvantageConfig, KLConfig
from learner.config import LearnerConfig
from learner.exact import enumerate_groups, expected_grad, folded_advantages
from learner.exact_table import advantage_bound, kl_part_variance, task_reward

ROOT = Path(__file__).resolve().parents[1]
TOYS = {lag: T.ToyProblem.make(vocab=3, length=3, seed=0, lag=lag) for lag in (0.0, 3.0)}
G_STAR = reference_grads(TOYS[0.0]).g_star
GROUPS = {(lag, n): enumerate_groups(toy, n, task_reward(toy.space))
          for lag, toy in TOYS.items() for n in (2, 3)}
BETA = 0.1


def _kl_share(groups, kl_cfg, adv_cfg, off_policy):
    g = groups.with_task_advantages(adv_cfg)
    lcfg = LearnerConfig(task_off_policy=off_policy)
    return (expected_grad(g, kl_cfg, adv_cfg, lcfg)
            - expected_grad(g, KLConfig(beta=0.0), adv_cfg, lcfg))


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("est,norm", [("rloo", "group"), ("grpo", "group"), ("drgrpo", "none"),
                                      ("reinforce", "none")])
def test_separate_kl_part_is_exactly_beta_times_the_kl_gradient_for_every_estimator(est, norm, n):
    """Issue #22, 2: the KL part's baseline is leave-one-out whatever the task estimator (a
    group mean including the sample, as grpo / drgrpo take for the task part, would give
    (n-1)/n beta g* on-policy, more off it): beta g* on-policy, and off-policy with
    kl.importance prefix, whatever the task part's off-policy handling."""
    adv_cfg = AdvantageConfig(estimator=est, normalize=norm)
    for lag in (0.0, 3.0):
        kl_cfg = KLConfig(estimator="k1", placement="reward", beta=BETA,
                          importance="prefix" if lag else "none")
        for off in ("none", "ppo_clip"):
            d = _kl_share(GROUPS[(lag, n)], kl_cfg, adv_cfg, off)
            assert relative_error(d, BETA * G_STAR) < 1e-10, (lag, off)


def test_kl_baseline_leaves_the_sample_out():
    seq = torch.tensor([1.0, 2.0, 6.0, 5.0, 7.0], dtype=torch.float64)
    gid = torch.tensor([0, 0, 0, 1, 2])
    loo = torch.tensor([4.0, 3.5, 1.5, 0.0, 0.0], dtype=torch.float64)  # singletons: no baseline
    for est in ("rloo", "grpo", "drgrpo"):
        torch.testing.assert_close(kl.kl_baseline(seq, gid, est), loo)
    assert torch.equal(kl.kl_baseline(seq, gid, "reinforce"), torch.zeros_like(seq))


def test_normalized_gives_identical_responses_zero_advantage_and_keeps_the_group_bound():
    """Issue #22, 1: one sequence-level return, normalised, for every token. The per-token
    return (r - beta R_t) minus a per-sequence baseline, over the sequence-return std, would
    give identical responses beta x (KL before t) / eps (up to 1.25e4 for four at beta
    0.05)."""
    g = torch.Generator().manual_seed(0)
    k = torch.rand(1, 6, generator=g, dtype=torch.float64).repeat(4, 1)
    mask = torch.ones(4, 6, dtype=torch.bool)
    gid, r = torch.zeros(4, dtype=torch.long), torch.ones(4, dtype=torch.float64)
    for est in ("rloo", "grpo"):
        a = kl.compute_advantages(r, gid, estimator=est, kl_tokens=k, mask=mask, beta=0.05,
                                  kl_in_advantage="normalized")
        assert float(a.abs().max()) < 1e-9  # 0 up to float64 rounding over eps
        k2 = k.clone()
        k2[0, 3] += 1e-3  # one token differs slightly: still within the group bound
        a = kl.compute_advantages(r, gid, estimator=est, kl_tokens=k2, mask=mask, beta=0.05,
                                  kl_in_advantage="normalized")
        assert float(a.abs().max()) <= advantage_bound(est, "group", 4)
    # every group of the toy, exactly enumerated (identical responses included)
    for n in (2, 3):
        groups = GROUPS[(0.0, n)]
        same = (groups.seqs == groups.seqs[:, :1]).all(-1).repeat_interleave(n)
        for est in ("rloo", "grpo"):
            adv_cfg = AdvantageConfig(estimator=est, normalize="group")
            adv = folded_advantages(groups, KLConfig(beta=0.05, kl_in_advantage="normalized"),
                                    adv_cfg)
            assert float(adv.abs().max()) <= advantage_bound(est, "group", n) * (1 + 1e-12)
            assert float(adv[same].abs().max()) < 1e-9


@pytest.mark.parametrize("n", [2, 3])
def test_normalized_and_centered_kl_share_on_policy(n):
    """The documented gradient of the folded forms on-policy: normalized without a std is
    beta g* (rloo, reinforce) or (n-1)/n beta g* (drgrpo, the mean includes the sample);
    centered is (n-1)/n beta g* with any task estimator."""
    groups = GROUPS[(0.0, n)]
    shrink = (n - 1) / n
    for est, norm, mode, scale in [("rloo", "none", "normalized", 1.0),
                                   ("reinforce", "none", "normalized", 1.0),
                                   ("drgrpo", "none", "normalized", shrink),
                                   ("grpo", "group", "centered", shrink),
                                   ("rloo", "none", "centered", shrink)]:
        d = _kl_share(groups, KLConfig(beta=BETA, kl_in_advantage=mode),
                      AdvantageConfig(estimator=est, normalize=norm), "tis")
        assert relative_error(d, scale * BETA * G_STAR) < 1e-10, (est, mode)


def test_centered_kl_part_goes_through_the_task_terms_off_policy_handling():
    """Issue #22, 5 (what docs/kl.md says where `centered` is chosen): folded into the
    advantage, the centred KL reward is weighted by tis / clipped by ppo_clip, so off-policy
    the three task_off_policy options give three different KL updates."""
    groups = GROUPS[(3.0, 2)]
    adv_cfg = AdvantageConfig(estimator="drgrpo", normalize="none")
    cfg = KLConfig(beta=BETA, kl_in_advantage="centered")
    shares = [_kl_share(groups, cfg, adv_cfg, o) for o in ("none", "tis", "ppo_clip")]
    assert relative_error(shares[1], shares[0]) > 1e-3
    assert relative_error(shares[2], shares[0]) > 1e-2


def test_docs_state_the_measured_variance_of_centered():
    """Issue #22, 5: the KL page (docs/kl.md) states how the variance of `centered` compares
    with the separate KL part's on the toy; this recomputes it."""
    var = kl_part_variance()
    raw_lower = sum(v["centered"] < v["separate"] for v in var)
    scaled_higher = sum(v["centered_scaled"] > v["separate_scaled"] for v in var)
    readme = (ROOT / "docs" / "kl.md").read_text()
    assert f"lower in {raw_lower} of {len(var)}" in readme
    assert f"higher in {scaled_higher} of {len(var)}" in readme
    assert "more variance than reward-to-go" not in readme
    assert "more variance than reward-to-go" not in (ROOT / "kl" / "advantage.py").read_text()


TINY = ROOT / "configs" / "tiny_cpu.yaml"


def _train_config(*overrides):
    from cluster.config.train_config import TrainConfig

    return load_config(TrainConfig, TINY, list(overrides))


@pytest.mark.parametrize("est", ["grpo", "drgrpo"])
def test_group_mean_estimators_refuse_one_sample_per_prompt(est):
    """Issue #22, 6: the group mean of one sample is the sample: every advantage would be 0."""
    norm = "group" if est == "grpo" else "none"
    with pytest.raises(ConfigError, match=f"estimator={est} with rollout.samples_per_prompt=1"):
        _train_config(f"advantage.estimator={est}", f"advantage.normalize={norm}",
                      "rollout.samples_per_prompt=1")
    _train_config("advantage.estimator=reinforce", "advantage.normalize=none",
                  "rollout.samples_per_prompt=1")


@pytest.mark.parametrize("sampling", [["rollout.top_k=2"], ["rollout.top_p=0.9"]])
def test_truncated_sampling_refuses_importance_corrections(sampling):
    """Issue #22, 4: top-k / top-p sample a mu with no mass where pi has some; no ratio pi/mu
    recovers pi, so kl.importance and every task term that forms the ratio (tis, ppo_clip and the
    masks, which would drop tokens even on-policy) are refused with them."""
    from learner.task_terms import TASK_TERMS

    with pytest.raises(ConfigError, match="kl.importance=prefix with rollout.top"):
        _train_config(*sampling, "kl.importance=prefix", "learner.task_off_policy=none")
    assert len([n for n, t in TASK_TERMS.items() if t.uses_ratio]) == 6
    for off in (n for n, t in TASK_TERMS.items() if t.uses_ratio):
        with pytest.raises(ConfigError, match=f"learner.task_off_policy={off} with rollout.top"):
            _train_config(*sampling, f"learner.task_off_policy={off}")
    cfg = _train_config(*sampling, "learner.task_off_policy=none")
    assert cfg.kl.importance == "none"
    _train_config("rollout.temperature=0.7", "kl.importance=prefix")  # tempered mu: full support


def test_truncated_sampler_biases_the_prefix_weighted_kl_estimate():
    """Why: with top-k 2 of 3 the weighted estimate sum_t w_t k1_t under the truncated sampler
    is not KL(pi || ref) (the README flags the logged kl/pi_ref as biased then)."""
    from kl.diagnostics import sequence_kl_estimates

    toy = T.ToyProblem.make(seed=0)
    sp = toy.space
    table = torch.log_softmax(toy.logits, -1)
    kth = table.topk(2, -1).values[:, -1:]
    trunc = torch.log_softmax(torch.where(table >= kth, toy.logits, float("-inf")), -1)
    mu_tok = torch.where(sp.mask, trunc[sp.rows, sp.tokens], 0.0)
    mu_seq = torch.where(sp.mask.any(-1), mu_tok.sum(-1).exp(), 0.0)
    pi_tok, ref_tok = T.token_logp(toy.logits, sp), T.token_logp(toy.ref_logits, sp)
    true = float(T.sequence_kl(toy.logits, toy.ref_logits, sp))

    def weighted_under(sampler_tok):  # E_mu of the logged estimate, exactly over the toy
        seq = torch.where(sp.mask.any(-1), sampler_tok.sum(-1).exp(), 0.0)
        est = sequence_kl_estimates(pi_tok, ref_tok, sampler_tok, sp.mask)
        return float(seq @ torch.nan_to_num(est["pi_ref"]))
    # the estimator itself is right: sampled by pi (full support) it is KL(pi || ref) exactly
    assert weighted_under(pi_tok) == pytest.approx(true, rel=1e-9)
    # by the truncated sampler it misses the sequences mu never draws: far from KL
    assert mu_seq.sum() == pytest.approx(1.0) and abs(weighted_under(mu_tok) - true) > 0.05
