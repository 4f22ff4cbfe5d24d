"""The gates of issue 63 (cluster/analysis/gates.py, prereg.Gates): a comparison of break
rates that nothing could decide is "not testable here", never "contradicted"; an accuracy
comparison on a set nothing moved is not decided; the KL equivalence margin is a share of what a
working regulariser does. Without gates (the first two pre-registrations as registered) the
verdicts are those the committed reports show."""
from __future__ import annotations

import math

import numpy as np
import pytest

from cluster.analysis import dose, stats
from cluster.analysis import findings as f
from cluster.analysis.arms import Arm, Study
from cluster.analysis.prereg import Gates, Rules

GATED = Rules(retained="retained", gates=Gates())
REGISTERED = Rules(retained="retained")  # no gates: as the regimes pre-registration has it
N = 10


def _arm(name, broken=0, n=N, acc=0.7, kl=1.0, seeds=range(N), spread=0.01):
    seeds = tuple(seeds)
    accs = tuple(acc + spread * ((i * 7) % 5 - 2) / 2 for i, _ in enumerate(seeds))
    kls = tuple(kl * math.exp(0.05 * ((i * 3) % 4 - 1.5)) for i, _ in enumerate(seeds))
    return Arm(name, {"in_domain": accs, "retained": accs}, broken, n, kls,
               {"in_domain": seeds, "retained": seeds}, seeds)


def _study(lag=8, broken=None, acc=None, kl=None, base=None, beta=0.3, n=N):
    """The four KL configurations and no KL at one lag (and at lag 0 and 32 for the lag
    trend), `n` seeds each; `broken` by (name, lag), `acc` and `kl` by name."""
    broken, acc, kl = broken or {}, acc or {}, kl or {}
    arms = {}
    for lg in sorted({0, lag, 32}):
        for e, p in (("k1", "reward"), ("k1", "loss"), ("k3", "reward"), ("k3", "loss")):
            name = f"{e.upper()} in {p}"
            arms[(e, p, "none", beta, lg)] = _arm(name, broken.get((name, lg), 0), n,
                                                  acc.get(name, 0.7), kl.get(name, 1.0),
                                                  range(n))
        arms[(None, None, "none", 0.0, lg)] = _arm("no KL", broken.get(("no KL", lg), 0), n,
                                                   acc.get("no KL", 0.7), kl.get("no KL", 2.0),
                                                   range(n))
    return Study(arms, base)


def _decided(study, claims, rules):
    outcomes = [fn(study, beta, lag, rules, **extra) for fn, beta, lag, extra in claims]
    return [o.verdict for o in f.decide(outcomes, rules.alpha)]


BREAK_CLAIMS = [
    (f.k1_loss_unstable, 0.3, 8, {}), (f.k3_reward_breaks, 0.3, 8, {}),
    (f.kl_stabilises_async, 0.3, 8, {}),
    (dose.breaks_with_dose, 0.3, 8, {"configuration": "k1-loss", "over": "max_lag",
                                     "doses": [0, 8, 32]})]


def test_nothing_broken_anywhere_leaves_every_break_claim_not_testable():
    """Every arm at 0/10: no comparison of break rates could have shown anything. The
    registered rules (an absolute binomial test against 1/2) called most of them contradicted;
    the gates call all of them not testable here."""
    study = _study()
    claims = BREAK_CLAIMS
    assert set(_decided(study, claims, GATED)) == {"not testable here"}
    assert _decided(study, claims, REGISTERED).count("contradicted") == 3


def test_a_testable_comparison_whose_difference_is_shown_small_is_contradicted():
    """16 seeds, K1 in the loss 12/16 and K1 in the reward 12/16: the comparison could have
    shown a difference (its smallest reachable p is tiny) and the difference's upper bound is
    below the gate's 0.5: contradicted. 16/16 against 0/16: reproduced."""
    same = _study(broken={("K1 in loss", 8): 12, ("K1 in reward", 8): 12}, n=16)
    assert _decided(same, BREAK_CLAIMS[:1], GATED) == ["contradicted"]
    apart = _study(broken={("K1 in loss", 8): 10})
    assert _decided(apart, BREAK_CLAIMS[:1], GATED) == ["reproduced"]


def test_a_configuration_breaking_one_run_in_ten_is_not_contradicted_by_few_breaks():
    """A configuration that truly breaks 10% of the time against one that never does: "it
    breaks more" is true, and the registered rules counted contradicting it (its break rate
    shown below 1/2) as power (design: binomial_contradiction_power_10). Under the gates it is
    almost never contradicted: with so few breaks the comparison is not testable."""
    rng = np.random.default_rng(0)
    level = GATED.alpha / (2 * 5)
    contradicted = registered_contradicted = 0
    draws = 2000
    for _ in range(draws):
        study = _study(broken={("K1 in loss", 8): int(rng.binomial(N, 0.1))})
        for rules in (GATED, REGISTERED):
            o = f._testable(f.k1_loss_unstable(study, 0.3, 8, rules), level)
            hit = math.isfinite(o.contradict) and o.contradict <= level
            if rules is GATED:
                contradicted += hit
            else:
                registered_contradicted += hit
    assert contradicted / draws <= 0.001
    assert registered_contradicted / draws > 0.2  # what the registered rule counted as power


@pytest.mark.parametrize("rate", [0.75, 0.85])
def test_the_difference_test_keeps_its_level_at_the_margin(rate):
    """True rates differ by exactly the gate's margin 0.5 (0.75 against 0.25) and by 0.6
    beyond it: the test that the difference is below 0.5 passes its level at most that often
    (16 runs a side)."""
    rng = np.random.default_rng(1)
    level, draws, n = 0.01, 4000, 16
    hits = sum(stats.rate_difference_below(int(rng.binomial(n, rate)), n,
                                           int(rng.binomial(n, 0.25)), n, 0.5).p <= level
               for _ in range(draws))
    assert hits / draws <= level + 3 * math.sqrt(level * (1 - level) / draws)


def test_newcombes_interval_matches_his_worked_example():
    """Newcombe (1998), Statistics in Medicine 17:873, table II, example (a): 56/70 - 48/80,
    method 10 (hybrid score), 95%: 0.0524 to 0.3339."""
    z = 1.959964
    assert stats.difference_upper(56, 70, 48, 80, z) == pytest.approx(0.3339, abs=1e-4)
    assert -stats.difference_upper(48, 80, 56, 70, z) == pytest.approx(0.0524, abs=1e-4)


def test_the_retained_gate_asks_that_the_no_kl_control_forgot_something():
    """K1 in the reward 0.1 ahead of no KL on the retained facts: decided only where no KL
    lost at least two margins (0.04) of them against the base model."""
    lead = {"K1 in reward": 0.75, "no KL": 0.65}
    claim = [(dose.kl_keeps_retained, 0.3, 8, {})]
    assert _decided(_study(acc=lead, base={"retained": 0.66}), claim, GATED) == \
        ["not testable here"]  # lost 0.01: nothing forgotten
    assert _decided(_study(acc=lead, base={"retained": 0.8}), claim, GATED) == ["reproduced"]
    assert _decided(_study(acc=lead), claim, GATED) == ["not testable here"]  # no base
    assert _decided(_study(acc=lead, base={"retained": 0.66}), claim, REGISTERED) == \
        ["reproduced"]  # the registered rules had no gate


def test_the_in_domain_gate_asks_that_the_kl_moved_something():
    """'K1 in the reward is best' with every configuration alike and K1 in the reward equal to
    no KL: contradicted under the registered rules (its lead shown below the margin), not
    testable under the gates: nothing moved, so nothing can be placed."""
    claim = [(f.k1_reward_best, 0.3, 8, {})]
    still = _study(base={"retained": 0.71})  # no KL forgot 0.01 and is level with K1
    assert _decided(still, claim, REGISTERED) == ["contradicted"]
    assert _decided(still, claim, GATED) == ["not testable here"]
    # no KL forgot 0.3 and trails K1 in the reward by 0.1 on both sets: both halves can be
    # decided, and the four KL configurations' tie is then a contradiction
    moved = _study(base={"retained": 0.9}, acc={"no KL": 0.6})
    assert _decided(moved, claim, GATED) == ["contradicted"]


def test_the_kl_equivalence_margin_is_a_share_of_a_working_regulariser():
    """K1 in the loss at 1.3x no KL's KL, K1 in the reward at 1/2.6 of it (log effect -0.96):
    within the registered fixed margin (1.5x, 0.405) K1 in the loss is equivalent to no KL;
    under the gates the margin is half of 0.96 = 0.48, and with K1 in the reward only 1/1.3
    of no KL (effect -0.26, margin 0.13) the same 1.3x is not shown equivalent."""
    claim = [(dose.k1_loss_regularises_nothing, 0.3, 0, {})]
    strong = _study(lag=0, kl={"no KL": 2.0, "K1 in loss": 2.0 / 1.3, "K1 in reward": 2 / 2.6})
    weak = _study(lag=0, kl={"no KL": 2.0, "K1 in loss": 2.0 / 1.3, "K1 in reward": 2 / 1.3})
    assert _decided(strong, claim, GATED) == ["reproduced"]
    assert _decided(weak, claim, GATED) != ["reproduced"]
    o = dose.k1_loss_regularises_nothing(weak, 0.3, 0, GATED)
    assert "0.5 x |-0.262|" in o.evidence


def _runs(name, n, broke_at=None, last=1000, curves=None, acc=0.7):
    """An arm whose runs break at the steps in `broke_at` (None: censored at `last`)."""
    arm = _arm(name, sum(b is not None for b in (broke_at or [])), n, acc)
    times = tuple((b, True) if b is not None else (last, False)
                  for b in (broke_at or [None] * n))
    return Arm(arm.name, arm.accuracy, arm.broken, n, arm.kl_end, arm.seeds, arm.kl_seeds,
               times=times, curves=curves or {})


def test_the_time_to_break_separates_early_from_late_breaks():
    """No KL breaks in 8 of 10 runs at steps 100-170, K1 in the reward in 3 at 700-720: the
    log-rank test reproduces "KL delays breaking"; with the same times on both sides it does
    not. Not testable where nothing broke."""
    from cluster.analysis import claims_async as ca

    def study(nokl, k1r):
        return Study({(None, None, "none", 0.0, 8): nokl, ("k1", "reward", "none", 0.3, 8): k1r})

    early = [100 + 10 * i for i in range(8)] + [None, None]
    late = [700, 710, 720] + [None] * 7
    claim = [(ca.kl_delays_breaks, 0.3, 8, {})]
    assert _decided(study(_runs("no KL", 10, early), _runs("K1 in reward", 10, late)), claim,
                    GATED) == ["reproduced"]
    assert _decided(study(_runs("no KL", 10, early), _runs("K1 in reward", 10, early)), claim,
                    GATED) == ["inconclusive"]
    assert _decided(study(_runs("no KL", 10), _runs("K1 in reward", 10)), claim, GATED) == \
        ["not testable here"]


def test_kl_against_early_stopping_compares_at_matched_in_domain_accuracy():
    """No KL climbs in-domain 0.5 -> 0.9 while forgetting 0.8 -> 0.5; K1 in the reward ends at
    0.8 in-domain with 0.75 retained. Where no KL first reached 0.8 (step 750) it kept 0.575:
    K1 in the reward is 0.175 ahead at matched accuracy, on every seed."""
    from cluster.analysis import claims_async as ca

    def curves(ind, ret):
        return {s: {"in_domain": tuple(zip(range(0, 1001, 250), ind)),
                    "retained": tuple(zip(range(0, 1001, 250), ret))} for s in range(N)}

    nokl = _runs("no KL", N, curves=curves([0.5, 0.6, 0.7, 0.8, 0.9],
                                           [0.8, 0.725, 0.65, 0.575, 0.5]), acc=0.5)
    k1r = _runs("K1 in reward", N, curves={s: {"in_domain": ((0, 0.5), (1000, 0.8 + s / 1e3)),
                                               "retained": ((0, 0.8), (1000, 0.75))}
                                           for s in range(N)}, acc=0.8)
    study = Study({(None, None, "none", 0.0, 8): nokl, ("k1", "reward", "none", 0.3, 8): k1r},
                  {"retained": 0.8})
    ours, stopped, missed = ca.matched_retained(k1r, nokl, "retained")
    assert missed == 0 and stopped[0] == pytest.approx(0.575)
    assert _decided(study, [(ca.kl_beats_early_stopping, 0.3, 8, {})], GATED) == ["reproduced"]


def test_the_biased_configurations_gap_growing_with_beta_is_tested_paired():
    """K1 in the loss and K3 in the reward trail K1 in the reward by 0.005 at beta 0.005 and
    by 0.03 at beta 0.3, on every seed: reproduced. Level at both betas: contradicted."""
    from cluster.analysis import claims_async as ca

    def study(gap_low, gap_high):
        arms = {}
        for beta, gap in ((0.005, gap_low), (0.3, gap_high)):
            arms[("k1", "reward", "none", beta, 8)] = _arm("K1 in reward", acc=0.6)
            for e, p in (("k1", "loss"), ("k3", "reward")):
                arms[(e, p, "none", beta, 8)] = _arm(f"{e} {p}", acc=0.6 - gap)
        return Study(arms)

    claim = [(ca.biased_loss_rises_with_beta, 0.3, 8, {"doses": [0.005, 0.3]})]
    assert _decided(study(0.005, 0.03), claim, GATED) == ["reproduced"]
    assert _decided(study(0.0, 0.0), claim, REGISTERED) == ["contradicted"]
