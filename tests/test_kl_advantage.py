"""Advantage estimators and the KL reward inside them."""
import itertools

import pytest
import torch

import kl
from kl import toy as T


def test_baselines_match_their_definitions():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 5.0], dtype=torch.float64)
    gid = torch.tensor([0, 0, 0, 0, 7, 7])
    rloo = kl.group_baseline(r, gid, "rloo")
    assert torch.allclose(rloo, torch.tensor([1 / 3, 2 / 3, 2 / 3, 1 / 3, 5.0, 3.0],
                                             dtype=torch.float64))
    mean = kl.group_baseline(r, gid, "grpo")
    assert torch.allclose(mean, torch.tensor([0.5] * 4 + [4.0] * 2, dtype=torch.float64))
    assert torch.equal(kl.group_baseline(r, gid, "drgrpo"), mean)
    assert torch.equal(kl.group_baseline(r, gid, "reinforce"), torch.zeros_like(r))
    with pytest.raises(ValueError, match="at least 2"):
        kl.group_baseline(r, torch.arange(6), "rloo")


def test_normalisation_scopes():
    r = torch.tensor([1.0, 0.0, 3.0, 5.0], dtype=torch.float64)
    gid = torch.tensor([0, 0, 1, 1])
    a = kl.compute_advantages(r, gid, estimator="grpo", normalize="group", eps=0.0)
    assert torch.allclose(a, torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=torch.float64))
    b = kl.compute_advantages(r, gid, estimator="drgrpo", normalize="batch", eps=0.0)
    assert torch.allclose(b, (r - torch.tensor([0.5, 0.5, 4, 4])) / r.std(unbiased=False))
    # constant-reward groups give zero advantage, not NaN
    z = kl.compute_advantages(torch.ones(4), gid, estimator="rloo", normalize="group")
    assert torch.equal(z, torch.zeros(4, dtype=torch.float64))


def _kl_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.rand(4, 5, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1] * 5, [1] * 3 + [0] * 2, [1] * 4 + [0], [1] * 2 + [0] * 3],
                        dtype=torch.bool)
    return k, mask


def test_separate_kl_part_scales_linearly_with_beta_when_task_reward_is_constant():
    k, mask = _kl_batch()
    r, gid = torch.full((4,), 0.7), torch.tensor([0, 0, 0, 0])
    adv = {beta: {mode: kl.compute_advantages(r, gid, kl_tokens=k, mask=mask, beta=beta,
                                              kl_in_advantage=mode)
                  for mode in ("separate", "normalized")} for beta in (0.1, 0.2)}
    assert torch.allclose(adv[0.2]["separate"], 2 * adv[0.1]["separate"])
    assert adv[0.1]["separate"].abs().max() > 0
    # normalised: dividing by the std of beta * K cancels beta; the update does not double
    assert torch.allclose(adv[0.2]["normalized"], adv[0.1]["normalized"], rtol=1e-4)


def test_masked_positions_get_zero_advantage():
    k, mask = _kl_batch()
    for mode in ("separate", "normalized"):
        a = kl.compute_advantages(torch.rand(4), torch.tensor([0, 0, 1, 1]), kl_tokens=k, mask=mask,
                                  beta=0.3, kl_in_advantage=mode)
        assert torch.all(a[~mask] == 0)


def test_separate_kl_advantage_equals_kl_surrogate_with_loo_baseline():
    """sum_t logp_t * A_kl,t has the same gradient as -beta * kl.surrogate(reward, baseline=LOO)."""
    g = torch.Generator().manual_seed(1)
    logp = -torch.rand(4, 5, generator=g, dtype=torch.float64)
    ref = -torch.rand(4, 5, generator=g, dtype=torch.float64)
    _, mask = _kl_batch()
    gid, beta = torch.tensor([0, 0, 1, 1]), 0.25
    k = kl.estimate(logp, ref, "k3")
    adv = kl.compute_advantages(torch.zeros(4), gid, normalize="none", kl_tokens=k, mask=mask,
                                beta=beta)
    x = logp.clone().requires_grad_(True)
    (g_adv,) = torch.autograd.grad((x * adv * mask).sum(), x)
    seq_kl = (k * mask).sum(-1)
    x2 = logp.clone().requires_grad_(True)
    s = kl.surrogate(x2, ref, mask, estimator="k3", placement="reward",
                     baseline=kl.group_baseline(seq_kl, gid, "rloo"))
    (g_sur,) = torch.autograd.grad(-beta * s.sum(), x2)
    assert torch.allclose(g_adv, g_sur, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("estimator, scale", [("rloo", 1.0), ("drgrpo", 0.5), ("reinforce", 1.0)])
def test_group_baselines_expected_gradient_exactly(estimator, scale):
    """n = 2 samples per prompt, all 31^2 pairs enumerated: RLOO and REINFORCE are unbiased
    for n * grad E[r]; a mean that includes the sample scales it by (n-1)/n."""
    toy = T.ToyProblem.make(seed=2)
    sp = toy.space
    reward = (sp.tokens == 1).sum(-1).to(torch.float64) - 0.3 * sp.mask.sum(-1)  # any task reward
    x = toy.logits.clone().requires_grad_(True)
    seq_lp = T.token_logp(x, sp).sum(-1)
    p = seq_lp.detach().exp()
    pairs = torch.tensor(list(itertools.product(range(len(p)), repeat=2)))
    group_ids = torch.arange(len(pairs)).repeat_interleave(2)
    adv = kl.compute_advantages(reward[pairs].flatten(), group_ids,
                                estimator=estimator, normalize="none").reshape(-1, 2)
    weight = p[pairs].prod(-1)
    surrogate = (weight[:, None] * adv * seq_lp[pairs]).sum()
    (g,) = torch.autograd.grad(surrogate, x)
    (target,) = torch.autograd.grad((T.sequence_prob(x, sp) * reward).sum() * 2, x)
    assert torch.allclose(g, scale * target, rtol=1e-9, atol=1e-12)


# ------------------------------------------------------------- the authors' form: "centered"


def test_centered_form_clamps_sums_and_centres_by_the_group_mean():
    """Per token clamp to +-10, sequence sum, minus the group mean (sample included), times
    -beta, added to every token's task advantage; no std, no reward-to-go."""
    r = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    gid = torch.tensor([3, 3, 8, 8])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]], dtype=torch.bool)
    k = torch.tensor([[0.5, 25.0, 9.0], [1.0, -0.5, 0.25], [-12.0, 1.0, 1.0], [2.0, 2.0, 7.0]],
                     dtype=torch.float64)
    beta = 0.2
    a = kl.compute_advantages(r, gid, estimator="drgrpo", normalize="none", kl_tokens=k,
                              mask=mask, beta=beta, kl_in_advantage="centered")
    seq = torch.tensor([0.5 + 10.0, 1.0 - 0.5 + 0.25, -10.0, 4.0], dtype=torch.float64)
    mean = torch.tensor([(seq[0] + seq[1]) / 2] * 2 + [(seq[2] + seq[3]) / 2] * 2)
    expected = (r - torch.tensor([0.5, 0.5, 0.5, 0.5])) - beta * (seq - mean)
    torch.testing.assert_close(a, torch.where(mask, expected[:, None], 0.0))
    a2 = kl.compute_advantages(r, gid, estimator="drgrpo", normalize="none", kl_tokens=k,
                               mask=mask, beta=2 * beta, kl_in_advantage="centered")
    task = torch.where(mask, (r - 0.5)[:, None], 0.0)
    torch.testing.assert_close(a2 - task, 2 * (a - task))  # exact beta: no std absorbs it


def test_centered_k1_reward_has_n_minus_1_over_n_times_the_kl_gradient_on_policy():
    """Exact by enumeration over every pair of toy sequences (groups of n = 2): the task-term
    loss -A_i logp(y_i) with the centred K1 reward has expected gradient beta (n-1)/n g*."""
    toy = T.ToyProblem.make(seed=2, ref_scale=0.5)  # |delta| < 10: the clamp does not bind
    space, beta = toy.space, 0.3
    pairs = torch.tensor(list(itertools.product(range(len(space.tokens)), repeat=2)))
    rows = pairs.reshape(-1)
    gid = torch.arange(len(pairs)).repeat_interleave(2)
    mask = space.mask[rows]

    def loss(logits):
        lp = T.token_logp(logits, space)[rows]
        ref = T.token_logp(toy.ref_logits, space)[rows]
        assert float((lp - ref).detach().abs().max()) < 10
        adv = kl.compute_advantages(torch.zeros(len(rows), dtype=torch.float64), gid,
                                    estimator="drgrpo", normalize="none", kl_tokens=lp - ref,
                                    mask=mask, beta=beta, kl_in_advantage="centered")
        p = T.sequence_prob(logits, space).detach()[pairs].prod(-1).repeat_interleave(2)
        return -(p[:, None] * adv * lp).sum() / 2  # the mean over the group's 2 samples

    g = T.grad_of(loss, toy.logits)
    g_star = T.grad_of(lambda x: T.sequence_kl(x, toy.ref_logits, space), toy.logits)
    torch.testing.assert_close(g, beta * 0.5 * g_star, rtol=1e-9, atol=1e-12)
