"""`klrl report`'s findings: each claim's verdict follows from the runs, on synthetic run
directories built so that the evidence is clear one way or the other, and a claim whose
configurations did not run says so instead of guessing. With 3 seeds a break count cannot
decide a claim any more (3/3 against 0/3: Fisher p = 0.05 before Holm's correction), so the
clear-evidence directories have 8 seeds, as the pre-registered confirmation does."""
from __future__ import annotations

import re

from test_report import write_run

from cluster.analysis.findings import findings_markdown
from cluster.analysis.report import ReportConfig, find_runs, group_runs, write_report
from cluster.analysis.report_findings import directory_findings
from cluster.analysis.stats import welch

CONFIGS = (("k1", "reward"), ("k1", "loss"), ("k3", "reward"), ("k3", "loss"))
BEST = "K1 in the reward is best in- and out-of-domain"
K1L = "K1 in the loss is unstable"
K3L, K3R = "K3 in the loss is stable but worse out-of-domain", "K3 in the reward breaks off-policy"
STABLE = "KL regularisation stabilises async training"
PREFIX = "Per-decision importance weights repair what breaks off-policy"
LAG0, LAG4 = "beta 0.05, max_lag 0", "beta 0.05, max_lag 4"
CONTROL = "beta 0.05 against beta 0, max_lag 4"
EIGHT = tuple(range(8))
# For the tests that read report.md's words alone: drawing the plots is most of a report's time.
NO_FIGURES = ReportConfig(figures=False)


def COLLAPSE(step):  # accuracy that falls to 0.02 and stays there: a broken run
    return 0.4 if step < 20 else 0.02


def grid(root, lag=4, accuracy=None, broken=(), seeds=(0, 1, 2), beta=0.05, importance=None,
         kl=None, grad=None):
    """Runs of the four KL configurations at max_lag 0 and `lag`; `accuracy[(est, place)]` is
    a run's final accuracy (plus a little per seed), `broken` the configurations that collapse,
    `kl[(est, place)]` the KL to the reference of one at the lag (step -> nats), `grad[(est,
    place)]` its gradient norm (step -> norm)."""
    accuracy, kl, grad = accuracy or {}, kl or {}, grad or {}
    for est, place in CONFIGS:
        for lg in (0, lag):
            for i, seed in enumerate(seeds):
                final = accuracy.get((est, place), 0.5) + 0.01 * i
                acc = COLLAPSE if lg and (est, place) in broken else (
                    lambda s, f=final: f if s >= 30 else 0.3)
                name = f"{est}-{place}-lag{lg}-s{seed}" + (f"-{importance}" if importance else "")
                drift = kl.get((est, place)) if lg else None
                norms = grad.get((est, place)) if lg else None
                extra = {s: {"grad/norm": norms(s)} for s in range(1, 41)} if norms else None
                run = write_run(root / name, est, place, lg, seed, acc=acc, beta=beta,
                                extra=extra, **({"kl": drift} if drift else {}))
                if importance:
                    _set_importance(run, importance)


def _set_importance(run_dir, importance):
    import yaml
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    config["kl"]["importance"] = importance
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))


def verdicts(root) -> dict[tuple[str, str], str]:
    runs = find_runs(root)
    _, _, found, _, _ = directory_findings(runs, group_runs(runs), None, root.name)
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
    # 0 of 8 against 0 of 8: nothing could show that K3 in the reward breaks more, so nothing
    # contradicts it either (the earlier rule called this contradicted, issue 63)
    assert v[(K3R, LAG4)] == "not testable here"
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
    # nothing broke anywhere: "K1 in the loss is unstable" could not be shown, so it is not
    # contradicted by that (the earlier absolute rule, break rate below 1/2, said contradicted)
    assert v[(K1L, LAG4)] == "not testable here"
    grid(tmp_path / "alike")  # every configuration ends at the same accuracy, 3 seeds
    v = verdicts(tmp_path / "alike")
    # The configurations tie exactly on every seed: nothing moved the accuracy, so no
    # configuration can be shown ahead or behind (the earlier rule contradicted "best" here).
    assert v[(BEST, LAG4)] == "not testable here"


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
    grid(tmp_path, accuracy={("k1", "reward"): 0.7}, kl={("k1", "reward"): lambda s: 0.02 * s})
    text = write_report(tmp_path).read_text()
    assert "![Accuracy against the distance to the reference](accuracy_vs_kl.png)\n\nAmong " \
        "the 24 finished runs that did not break" in text
    assert "## Findings" in text and f"| {BEST} | paper |" in text
    # paired by seed: every seed's difference is 0.2, so the paired t is infinite
    assert ("K1 in reward 0.710 ± 0.006 (n=3) vs K1 in loss 0.510 ± 0.006 (n=3), mean paired "
            "difference +0.200 (sd 0.000 over 3 seeds); ahead: paired t = inf, df = 2, "
            "p < 1e-6") in text
    assert "KL at the end" in text.split("K1 in reward 0.710")[1].split("|")[0]
    assert "**Exploratory**" in text and "### Threshold sensitivity" in text
    # how off-policy each run was, per run in runs.csv and per configuration in the table
    import csv
    rows = list(csv.DictReader((tmp_path / "report" / "runs.csv").open()))
    assert {(r["run"].split("-")[2], r["lag_mean"]) for r in rows} == {("lag0", "0"),
                                                                      ("lag4", "4")}
    assert "| mean lag |" in text and "| 4.000 ± 0.000 |" in text

    # figures=false: no plot drawn, the correlation still told, every other line the same
    quick = write_report(tmp_path, NO_FIGURES, out=tmp_path / "quick").read_text()
    assert not list((tmp_path / "quick").glob("*.png"))
    assert "## Plots\n\nNot drawn (`figures=false`).\n\nAmong the 24 finished runs" in quick

    def outside_plots(md: str) -> tuple[str, str]:  # the time it was written aside
        before, rest = md.split("## Plots")
        return re.sub(r"Written \S+ \S+ by", "", before), rest.split("## Runs")[1]

    assert outside_plots(quick) == outside_plots(text)


def test_a_directory_without_a_kl_penalty_says_there_is_nothing_to_test(tmp_path):
    write_run(tmp_path / "nokl-s0", beta=0.0)
    runs = find_runs(tmp_path)
    assert directory_findings(runs, group_runs(runs), None, "x")[2] == []
    assert "No finished run with a KL penalty" in findings_markdown([])[0]


def test_a_preregistered_report_follows_its_claims_seeds_and_final_evaluations(tmp_path):
    """The sweep's pre-registration decides which claims are tested on which seeds, and the
    final checkpoints' evaluation (final_eval.json) is the accuracy they compare."""
    import json

    from cluster.analysis.prereg import load_preregistration
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
    md = write_report(root, ReportConfig(preregistration=prereg_path, figures=False)).read_text()
    assert "**Confirmatory**" in md and f"pre-registration `{prereg_path}`" in md
    assert "## Pre-registration" in md and "final_eval_seed: 1" in md  # quoted
    assert "8 run(s) with seeds outside the pre-registered 101" in md
    assert "final checkpoint, 1000 problems" in md and "have no evaluation of their final" not in md
    assert "K1 in reward 0.835 ± 0.009 (n=8) vs K1 in loss 0.635 ± 0.009 (n=8)" in md
    # seeds 0.01 apart: sd 0.01 x sd(0..7) in-domain, half that out-of-domain (acc / 2)
    assert ("assume a seed sd of a final accuracy of 0.015; these runs show in-domain 0.024, "
            "out-of-domain 0.012") in md
    rows = [line for line in md.splitlines() if line.startswith("| ") and "| beta 0.3" in line
            and line.split(" | ")[3].startswith("**")]  # the findings table: a verdict in bold
    assert len(rows) == 7  # the sweep's pre-registered family, the claims not run included
    # no control, no prefix runs; both verdict columns (registered, gated) say so
    assert md.count("| **not run here** | **not run here** |") == 2
    for how in ("as registered", "under the gates"):  # a line above the table counts each
        head = f"7 claim(s) {how}: "
        tally = next(line for line in md.splitlines() if line.startswith(head))
        assert "2 not run here" in tally
        assert sum(int(part.split()[0]) for part in tally[len(head):-1].split(", ")) == 7
    assert "a change of the rules made after these runs (issue 63)" in md
    csv = (root / "report" / "runs.csv").read_text().splitlines()
    assert len(csv) == 1 + len(list(root.glob("*-s*")))
    assert "final checkpoint, 1000 problems" in csv[1]


def test_the_report_says_whether_the_pre_registration_predates_the_runs(tmp_path):
    """Its head compares the commit that last changed the pre-registration with the first
    run's start (provenance.jsonl): rules changed after the runs began are not pre-registered."""
    import json

    import pytest

    from cluster.analysis.prereg import file_commit
    prereg_path = "docs/sweeps/preregistration.yaml"
    info = file_commit(prereg_path, "offpolicy_tiny_confirm")
    if info["commit"] is None or info["modified"]:
        pytest.skip("the pre-registration is not committed as it is in this checkout")
    cfg = ReportConfig(preregistration=prereg_path, figures=False)
    for started, said in (("2000-01-01T00:00:00+0000", "**That is after the first run"),
                          ("2100-01-01T00:00:00+0000", "before the first run started")):
        root = tmp_path / started[:4] / "offpolicy_tiny_confirm"
        run = write_run(root / "s101", seed=101, beta=0.3, lag=8)
        (run / "provenance.jsonl").write_text(json.dumps(
            {"started_at": started, "git_commit": "a" * 40, "git_dirty": False}) + "\n")
        md = write_report(root, cfg).read_text()
        assert said in md and f"commit {info['commit'][:12]}" in md


def test_a_verdict_that_a_threshold_variant_changes_is_fragile(tmp_path):
    """K3 in the reward's gradient norm climbs to 15 x its early level: no blow-up at the
    registered 20 x, one at half that. 'K3 in the reward breaks' is then contradicted (0 of 8
    broken: nothing could be shown, not testable) under the registered threshold and
    reproduced (8 of 8) under half of it: fragile."""
    grid(tmp_path, seeds=EIGHT, grad={("k3", "reward"): lambda s: 2.0 if s < 10 else 30.0})
    runs = find_runs(tmp_path)
    _, _, found, table, _ = directory_findings(runs, group_runs(runs), None, "x")
    k3r = next(f for f in found if f.claim == K3R)
    assert k3r.verdict == "not testable here" and k3r.fragile
    assert f"| {K3R} | {LAG4} | not testable here | not testable here | reproduced | " \
        "not testable here | not testable here | **yes** |" in table
    assert not next(f for f in found if f.claim == K1L).fragile
    assert "(fragile)" in "\n".join(findings_markdown(found))


def test_runs_from_several_commits_are_named_in_the_head(tmp_path):
    import json

    for seed, commit in ((0, "a" * 40), (1, "b" * 40), (2, "b" * 40)):
        run = write_run(tmp_path / f"s{seed}", seed=seed)
        (run / "provenance.jsonl").write_text(json.dumps(
            {"started_at": "2026-01-01T00:00:00+0000", "git_commit": commit,
             "git_dirty": False}) + "\n")
    md = write_report(tmp_path, NO_FIGURES).read_text()
    assert f"**These runs come from 2 different klrl commits** ({'a' * 12}: 1 run(s), " \
        f"{'b' * 12}: 2 run(s))" in md
    assert f",{'b' * 12}," in (tmp_path / "report" / "runs.csv").read_text()
    # a run stopped under one commit and resumed under the other counts under each, said so
    with (tmp_path / "s0" / "provenance.jsonl").open("a") as f:
        f.write(json.dumps({"started_at": "2026-01-02T00:00:00+0000", "git_commit": "b" * 40,
                            "resumed": True}) + "\n")
    md = write_report(tmp_path, NO_FIGURES).read_text()
    assert f"({'a' * 12}: 1 run(s), {'b' * 12}: 3 run(s); 1 run(s) resumed under another " \
        "commit than they started, counted under each)" in md


def test_claims_that_pool_runs_of_other_settings_say_so(tmp_path):
    """Two runs per arm that differ in a key no claim looks at (in-flight updates) share the
    claim's arm: the report names the key instead of passing the pool off as one setting."""
    import yaml

    grid(tmp_path)
    for run in tmp_path.iterdir():
        config = yaml.safe_load((run / "config.yaml").read_text())
        config["rollout"] = {"in_flight_updates": run.name.endswith("s1")}
        (run / "config.yaml").write_text(yaml.safe_dump(config))
    assert "**The claims below pool runs that differ in `rollout.in_flight_updates`**" in \
        findings_text(tmp_path)
    # ... and a grid over the claims' own keys only says nothing of the kind
    other = tmp_path.parent / "plain"
    grid(other)
    assert "pool runs" not in findings_text(other)


def findings_text(root) -> str:
    """The findings section of root's report, without the plots (seconds each)."""
    from cluster.analysis.report_findings import findings_section

    runs = find_runs(root)
    (root / "report").mkdir()
    return "\n".join(findings_section(root, runs, group_runs(runs), ReportConfig(),
                                      root / "report")[0])


def test_the_accuracy_against_kl_plot_states_the_correlation_of_unbroken_runs(tmp_path):
    """Final accuracy linear in log KL at the end over four stable runs: r = +1 on both sets;
    a fifth run that collapses far from the reference would pull r down were it counted."""
    for i, level in enumerate((0.1, 0.2, 0.4, 0.8)):
        write_run(tmp_path / f"k1-reward-s{i}", seed=i, kl=lambda s, c=level: c,
                  acc=lambda s, a=0.3 + 0.05 * i: a)
    write_run(tmp_path / "k1-reward-s9", seed=9, kl=lambda s: 5.0, acc=COLLAPSE)
    from cluster.analysis.report import _correlation_text

    runs = find_runs(tmp_path)
    md = _correlation_text(directory_findings(runs, group_runs(runs), None, "x")[0])
    assert ("Among the 4 finished runs that did not break, the correlation (Pearson r) of the "
            "final accuracy with log KL at the end: in-domain +1.00, out-of-domain +1.00.") in md


def test_each_claim_links_the_toy_rows_of_the_configurations_it_is_about(tmp_path):
    """The report's claims table ends with the rows of `klrl kl-fixed-points`'s committed
    table that say where theory expects each claim's configurations to end: at the claim's
    lag, linked from wherever the report is written; a lag the toy did not train (4) has none.
    A dose claim over the lag is about each of its doses."""
    import os

    from cluster.analysis import dose
    from cluster.analysis.findings import about

    grid(tmp_path / "sweep", lag=8, broken={("k1", "loss")})
    report = write_report(tmp_path / "sweep", NO_FIGURES, out=tmp_path / "elsewhere" / "report")
    rows = {line.split(" | ")[0].lstrip("| ") + " @ " + line.split(" | ")[2]: line
            for line in report.read_text().splitlines() if line.startswith("| K")}
    row = rows[f"{K1L} @ beta 0.05, max_lag 8"]
    link = re.search(r"\[K1 in loss, lag 8\]\(([^)#]+)#(k1-in-loss-lag-8)\)", row)
    assert link, row
    table = (report.parent / link[1]).resolve()
    assert table.is_file() and f'<a id="{link[2]}"></a>' in table.read_text()
    assert os.path.isabs(link[1]) is False
    assert "the toy at beta 0.3" in report.read_text()
    grid(tmp_path / "lag4", lag=4)
    report4 = write_report(tmp_path / "lag4", NO_FIGURES)
    row4 = next(line for line in report4.read_text().splitlines()
                if line.startswith(f"| {K1L} |") and "max_lag 4" in line)
    assert row4.endswith(" - |")
    assert about(dose.breaks_with_dose, 8, {"configuration": "k3-reward", "over": "max_lag",
                                            "doses": [0, 2, 8]}) == (
        ("K3 in reward", 0), ("K3 in reward", 2), ("K3 in reward", 8))
