"""The findings' tests and rules have the error rates the pre-registration states: each rule is
simulated (seeded numpy draws of the runs' outcomes, fed to the claim functions of findings.py
themselves) and its rate of false verdicts and its power compared with `design:` in
docs/sweeps/preregistration.yaml, within Monte-Carlo error. The tests under them agree with
scipy's reference implementations."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as st

from cluster.analysis import findings as f
from cluster.analysis.prereg import load_preregistration
from cluster.analysis.stats import binomial, fisher, holm, rate_bound, welch

PREREG = load_preregistration(Path(__file__).resolve().parents[1] / "docs" / "sweeps"
                              / "preregistration.yaml")
RULES, DESIGN = PREREG.rules, PREREG.design
N_SEEDS = len(PREREG.seeds)
FAMILY = max(len(plan.claims) for plan in PREREG.sweeps.values())
LEVEL = RULES.alpha / FAMILY  # Holm's first step: the level every claim is tested at, at worst
DRAWS = 1000


def at_most(simulated: float, stated: float, draws: int = DRAWS) -> bool:
    """A false-verdict rate no higher than stated, up to 3 Monte-Carlo standard errors."""
    return simulated <= stated + 3 * math.sqrt(max(stated, 1 / draws) * (1 - stated) / draws)


def close(simulated: float, stated: float, draws: int = DRAWS) -> bool:
    """A power within 4 Monte-Carlo standard errors of the stated one."""
    return abs(simulated - stated) <= 4 * math.sqrt(max(stated * (1 - stated), 1e-4) / draws)


def rate(decide, draws: int = DRAWS, seed: int = 0) -> float:
    rng = np.random.default_rng(seed)
    return sum(bool(decide(rng)) for _ in range(draws)) / draws


def accuracies(rng, leads, sd=DESIGN.seed_sd) -> f.Study:
    """The four KL configurations at beta 0.3, max_lag 8, N_SEEDS runs each: final accuracy
    0.7 + lead + seed noise on both sets."""
    keys = (("k1", "reward"), ("k1", "loss"), ("k3", "reward"), ("k3", "loss"))
    return f.Study({(e, p, "none", 0.3, 8): f.Arm(
        e, {s: tuple(0.7 + lead + rng.normal(0, sd, N_SEEDS)) for s in (f.IN, f.OUT)}, 0, N_SEEDS)
        for (e, p), lead in zip(keys, leads)})


def breaks(rng, rate_loss, rate_reward) -> f.Study:
    """K1 in the loss and in the reward, each run breaking at the given rate."""
    return f.Study({("k1", p, "none", 0.3, 8): f.Arm(p, {}, int(rng.binomial(N_SEEDS, r)), N_SEEDS)
                    for p, r in (("loss", rate_loss), ("reward", rate_reward))})


def reproduced(outcome: f.Outcome) -> bool:
    return math.isfinite(outcome.reproduce) and outcome.reproduce <= LEVEL


def contradicted(outcome: f.Outcome) -> bool:
    return math.isfinite(outcome.contradict) and outcome.contradict <= LEVEL


def test_the_design_is_the_pre_registered_one():
    assert N_SEEDS == 8 and FAMILY == 7 and math.isclose(LEVEL, 0.05 / 7)
    assert not set(PREREG.seeds) & {0, 1, 2}  # no seed of the exploratory sweeps


# ---- the tests against scipy's reference implementations ----------------------------------


def test_welch_matches_scipys_ttest_ind_with_its_degrees_of_freedom():
    rng = np.random.default_rng(1)
    for _ in range(20):
        a, b = rng.normal(0, 1, 5), rng.normal(0.3, 2.5, 8)
        for alternative, margin in (("greater", 0.0), ("less", 0.2)):
            ref = st.ttest_ind(a - margin, b, equal_var=False, alternative=alternative)
            mine = welch(a, b, alternative, margin)
            assert math.isclose(mine.p, ref.pvalue, rel_tol=1e-9)
            assert f"t = {ref.statistic:.2f}, df = {ref.df:.1f}" in mine.text
    assert welch((1.0, 1.0), (0.0, 0.0)).p == 0.0 and welch((0.0, 0.0), (0.0, 0.0)).p == 1.0
    assert not welch((0.9,), (0.1, 0.2)).testable


def test_fisher_binomial_holm_and_the_rate_bound_match_their_definitions():
    assert math.isclose(fisher(2, 3, 0, 3).p, 0.2)  # the issue's 2/3 against 0/3
    assert math.isclose(fisher(3, 3, 0, 3).p, 0.05) and math.isclose(fisher(3, 3, 0, 3).min_p, 0.05)
    assert fisher(0, 8, 0, 8).min_p == 1.0  # nothing broke: no table could reach any level
    assert math.isclose(fisher(1, 8, 0, 8).min_p, 0.5)
    assert math.isclose(binomial(0, 8, 0.5, "less").p, 0.5 ** 8)
    assert math.isclose(binomial(1, 8, 0.5, "less").p, 9 / 256)
    assert holm([0.01, 0.04, 0.03, math.nan]) == pytest.approx([0.04, 0.09, 0.09, 1.0])
    assert math.isclose(rate_bound(0, 3), 1 - 0.05 ** (1 / 3))  # the issue's 63%


# ---- the rules' error rates at the pre-registered design ----------------------------------


def test_a_single_welch_comparison():
    rng = np.random.default_rng(2)  # scipy's vectorised test: this checks the level, not our code
    draws = 20 * DRAWS
    null = st.ttest_ind(rng.normal(0, 1, (draws, N_SEEDS)), rng.normal(0, 3, (draws, N_SEEDS)),
                        axis=1, equal_var=False, alternative="greater").pvalue
    lead = st.ttest_ind(rng.normal(2, 1, (draws, N_SEEDS)), rng.normal(0, 1, (draws, N_SEEDS)),
                        axis=1, equal_var=False, alternative="greater").pvalue
    assert close(float(np.mean(null <= LEVEL)), DESIGN.welch_false_positive, draws)
    assert close(float(np.mean(lead <= LEVEL)), DESIGN.welch_power_2sd, draws)


def test_k1_reward_best_false_verdicts_and_power():
    def best(leads):
        return lambda rng: f.k1_reward_best(accuracies(rng, leads), 0.3, 8, RULES)

    sd, margin = DESIGN.seed_sd, RULES.accuracy_margin
    assert at_most(rate(lambda r: reproduced(best((0, 0, 0, 0))(r))), DESIGN.best_false_positive)
    assert close(rate(lambda r: reproduced(best((3 * sd, 0, 0, 0))(r))), DESIGN.best_power_3sd)
    assert at_most(rate(lambda r: contradicted(best((margin, 0, 0, 0))(r))),
                   DESIGN.best_false_contradiction)
    assert close(rate(lambda r: contradicted(best((0, 0, 0, 0))(r))),
                 DESIGN.best_contradiction_power)


def test_break_count_rules_false_verdicts_and_power():
    def unstable(r_loss, r_reward):
        return lambda rng: f.k1_loss_unstable(breaks(rng, r_loss, r_reward), 0.3, 8, RULES)

    assert at_most(rate(lambda r: reproduced(unstable(0.5, 0.5)(r))),
                   DESIGN.fisher_false_positive)
    assert close(rate(lambda r: reproduced(unstable(0.9, 0.0)(r))), DESIGN.fisher_power_90_vs_0)
    assert at_most(rate(lambda r: contradicted(unstable(0.5, 0.0)(r))),
                   DESIGN.binomial_false_contradiction)
    assert close(rate(lambda r: contradicted(unstable(0.1, 0.0)(r))),
                 DESIGN.binomial_contradiction_power_10)


def test_holm_keeps_the_family_wise_error_of_a_sweep():
    rng = np.random.default_rng(3)
    draws = 20 * DRAWS
    anything = [min(holm(list(rng.uniform(size=FAMILY)))) <= RULES.alpha for _ in range(draws)]
    assert close(float(np.mean(anything)), DESIGN.holm_family_wise, draws)
    assert DESIGN.holm_family_wise <= RULES.alpha


def test_the_earlier_two_standard_error_rule_had_the_error_rate_the_issue_names():
    """'Ahead when the difference exceeds 2 standard errors', 3 seeds, no difference: 5.8%
    one-sided with equal spreads, 7.3% when one spread is 3 times the other (Welch df near 2:
    up to 9%), not the 5% its 'about a 90% two-sided level' suggested - why it went."""
    rng = np.random.default_rng(4)
    for ratio, low, high in ((1, 0.052, 0.064), (3, 0.067, 0.080)):
        a, b = rng.normal(0, 1, (20 * DRAWS, 3)), rng.normal(0, ratio, (20 * DRAWS, 3))
        se = np.sqrt(a.var(axis=1, ddof=1) / 3 + b.var(axis=1, ddof=1) / 3)
        assert low <= float(np.mean(a.mean(axis=1) - b.mean(axis=1) > 2 * se)) <= high
