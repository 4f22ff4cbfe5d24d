"""`klrl report`'s findings: each claim's verdict follows from the runs, on synthetic run
directories built so that the evidence is clear one way or the other, and a claim whose
configurations did not run says so instead of guessing."""
from __future__ import annotations

from test_report import write_run

from cluster.experiments.findings import Stat, ahead, findings, findings_markdown
from cluster.experiments.report import ReportConfig, find_runs, instability_flags, write_report

CONFIGS = (("k1", "reward"), ("k1", "loss"), ("k3", "reward"), ("k3", "loss"))


def COLLAPSE(step):  # accuracy that falls to 0.02 and stays there: a broken run
    return 0.4 if step < 20 else 0.02


def grid(root, lag=4, accuracy=None, broken=(), seeds=(0, 1, 2), beta=0.05, importance=None):
    """Runs of the four KL configurations at max_lag 0 and `lag`; `accuracy[(est, place)]` is
    a run's final accuracy (plus a little per seed), `broken` the configurations that collapse."""
    accuracy = accuracy or {}
    for est, place in CONFIGS:
        for lg in (0, lag):
            for seed in seeds:
                final = accuracy.get((est, place), 0.5) + 0.01 * seed
                acc = COLLAPSE if lg and (est, place) in broken else (lambda s, f=final: f if s >= 30 else 0.3)
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
    flags = [f for r in runs for f in instability_flags(r, ReportConfig())]
    return {(f.claim, f.setting): f.verdict for f in findings(runs, flags)}


def test_ahead_needs_the_difference_beyond_two_standard_errors():
    assert ahead(Stat((0.60, 0.61, 0.62)), Stat((0.50, 0.51, 0.52)))
    assert not ahead(Stat((0.60, 0.40, 0.80)), Stat((0.50, 0.51, 0.52)))  # too noisy
    assert not ahead(Stat((0.9,)), Stat((0.1,)))  # one seed has no standard error


def test_clear_evidence_reproduces_the_papers_claims(tmp_path):
    grid(tmp_path, accuracy={("k1", "reward"): 0.7}, broken={("k1", "loss")})
    v = verdicts(tmp_path)
    assert v[("K1 in the reward is best in- and out-of-domain", "beta 0.05, max_lag 0")] == "reproduced"
    assert v[("K1 in the loss is unstable off-policy", "beta 0.05, max_lag 4")] == "reproduced"
    assert v[("K3 in the loss is stable but worse out-of-domain", "beta 0.05, max_lag 4")] == "reproduced"
    assert v[("K3 in the reward breaks off-policy", "beta 0.05, max_lag 4")] == "contradicted"
    # No control, no prefix runs: said, not guessed.
    assert v[("KL regularisation stabilises async training", "beta 0.05 against beta 0, max_lag 4")] \
        == "not run here"


def test_opposite_evidence_contradicts_and_noise_is_inconclusive(tmp_path):
    grid(tmp_path / "worse", accuracy={("k3", "loss"): 0.7})
    v = verdicts(tmp_path / "worse")
    assert v[("K1 in the reward is best in- and out-of-domain", "beta 0.05, max_lag 4")] == "contradicted"
    assert v[("K3 in the loss is stable but worse out-of-domain", "beta 0.05, max_lag 4")] == "contradicted"
    assert v[("K1 in the loss is unstable off-policy", "beta 0.05, max_lag 4")] == "contradicted"
    grid(tmp_path / "alike")  # every configuration ends at the same accuracy
    v = verdicts(tmp_path / "alike")
    assert v[("K1 in the reward is best in- and out-of-domain", "beta 0.05, max_lag 4")] == "inconclusive"


def test_controls_decide_the_stabilisation_and_repair_claims(tmp_path):
    grid(tmp_path, broken={("k3", "reward")})
    grid(tmp_path, importance="prefix", beta=0.05)  # the corrected runs: nothing breaks
    for seed in (0, 1, 2):  # the no-KL control collapses at the lag
        write_run(tmp_path / f"nokl-lag4-s{seed}", "k1", "reward", 4, seed, acc=COLLAPSE, beta=0.0)
    v = verdicts(tmp_path)
    assert v[("KL regularisation stabilises async training", "beta 0.05 against beta 0, max_lag 4")] \
        == "reproduced"
    assert v[("K3 in the reward breaks off-policy", "beta 0.05, max_lag 4")] == "reproduced"
    assert v[("Per-decision importance weights repair what breaks off-policy", "beta 0.05, max_lag 4")] \
        == "reproduced"


def test_report_writes_the_findings_with_their_evidence(tmp_path):
    grid(tmp_path, accuracy={("k1", "reward"): 0.7})
    text = write_report(tmp_path).read_text()
    assert "## Findings" in text and "| K1 in the reward is best in- and out-of-domain | paper |" in text
    assert "K1 in reward 0.710 ± 0.006 (n=3) > K1 in loss 0.510 ± 0.006 (n=3)" in text


def test_a_directory_without_a_kl_penalty_says_there_is_nothing_to_test(tmp_path):
    write_run(tmp_path / "nokl-s0", beta=0.0)
    runs = find_runs(tmp_path)
    assert findings(runs, []) == []
    assert "No finished run with a KL penalty" in findings_markdown([])[0]
