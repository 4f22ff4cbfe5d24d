"""pass@k from n samples per problem, unbiased (Chen et al. 2021, "Evaluating Large Language
Models Trained on Code"): with c of a problem's n samples correct, the chance that k of them
drawn without replacement include a correct one is

    pass@k = 1 - C(n - c, k) / C(n, k),

an unbiased estimate of the probability that k independent samples contain a correct one;
averaged over problems. (The plug-in 1 - (1 - c/n)^k is biased low for k > 1.) avg@k, the
mean accuracy of k samples, is estimated without bias by the mean over all n for every k <= n:
klrl logs it once, as eval/<set>/sampled_accuracy.

A sample is correct when its task reward is above 0, as evaluation's pass rate counts it
(actors/evaluate.py). Pure: no Ray, vLLM or DeepSpeed.
"""
from __future__ import annotations

from collections.abc import Sequence
from math import comb


def pass_at_k(n: int, correct: int, k: int) -> float:
    """The unbiased pass@k of one problem with `correct` of `n` samples correct."""
    if not 1 <= k <= n or not 0 <= correct <= n:
        raise ValueError(f"pass@{k} of {correct} correct in {n} samples: needs 1 <= k <= n "
                         "and 0 <= correct <= n")
    if n - correct < k:  # every draw of k holds a correct sample
        return 1.0
    return 1.0 - comb(n - correct, k) / comb(n, k)


def default_ks(samples: int) -> list[int]:
    """The k of eval.pass_k null: 1, 2, 4, ... up to the samples per problem, and that
    number itself (samples 6: 1, 2, 4, 6); none without samples."""
    ks, k = [], 1
    while k < samples:
        ks.append(k)
        k *= 2
    return ks + [samples] if samples > 0 else []


def mean_pass_at_k(rewards: Sequence[Sequence[float]], k: int) -> float:
    """pass@k over problems, each given by its samples' task rewards."""
    if not rewards:
        return float("nan")
    return sum(pass_at_k(len(rs), sum(r > 0 for r in rs), k) for rs in rewards) / len(rewards)
