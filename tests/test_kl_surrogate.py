"""kl.surrogate and kl.estimate: padding, masking, dtypes, extreme values and bad input."""
import subprocess
import sys

import pytest
import torch

import kl
from kl.analysis import all_variants

VARIANTS = all_variants(truncates=(2.0,))


def _batch(seed=0, b=4, t=6, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g, dtype=dtype) * 3
    ref = -torch.rand(b, t, generator=g, dtype=dtype) * 3
    mu = -torch.rand(b, t, generator=g, dtype=dtype) * 3
    lengths = torch.tensor([t, 1, 3, t - 1])[:b]
    mask = torch.arange(t)[None, :] < lengths[:, None]
    return logp, ref, mu, mask


def _call(v, logp, ref, mu, mask, **kw):
    return kl.surrogate(logp, ref, mask, estimator=v.estimator, placement=v.placement,
                        importance=v.importance, behaviour_logp=mu, truncate=v.truncate, **kw)


@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: v.name)
def test_padding_and_garbage_in_masked_positions_change_nothing(v):
    logp, ref, mu, mask = _batch()
    extra = 5  # pad every sequence with 5 more positions full of NaN/inf/huge values
    junk = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -1e30], dtype=logp.dtype)

    def pad(x):
        return torch.cat([x, junk.expand(x.shape[0], extra)], dim=1)

    def dirty(x):  # garbage also inside the original padding region
        return torch.where(mask, x, torch.tensor(float("nan"), dtype=x.dtype))

    a = logp.clone().requires_grad_(True)
    out_a = _call(v, a, ref, mu, mask)
    out_a.sum().backward()

    b = pad(dirty(logp)).requires_grad_(True)
    mask_b = torch.cat([mask, torch.zeros(mask.shape[0], extra, dtype=torch.bool)], dim=1)
    out_b = _call(v, b, pad(dirty(ref)), pad(dirty(mu)), mask_b)
    out_b.sum().backward()

    # equal up to float64 summation order (reductions over longer rows may group differently)
    assert torch.allclose(out_a, out_b, rtol=1e-13, atol=1e-13)
    assert torch.allclose(b.grad[:, : mask.shape[1]], a.grad, rtol=1e-13, atol=1e-13)
    assert torch.all(b.grad[~mask_b] == 0)


def test_mask_accepts_bool_and_float_and_sums_without_length_normalisation():
    logp, ref, _, mask = _batch()
    for m in (mask, mask.float(), mask.double()):
        out = kl.surrogate(logp, ref, m, estimator="k1", placement="loss")
        expected = ((logp - ref) * mask).sum(-1)
        assert torch.allclose(out, expected, rtol=0, atol=1e-12)


def test_dtypes_float64_kept_and_low_precision_promoted():
    logp, ref, mu, mask = _batch()
    assert kl.surrogate(logp, ref, mask).dtype == torch.float64
    out = kl.surrogate(logp.bfloat16(), ref.bfloat16(), mask, importance="prefix",
                       behaviour_logp=mu.bfloat16())
    assert out.dtype == torch.float32


def test_estimators_values_and_k3_precision():
    d = torch.tensor([-2.0, -1e-9, 0.0, 1e-9, 3.0], dtype=torch.float64)
    z = torch.zeros_like(d)
    assert torch.equal(kl.estimate(d, z, "k1"), d)
    assert torch.allclose(kl.estimate(d, z, "k2"), d * d / 2)
    k3 = kl.estimate(d, z, "k3")
    assert torch.allclose(k3, torch.exp(-d) - 1 + d)
    assert torch.all(k3 >= 0)
    # expm1 keeps tiny deltas exact to leading order (d^2/2), where exp(-d)-1+d cancels to 0
    tiny = kl.estimate(torch.tensor([1e-6], dtype=torch.float32), torch.zeros(1), "k3")
    assert tiny.item() == pytest.approx(5e-13, rel=1e-3)


def test_clamp_is_opt_in():
    d = torch.tensor([100.0])
    assert kl.estimate(d, torch.zeros(1), "k2").item() == 5000.0
    assert kl.estimate(d, torch.zeros(1), "k2", clamp_delta=10.0).item() == 50.0


@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: v.name)
@pytest.mark.parametrize("delta", [50.0, -50.0])
def test_extreme_log_ratios_stay_finite(v, delta):
    """|delta| = 50 between policy and reference (fp32, as the learner computes it)."""
    logp = torch.full((2, 8), -1.0, requires_grad=True)
    ref = (logp.detach() - delta)
    mu = logp.detach() - 0.5
    mask = torch.ones(2, 8, dtype=torch.bool)
    out = _call(v, logp, ref, mu, mask)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(logp.grad).all()


def test_capped_prefix_weight_is_finite_even_when_the_weight_overflows():
    """A log prefix weight of 2000 overflows float64; the capped coefficient must not."""
    logp = torch.zeros(1, 40, requires_grad=True)
    mu = torch.full((1, 40), -50.0)
    out = kl.surrogate(logp, torch.zeros(1, 40), torch.ones(1, 40), estimator="k3",
                       placement="reward+loss", importance="prefix", behaviour_logp=mu,
                       truncate=5.0)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(logp.grad).all()


@pytest.mark.parametrize("kwargs, message", [
    ({"placement": "kl"}, "placement"),
    ({"importance": "tokens"}, "importance"),
    ({"estimator": "k4"}, "estimator"),
    ({"importance": "prefix"}, "behaviour_logp"),
    ({"importance": "none", "truncate": 2.0}, "truncate"),
    ({"importance": "token", "truncate": 0.0}, "truncate"),
])
def test_bad_arguments_are_rejected_with_the_argument_named(kwargs, message):
    logp, ref, mu, mask = _batch()
    if kwargs.get("importance") not in (None, "none") and kwargs.get("truncate") is not None:
        kwargs["behaviour_logp"] = mu
    with pytest.raises(ValueError, match=message):
        kl.surrogate(logp, ref, mask, **kwargs)


def test_shape_mismatch_is_rejected():
    logp, ref, _, mask = _batch()
    with pytest.raises(ValueError, match="ref_logp"):
        kl.surrogate(logp, ref[:, :-1], mask)


def test_kl_config_validates_and_names_fields():
    from pydantic import ValidationError

    cfg = kl.KLConfig(estimator="k3", placement="reward+loss", importance="prefix", truncate=2.0)
    assert cfg.truncate == 2.0
    with pytest.raises(ValidationError, match="beta"):
        kl.KLConfig(beta=-0.1)
    with pytest.raises(ValidationError, match="estimator"):
        kl.KLConfig(estimator="k5")
    with pytest.raises(ValidationError, match="truncate"):
        kl.KLConfig(truncate=2.0)
    with pytest.raises(ValidationError, match="grpo"):
        kl.AdvantageConfig(estimator="grpo", normalize="none")


def test_kl_package_imports_no_distributed_stack():
    code = ("import sys, kl, kl.analysis, kl.toy; "
            "bad = [m for m in ('ray', 'vllm', 'deepspeed') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
