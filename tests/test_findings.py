"""`klrl report`'s findings: each claim's verdict follows from the runs, on synthetic run
directories built so that the evidence is clear one way or the other, and a claim whose
configurations did not run says so instead of guessing. With 3 seeds a break count cannot
decide a claim any more (3/3 against 0/3: Fisher p = 0.05 before Holm's correction), so the
clear-evidence directories have 8 seeds, as the pre-registered confirmation does."""
from __future__ import annotations

from test_report import write_run

from cluster.experiments.findings import findings_markdown
from cluster.experiments.report import find_runs, group_runs, write_report
from cluster.experiments.report_findings import directory_findings
from cluster.experiments.stats import welch

CONFIGS = (("k1", "reward"), ("k1", "loss"), ("k3", "reward"), ("k3", "loss"))
BEST = "K1 in the reward is best in- and out-of-domain"
K1L = "K1 in the loss is unstable off-policy"
K3L, K3R = "K3 in the loss is stable but worse out-of-domain", "K3 in the reward breaks off-policy"
STABLE = "KL regularisation stabilises async training"
PREFIX = "Per-decision importance weights repair what breaks off-policy"
LAG0, LAG4 = "beta 0.05, max_lag 0", "beta 0.05, max_lag 4"
CONTROL = "beta 0.05 against beta 0, max_lag 4"
EIGHT = tuple(range(8))


def COLLAPSE(step):  # accuracy that falls to 0.02 and stays there: a broken run
    return 0.4 if step < 20 else 0.02


def grid(root, lag=4, accuracy=None, broken=(), seeds=(0, 1, 2), beta=0.05, importance=None):
    """Runs of the four KL configurations at max_lag 0 and `lag`; `accuracy[(est, place)]` is
    a run's final accuracy (plus a little per seed), `broken` the configurations that collapse."""
    accuracy = accuracy or {}
    for est, place in CONFIGS:
        for lg in (0, lag):
            for i, seed in enumerate(seeds):
                final = accuracy.get((est, place), 0.5) + 0.01 * i
                acc = COLLAPSE if lg and (est, place) in broken else (
                    lambda s, f=final: f if s >= 30 else 0.3)
                name = f"{est}-{place}-lag{lg}-s{seed}" + (f"-{importance}" if importance else "")
                run = write_run(root / name, est, place, lg, seed, acc=acc, beta=beta)
                if importance:
                    _set_importance(run, importance)


def _set_importance(run_dir, importance):
    import yaml
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    config["kl"]["importance"] = importance
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))


def verdicts(root) -> dict[tuple[str, str], str]:
    runs = find_runs(root)
    _, _, found, _ = directory_findings(runs, group_runs(runs), None, root.name)
    return {(f.claim, f.setting): f.verdict for f in found}


def test_welch_needs_a_difference_beyond_its_noise():
    assert welch((0.60, 0.61, 0.62), (0.50, 0.51, 0.52)).p < 0.001
    assert welch((0.60, 0.40, 0.80), (0.50, 0.51, 0.52)).p > 0.2  # too noisy
    assert welch((0.9,), (0.1,)).testable is False  # one seed has no standard error


def test_clear_evidence_reproduces_the_papers_claims(tmp_path):
    grid(tmp_path, accuracy={("k1", "reward"): 0.7}, broken={("k1", "loss")}, seeds=EIGHT)
    v = verdicts(tmp_path)
    assert v[(BEST, LAG0)] == "reproduced"
    assert v[(K1L, LAG4)] == "reproduced"
    assert v[(K3L, LAG4)] == "reproduced"
    assert v[(K3R, LAG4)] == "contradicted"
    # No control, no prefix runs: said, not guessed.
    assert v[(STABLE, CONTROL)] == "not run here"


def test_three_seeds_cannot_decide_a_break_count(tmp_path):
    """3/3 broken against 0/3 was 'reproduced' under the earlier rule; Fisher's p is 0.05
    before the correction for the claims tested beside it."""
    grid(tmp_path, accuracy={("k1", "reward"): 0.7}, broken={("k1", "loss")})
    v = verdicts(tmp_path)
    assert v[(K1L, LAG4)] == "inconclusive"
    # 0/3 against 0/3 and 0 of 3 (binomial p = 0.125): no outcome of 3 seeds could decide it.
    assert v[(K3R, LAG4)] == "not testable here"
    # The accuracy differences are far beyond their noise: 3 seeds decide those.
    assert v[(BEST, LAG0)] == "reproduced"


def test_opposite_evidence_contradicts_and_noise_is_inconclusive(tmp_path):
    grid(tmp_path / "worse", accuracy={("k3", "loss"): 0.7}, seeds=EIGHT)
    v = verdicts(tmp_path / "worse")
    assert v[(BEST, LAG4)] == "contradicted"
    assert v[(K3L, LAG4)] == "contradicted"
    assert v[(K1L, LAG4)] == "contradicted"
    grid(tmp_path / "alike")  # every configuration ends at the same accuracy, 3 seeds
    v = verdicts(tmp_path / "alike")
    assert v[(BEST, LAG4)] == "inconclusive"


def test_controls_decide_the_stabilisation_and_repair_claims(tmp_path):
    grid(tmp_path, broken={("k3", "reward")}, seeds=EIGHT)
    grid(tmp_path, importance="prefix", beta=0.05, seeds=EIGHT)  # corrected runs: none breaks
    for seed in EIGHT:  # the no-KL control collapses at the lag
        write_run(tmp_path / f"nokl-lag4-s{seed}", "k1", "reward", 4, seed, acc=COLLAPSE, beta=0.0)
    v = verdicts(tmp_path)
    assert v[(STABLE, CONTROL)] == "reproduced"
    assert v[(K3R, LAG4)] == "reproduced"
    assert v[(PREFIX, LAG4)] == "reproduced"


def test_a_control_that_never_breaks_leaves_stabilisation_untestable(tmp_path):
    """Nothing broke without the KL penalty: there was nothing to stabilise, which neither
    confirms nor contradicts the claim."""
    grid(tmp_path, seeds=EIGHT)
    for seed in EIGHT:
        write_run(tmp_path / f"nokl-lag4-s{seed}", "k1", "reward", 4, seed, beta=0.0)
    v = verdicts(tmp_path)
    assert v[(STABLE, CONTROL)] == "not testable here"


def test_report_writes_the_findings_with_their_evidence(tmp_path):
    grid(tmp_path, accuracy={("k1", "reward"): 0.7})
    text = write_report(tmp_path).read_text()
    assert "## Findings" in text and f"| {BEST} | paper |" in text
    assert ("K1 in reward 0.710 ± 0.006 (n=3) vs K1 in loss 0.510 ± 0.006 (n=3), difference "
            "+0.200, d = 20; ahead: t = 24.49, df = 4.0, p = 8.") in text
    assert "**Exploratory**" in text and "### Threshold sensitivity" in text


def test_a_directory_without_a_kl_penalty_says_there_is_nothing_to_test(tmp_path):
    write_run(tmp_path / "nokl-s0", beta=0.0)
    runs = find_runs(tmp_path)
    assert directory_findings(runs, group_runs(runs), None, "x")[2] == []
    assert "No finished run with a KL penalty" in findings_markdown([])[0]


def test_a_preregistered_report_follows_its_claims_seeds_and_final_evaluations(tmp_path):
    """The sweep's pre-registration decides which claims are tested on which seeds, and the
    final checkpoints' evaluation (final_eval.json) is the accuracy they compare."""
    import json

    from cluster.experiments.prereg import load_preregistration
    from cluster.experiments.report import ReportConfig

    prereg_path = "docs/sweeps/preregistration.yaml"
    seeds = load_preregistration(prereg_path).seeds
    root = tmp_path / "offpolicy_tiny_confirm"
    grid(root, lag=8, beta=0.3, seeds=seeds, accuracy={("k1", "reward"): 0.7})
    grid(tmp_path / "seed0", lag=8, beta=0.3, seeds=(0,))  # an exploratory seed: CSV only
    for run in (tmp_path / "seed0").iterdir():
        run.rename(root / run.name)
    for run in root.iterdir():  # the final checkpoints score 0.1 above the last evaluation
        last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
        sets = {s: {"accuracy": last[f"eval/{s}/accuracy"] + 0.1}
                for s in ("in_domain", "out_of_domain")}
        (run / "final_eval.json").write_text(json.dumps({"problems": 1000, "seed": 1,
                                                         "sets": sets}))
    md = write_report(root, ReportConfig(preregistration=prereg_path)).read_text()
    assert "**Confirmatory**" in md and f"pre-registration `{prereg_path}`" in md
    assert "## Pre-registration" in md and "final_eval_seed: 1" in md  # quoted
    assert "8 run(s) with seeds outside the pre-registered 101" in md
    assert "final checkpoint, 1000 problems" in md and "have no evaluation of their final" not in md
    assert "K1 in reward 0.835 ± 0.009 (n=8) vs K1 in loss 0.635 ± 0.009 (n=8)" in md
    rows = [line for line in md.splitlines() if line.startswith("| ") and " | paper |" in line
            or " | klrl |" in line]
    assert len(rows) == 7  # the sweep's pre-registered family, the claims not run included
    assert md.count("**not run here**") == 2  # no control, no prefix runs
    csv = (root / "report" / "runs.csv").read_text().splitlines()
    assert len(csv) == 1 + len(list(root.glob("*-s*")))
    assert "final checkpoint, 1000 problems" in csv[1]
