"""The toy trained to its fixed point (kl/dynamics.py) ends where the theory says each KL
configuration leads: K1 in the reward at pi* (proportional to ref x exp(r / beta)), K1 in the
loss nowhere the no-KL control does not go (on-policy its expected gradient is zero, so the
two trajectories are the same step for step), K3 in the loss at the stationary point of the
forward-KL objective, not pi*; and a lag moves no fixed point, only how it is reached.
Exact enumeration on a 7-sequence toy: seconds, no sampling noise."""
from __future__ import annotations

import pytest
import torch

from kl import dynamics as D

BETA = 0.3
TASK = D.Task.make(vocab=3, length=2, seed=0)
K1R, K1L = D.Configuration("k1", "reward"), D.Configuration("k1", "loss")
K3L, K3R = D.Configuration("k3", "loss"), D.Configuration("k3", "reward")
NO_KL = D.Configuration(None)


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_k1_in_the_reward_converges_to_the_regularised_optimum():
    tr = D.train(TASK, K1R, BETA, lag=0, steps=300, lr=4.0)
    assert tr.kl_to_optimum < 1e-5
    assert D.stationarity(TASK, tr.final_logits, BETA)["reverse"] < 1e-3
    assert D.ends_at(tr, TASK, BETA) == "pi*"


def test_k1_in_the_loss_is_the_no_kl_control_step_for_step_on_policy():
    no_kl = D.train(TASK, NO_KL, BETA, lag=0, steps=60, lr=4.0)
    for cfg in (K1L, D.Configuration("k1", "loss", "prefix")):
        k1l = D.train(TASK, cfg, BETA, lag=0, steps=60, lr=4.0)
        torch.testing.assert_close(k1l.final_logits, no_kl.final_logits, rtol=0, atol=1e-12)
    # ... and it heads where no KL does: more reward and further from the reference than pi*
    far = D.train(TASK, K1L, BETA, lag=0, steps=200, lr=4.0)
    assert D.ends_at(far, TASK, BETA) == "toward the unregularised optimum"
    # Off-policy its gradient E_mu[grad log pi] is no longer zero: the runs part.
    lagged, control = (D.train(TASK, c, BETA, lag=4, steps=60, lr=4.0) for c in (K1L, NO_KL))
    assert float((lagged.final_logits - control.final_logits).abs().max()) > 1e-3


def test_k3_in_the_loss_ends_at_a_forward_kl_optimum_not_at_pi_star():
    tr = D.train(TASK, K3L, BETA, lag=0, steps=300, lr=4.0)
    station = D.stationarity(TASK, tr.final_logits, BETA)
    assert station["forward"] < 1e-3 < station["reverse"]
    assert tr.kl_to_optimum > 1e-3
    assert D.ends_at(tr, TASK, BETA) == "forward-KL optimum"


def test_a_lag_moves_no_fixed_point():
    """At a fixed point pi = mu, so the lagged update is the on-policy one: K1 in the reward
    at lag 4 reaches pi* too (more slowly)."""
    tr = D.train(TASK, K1R, BETA, lag=4, steps=600, lr=1.0)
    assert tr.kl_to_optimum < 1e-4 and D.ends_at(tr, TASK, BETA) == "pi*"


def test_k3_in_the_reward_leaves_the_reference_support_even_on_policy():
    """Its expected gradient is g* minus the token-level forward-KL gradient: the second term
    rewards moving away from the reference, and the exact dynamics end deterministic on a
    sequence that is not the best one."""
    tr = D.train(TASK, K3R, BETA, lag=0, steps=300, lr=1.0)
    assert D.ends_at(tr, TASK, BETA) == "collapsed onto one sequence"
    assert tr.kl_to_optimum > 0.05


def test_sampled_training_reproduces_the_exact_endpoint_within_its_noise():
    """Eight samples per update, K1 in the reward: near pi* (within its sampling noise, which
    the exact run has not), and nearer than the no-KL control drawn from the same seed."""
    sampled = D.train(TASK, K1R, BETA, lag=0, steps=200, lr=0.5, samples=8, seed=1)
    control = D.train(TASK, NO_KL, BETA, lag=0, steps=200, lr=0.5, samples=8, seed=1)
    assert sampled.finite and 1e-5 < sampled.kl_to_optimum < 0.05
    assert sampled.kl_to_optimum < control.kl_to_optimum / 1.5


def test_every_toy_row_the_docs_link_is_one_the_command_writes():
    """docs/sweeps.md, docs/experiments.md and docs/kl.md link claims to rows of `klrl
    kl-fixed-points`'s table by anchor; each must be a row the command writes (a short run:
    the rows, not their values)."""
    import re
    from pathlib import Path

    from cluster.cli.cmd_kl_fixed_points import DEFAULTS, compute, table_markdown

    root = Path(__file__).resolve().parents[1]
    linked = {a for page in ("docs/sweeps.md", "docs/experiments.md", "docs/kl.md")
              for a in re.findall(r"sweeps/toy/table\.md#([a-z0-9-]+)", (root / page).read_text())}
    result = compute(DEFAULTS | {"steps": 2})
    written = {r["anchor"] for r in result["rows"]}
    assert linked and linked <= written, linked - written
    assert all(f'<a id="{a}"></a>' in table_markdown(result) for a in linked)
