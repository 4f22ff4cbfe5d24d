"""Monte-Carlo check of the unbiased configurations with sampled sequences.

Sequences are sampled from the behaviour policy, the surrogate is evaluated on the sampled
batch only, and the mean gradient is compared with the exact g*. To keep the false-alarm rate
negligible, the error is projected on a few fixed random directions and each projection's
z-score (error / standard error) must stay below 5: P(false alarm) < 6 * 5.7e-7 per config.
The same statistic must flag a biased configuration, so the test has power.
"""
import dataclasses

import pytest
import torch

from kl import toy as T
from kl.analysis import KLVariant, per_sample_grads, reference_grads

SAMPLES, DIRECTIONS, Z_MAX = 6000, 6, 5.0
OFF = T.ToyProblem.make(seed=3, lag=3.0)
G_STAR = reference_grads(OFF).g_star


def _sampled_z_scores(v: KLVariant, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mu = T.sequence_prob(OFF.behaviour_logits, OFF.space)
    idx = torch.multinomial(mu, SAMPLES, replacement=True, generator=g)
    sp = OFF.space
    sampled = dataclasses.replace(sp, tokens=sp.tokens[idx], mask=sp.mask[idx], rows=sp.rows[idx])
    grads = per_sample_grads(dataclasses.replace(OFF, space=sampled), v)  # [SAMPLES, D]
    dirs = torch.randn(grads.shape[1], DIRECTIONS, generator=torch.Generator().manual_seed(99),
                       dtype=grads.dtype)
    proj = grads @ dirs
    se = proj.std(dim=0) / SAMPLES ** 0.5
    return (proj.mean(0) - G_STAR @ dirs) / se


UNBIASED = [KLVariant("k1", "reward", "sequence"), KLVariant("k1", "reward", "prefix"),
            KLVariant("k1", "reward+loss", "prefix"), KLVariant("k3", "reward+loss", "prefix"),
            KLVariant("k3", "reward+loss", "sequence")]


@pytest.mark.parametrize("v", UNBIASED, ids=lambda v: v.name)
def test_unbiased_configurations_pass_the_z_test(v):
    z = _sampled_z_scores(v, seed=1)
    assert z.abs().max() < Z_MAX, z


@pytest.mark.parametrize("v", [KLVariant("k1", "reward+loss", "none"),
                               KLVariant("k3", "reward", "prefix")], ids=lambda v: v.name)
def test_biased_configurations_fail_the_same_z_test(v):
    z = _sampled_z_scores(v, seed=1)
    assert z.abs().max() > Z_MAX, z
