"""The KL the trainer logs, checked by exact enumeration on the toy: off-policy, a plain batch
mean of K1 is not KL(pi || ref); the logged estimates are unbiased for what their names say."""
from pathlib import Path

import pytest
import torch

from kl.diagnostics import sequence_kl_estimates
from kl.toy import ToyProblem, sequence_kl, sequence_prob, token_logp


@pytest.mark.parametrize("lag", [0.0, 3.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_logged_kl_estimates_are_unbiased_for_their_names(seed, lag):
    toy = ToyProblem.make(seed=seed, lag=lag)
    space = toy.space
    lp, ref = token_logp(toy.logits, space), token_logp(toy.ref_logits, space)
    mu = token_logp(toy.behaviour_logits, space)
    p_mu = sequence_prob(toy.behaviour_logits, space)  # sequences are sampled by mu
    est = sequence_kl_estimates(lp, ref, mu, space.mask)
    expect = {name: float((p_mu * v).sum()) for name, v in est.items()}
    true_pi = float(sequence_kl(toy.logits, toy.ref_logits, space))
    true_mu = float(sequence_kl(toy.behaviour_logits, toy.ref_logits, space))
    assert expect["pi_ref"] == pytest.approx(true_pi, rel=1e-10)
    assert expect["pi_ref_k3"] == pytest.approx(true_pi, rel=1e-10)
    assert expect["mu_ref"] == pytest.approx(true_mu, rel=1e-10)
    naive = float((p_mu * torch.where(space.mask, lp - ref, 0.0).sum(-1)).sum())
    if lag:  # the old `kl/seq_k1`: off-policy it estimates neither KL
        assert abs(naive - true_pi) > 0.02 and abs(naive - true_mu) > 0.02
    else:
        assert naive == pytest.approx(true_pi, rel=1e-10)


def test_the_documented_example():
    """docs/design.md, docs/kl.md and kl/diagnostics.py quote this toy's naive estimate against
    the true KL(pi||ref): each quotes the figures computed here."""
    toy = ToyProblem.make(seed=0, lag=3.0)
    space = toy.space
    lp, ref = token_logp(toy.logits, space), token_logp(toy.ref_logits, space)
    naive = float((sequence_prob(toy.behaviour_logits, space) * (lp - ref).sum(-1)).sum())
    true = float(sequence_kl(toy.logits, toy.ref_logits, space))
    assert abs(naive - true) > 0.1  # the point of the example: far apart
    root = Path(__file__).resolve().parents[1]
    for page in ("docs/design.md", "docs/kl.md", "kl/diagnostics.py"):
        text = " ".join((root / page).read_text().split())  # line breaks as spaces
        assert f"{naive:.3f}" in text and f"{true:.3f}" in text, page


def test_masked_positions_do_not_matter():
    toy = ToyProblem.make(seed=4, lag=2.0)
    space = toy.space
    lp, ref = token_logp(toy.logits, space), token_logp(toy.ref_logits, space)
    mu = token_logp(toy.behaviour_logits, space)
    a = sequence_kl_estimates(lp, ref, mu, space.mask)

    def junk(x):
        return torch.where(space.mask, x, float("nan"))

    b = sequence_kl_estimates(junk(lp), junk(ref), junk(mu), space.mask)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0)
