"""pass@k from n samples (rewards/pass_at_k.py) against its definition: the chance that k of
the n samples, drawn without replacement, hold a correct one, counted by enumerating every
draw; and eval.pass_k's door."""
from __future__ import annotations

import itertools

import pytest

from cluster.config.train_config import TrainConfig
from rewards.config import EvalConfig
from rewards.pass_at_k import default_ks, mean_pass_at_k, pass_at_k


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_is_the_share_of_k_subsets_holding_a_correct_sample(n):
    for correct in range(n + 1):
        samples = [1] * correct + [0] * (n - correct)
        for k in range(1, n + 1):
            draws = list(itertools.combinations(samples, k))
            share = sum(any(d) for d in draws) / len(draws)
            assert pass_at_k(n, correct, k) == pytest.approx(share, abs=1e-12)


def test_pass_at_1_is_the_mean_accuracy_and_the_plug_in_estimate_is_biased_low():
    rewards = [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]]
    assert mean_pass_at_k(rewards, 1) == pytest.approx(3 / 12)
    # 1 - (1 - c/n)^k with c/n = 1/4, k = 2 gives 0.4375; drawing without replacement: 0.5
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert 1 - (1 - 1 / 4) ** 2 == pytest.approx(0.4375)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)


def test_the_default_ks_and_the_door():
    assert default_ks(0) == [] and default_ks(1) == [1] and default_ks(4) == [1, 2, 4]
    assert default_ks(6) == [1, 2, 4, 6]
    assert EvalConfig(samples=8).ks() == [1, 2, 4, 8]
    assert EvalConfig(samples=8, pass_k=[8, 1]).ks() == [1, 8]
    assert EvalConfig(samples=8, pass_k=[]).ks() == []
    with pytest.raises(ValueError, match=r"eval.pass_k \[16\]: each k is between 1 and "
                                         r"eval.samples \(8\)"):
        EvalConfig(samples=8, pass_k=[4, 16])
    with pytest.raises(ValueError, match="eval.pass_k"):  # at the run's door, named
        TrainConfig.model_validate({"eval": {"samples": 2, "pass_k": [4]}})
