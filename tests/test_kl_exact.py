"""docs/design.md's KL table, reproduced exactly by enumeration on a tabular toy policy.

Every configuration's expected gradient E_mu[grad surrogate] is computed exactly (a weighted
sum over all sequences) and compared with independently computed gradients: g* (sequence KL,
checked against finite differences), the token-level reverse/forward KL gradients and
grad E[sum K2].
"""
import pytest
import torch

from kl import toy as T
from kl.analysis import (
    KLVariant,
    all_variants,
    expected_grad,
    is_exact_correction,
    on_policy_prediction,
    reference_grads,
    relative_error,
    truncated_bias,
    truncated_prefix_bias,
    unbiased_for_g_star,
)

ON = T.ToyProblem.make(seed=0, lag=0.0)
OFF = T.ToyProblem.make(seed=0, lag=3.0)
OFF_NO_EOS = T.ToyProblem.make(seed=1, lag=3.0, eos=False)  # fixed length: 81 sequences
REFS = {id(t): reference_grads(t) for t in (ON, OFF, OFF_NO_EOS)}
VARIANTS = all_variants(truncates=(0.7, 2.0))


def test_toy_spaces_are_complete_distributions():
    assert ON.space.tokens.shape == (31, 4) and OFF_NO_EOS.space.tokens.shape == (81, 4)
    for toy in (ON, OFF_NO_EOS):
        for logits in (toy.logits, toy.ref_logits, toy.behaviour_logits):
            assert torch.isclose(T.sequence_prob(logits, toy.space).sum(),
                                 torch.tensor(1.0, dtype=torch.float64))
    # variable lengths really occur in the EOS toy
    assert set(ON.space.mask.sum(-1).tolist()) == {1, 2, 3, 4}


@pytest.mark.parametrize("toy", [ON, OFF_NO_EOS], ids=["eos", "fixed"])
def test_g_star_matches_finite_differences(toy):
    r = REFS[id(toy)]
    x0, eps = toy.logits.flatten(), 1e-6
    fd = torch.empty_like(x0)
    for i in range(x0.numel()):
        e = torch.zeros_like(x0)
        e[i] = eps

        def f(x):
            return float(T.sequence_kl(x.reshape(toy.logits.shape), toy.ref_logits, toy.space))

        fd[i] = (f(x0 + e) - f(x0 - e)) / (2 * eps)
    assert relative_error(r.g_star, fd) < 1e-7


@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: v.name)
def test_on_policy_table(v):
    """On-policy every importance option is inert (rho = 1) unless a cap C < 1 bites."""
    g, r = expected_grad(ON, v), REFS[id(ON)]
    pred = on_policy_prediction(v, r)
    if v.truncate is not None and v.truncate < 1:
        return  # capped below 1 on-policy is deliberately biased; covered by the closed form below
    if (v.estimator, v.placement) == ("k1", "loss"):
        assert g.abs().max() < 1e-12  # pure noise: exactly zero in expectation
    else:
        assert relative_error(g, pred) < 1e-6
    if unbiased_for_g_star(v):
        assert relative_error(g, r.g_star) < 1e-6
    else:
        assert relative_error(g, r.g_star) > 0.05


@pytest.mark.parametrize("toy", [OFF, OFF_NO_EOS], ids=["eos", "fixed"])
@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: v.name)
def test_off_policy_table(toy, v):
    g, r = expected_grad(toy, v), REFS[id(toy)]
    if is_exact_correction(v):
        # sequence / per-decision prefix weights recover the on-policy expectation exactly
        pred = on_policy_prediction(v, r)
        if (v.estimator, v.placement) == ("k1", "loss"):
            assert g.abs().max() < 1e-12
        else:
            assert relative_error(g, pred) < 1e-6
        if unbiased_for_g_star(v):
            assert relative_error(g, r.g_star) < 1e-6
    if v.truncate is not None:
        # capped weights trade a bounded bias for variance; the prefix cap's bias is checked
        # against its closed form below. Here: the cap must change the estimate on this toy.
        uncapped = expected_grad(toy, KLVariant(v.estimator, v.placement, v.importance))
        assert relative_error(g, uncapped) > 1e-4 or (v.estimator, v.placement, v.importance) in {
            ("k1", "loss", "token")}  # E_mu[sum_t c_t grad logp_t] = 0 for any token-level c_t(s_t)
    elif not (is_exact_correction(v) and unbiased_for_g_star(v)):
        assert relative_error(g, r.g_star) > 0.05, "a biased configuration looked unbiased"


def test_uncorrected_k1_loss_pushes_away_from_behaviour():
    """Off-policy, K1-in-loss has expectation E_mu[sum_t grad log pi] = -sum_s grad KL(mu||pi)
    at the visited states: descending it moves pi away from mu."""
    v = KLVariant("k1", "loss", "none")
    g = expected_grad(OFF, v)
    sp = OFF.space

    def cross_entropy_to_mu(x):  # token-level KL(mu || pi) at states visited by mu
        lm, lp = torch.log_softmax(OFF.behaviour_logits, -1), torch.log_softmax(x, -1)
        return (T.prefix_prob(OFF.behaviour_logits, sp) * (lm.exp() * (lm - lp)).sum(-1)).sum()

    toward_mu = T.grad_of(cross_entropy_to_mu, OFF.logits)
    assert relative_error(g, -toward_mu) < 1e-9
    assert float(g @ toward_mu) < 0  # a descent step on the K1 loss increases KL(mu || pi)


@pytest.mark.parametrize("placement", ["reward", "loss", "reward+loss"])
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("cap", [0.5, 2.0, 1e9])
def test_truncated_prefix_bias_matches_closed_form(estimator, placement, cap):
    v = KLVariant(estimator, placement, "prefix", cap)
    exact = KLVariant(estimator, placement, "prefix")
    bias = expected_grad(OFF, v) - expected_grad(OFF, exact)
    closed = truncated_prefix_bias(OFF, v)
    if cap > 1e8:  # no prefix weight reaches C: exactly unbiased
        assert bias.abs().max() < 1e-12 and closed.abs().max() == 0
    else:
        assert closed.norm() > 1e-3  # the cap bites on this toy, so the check has teeth
        assert relative_error(bias, closed) < 1e-9


@pytest.mark.parametrize("placement", ["reward", "reward+loss"])
@pytest.mark.parametrize("importance", ["token", "sequence", "prefix"])
@pytest.mark.parametrize("cap", [0.7, 2.0])
def test_truncated_bias_with_a_baseline_matches_its_closed_form(importance, placement, cap):
    """The trainer passes a baseline (the leave-one-out mean of the other samples' KL). Capped
    prefix weights keep it zero-mean (their bias is the README's closed form whatever b is);
    capped token and sequence coefficients add +b E_mu[sum_t (c_t - C)_+ grad logp_t]."""
    v, exact, b = (KLVariant("k1", placement, importance, cap),
                   KLVariant("k1", placement, importance), 0.8)
    capped = expected_grad(OFF, v, baseline=b)
    closed = truncated_bias(OFF, v, baseline=b)
    assert closed.norm() > 1e-3  # the cap bites on this toy
    assert relative_error(capped - expected_grad(OFF, exact, baseline=b), closed) < 1e-9
    without_b = relative_error(capped, expected_grad(OFF, v))
    assert without_b < 1e-9 if importance == "prefix" else without_b > 1e-4


@pytest.mark.parametrize("toy", [ON, OFF], ids=["on", "off"])
@pytest.mark.parametrize("v", [v for v in VARIANTS if v.truncate is None], ids=lambda v: v.name)
def test_constant_baseline_leaves_expectation_unchanged(toy, v):
    """A baseline is zero-mean on-policy, and off-policy whenever the score term is importance
    weighted; with importance=none off-policy it is not (E_mu[grad log pi] != 0)."""
    g0 = expected_grad(toy, v)
    g1 = expected_grad(toy, v, baseline=0.8)
    both_zero = g0.abs().max() < 1e-12 and g1.abs().max() < 1e-12
    changed = relative_error(g1, g0) > 1e-9 and not both_zero
    biased_by_baseline = toy is OFF and v.importance == "none" and v.placement != "loss"
    assert changed == biased_by_baseline


def test_dividing_by_sequence_length_is_caught(monkeypatch):
    """With variable-length sequences, a per-sequence 1/|y| reweighting breaks K1-in-reward.
    This is the mutant the table tests above would catch."""
    import kl.analysis as A

    original = A.surrogate
    v = KLVariant("k1", "reward")
    g_star = REFS[id(ON)].g_star
    assert relative_error(expected_grad(ON, v), g_star) < 1e-6
    monkeypatch.setattr(A, "surrogate",
                        lambda lp, ref, mask, **kw: original(lp, ref, mask, **kw) / mask.sum(-1))
    assert relative_error(expected_grad(ON, v), g_star) > 0.05
