"""cluster/sweeps/mismatch.py: the keep-vs-recompute table reads each run's fresh-token
mismatch weighted by its fresh tokens (steps without any weigh nothing), prefers update 0's
reading where a batch took several updates, and groups runs by what differs between them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.sweeps.mismatch import mismatch_table, run_figures
from cluster.analysis.runs import RunData

FRESH = "is/abs_log_ratio_fresh_token_mean"


def _run(name: str, stale_kv: str, seed: int, rows: dict[int, dict]) -> RunData:
    config = {"rollout.stale_kv": stale_kv, "seed": seed, "max_lag": 2}
    return RunData(name, Path(name), config, rows, finished=True)


def test_a_runs_figures_weigh_each_step_by_its_fresh_tokens():
    rows = {0: {"eval/in_domain/accuracy": 0.1},  # the step-0 evaluation: no training row
            1: {FRESH: 0.2, "is/fresh_tokens": 30.0, "response/tokens": 100.0,
                "is/abs_log_ratio_token_mean": 0.5, "lag/token_mean": 1.0,
                "lag/multi_version_share": 0.25},
            2: {FRESH: 0.0, "is/fresh_tokens": 0.0, "response/tokens": 100.0,
                "is/abs_log_ratio_token_mean": 0.7, "lag/token_mean": 2.0,
                "lag/multi_version_share": 0.75},
            3: {FRESH: 0.9, "update_0/" + FRESH: 0.4, "is/fresh_tokens": 10.0,
                "response/tokens": 100.0, "is/abs_log_ratio_token_mean": 0.6,
                "lag/token_mean": 0.0, "lag/multi_version_share": 0.5}}
    f = run_figures(_run("a", "keep", 0, rows))
    assert f["fresh"] == pytest.approx((30 * 0.2 + 10 * 0.4) / 40)  # step 2 weighs nothing
    assert f["all"] == pytest.approx(0.6)
    assert f["fresh_share"] == pytest.approx(40 / 300)
    assert f["token_lag"] == pytest.approx(1.0) and f["multi_version"] == pytest.approx(0.5)
    none = run_figures(_run("b", "keep", 0, {1: {FRESH: 0.0, "is/fresh_tokens": 0.0,
                                                "response/tokens": 5.0}}))
    assert none["fresh"] is None  # no fresh token at all: no reading, not a zero
    # a run from before the fresh-token metric: its mixing figures, no fresh ones
    old = run_figures(_run("c", "keep", 0, {1: {"response/tokens": 4.0, "lag/token_mean": 3.0,
                                                "lag/multi_version_share": 0.1}}))
    assert old["token_lag"] == 3.0 and old["multi_version"] == 0.1
    assert old["fresh"] is None and old["fresh_share"] is None


def test_the_table_has_one_row_per_configuration_with_the_seeds_spread():
    def rows(v):
        return {1: {FRESH: v, "is/fresh_tokens": 1.0, "response/tokens": 1.0,
                    "is/abs_log_ratio_token_mean": v}}
    runs = [_run("k0", "keep", 0, rows(0.3)), _run("k1", "keep", 1, rows(0.5)),
            _run("r0", "recompute", 0, rows(0.1)), _run("r1", "recompute", 1, rows(0.1))]
    table = mismatch_table(runs).splitlines()
    assert len(table) == 4 and table[0].startswith("| configuration | runs |")
    keep = next(line for line in table if "keep" in line)
    assert "| 2 | 0.4 (0.3-0.5) |" in keep
    recompute = next(line for line in table if "recompute" in line)
    assert "| 2 | 0.1 (0.1-0.1) |" in recompute


def test_the_table_says_which_commits_and_machines_ran_it(tmp_path):
    from cluster.sweeps.mismatch import mismatch_page

    runs = []
    for name, commit, dirty in (("a", "c43d3d8805be", False), ("b", "1234567abc", True)):
        run = _run(str(tmp_path / name), "keep", 0, {})
        run.dir.mkdir()
        (run.dir / "provenance.jsonl").write_text(json.dumps(
            {"started_at": "2026-11-25T05:48:36+0000", "git_commit": commit,
             "git_dirty": dirty, "machine": "2-core box"}) + "\n")
        runs.append(run)
    page = mismatch_page("stale_kv_tiny", "python -m cluster.cli.mismatch X", runs)
    # both commits (a start with uncommitted changes marked) and the machine, as the sweep
    # report names them, and a warning that the runs come from two commits
    assert "klrl commit(s) 1234567abc+modified, c43d3d8805be; machine(s): 2-core box" in page
    assert "**These runs come from 2 different klrl commits**" in page
    assert page.startswith("# stale_kv_tiny:")
    assert "`python -m cluster.cli.mismatch X`" in page
