"""`klrl kl-table` end to end: the printed tables, JSON and plot reproduce docs/design.md's table
and the README's trainer-level forms."""
import json
from pathlib import Path

import pytest

from cluster.cli.main import main


def test_kl_table_command_writes_json_and_plot(tmp_path, capsys):
    out_json, out_png = tmp_path / "t.json", tmp_path / "plots" / "bias.png"
    rc = main(["kl-table", "--json", str(out_json), "--plot", str(out_png), "off_policy_lag=2"])
    assert rc == 0
    result = json.loads(out_json.read_text())
    rows = {r["config"]: r for r in result["rows"]}
    assert len(rows) == 3 * 3 * 4 + 9  # every estimator x placement x importance, + capped prefix
    assert all(r["matches_design_table"] for r in rows.values())
    # the paper's headline rows
    assert rows["k1/reward/none"]["on_rel_error"] < 1e-6
    assert rows["k1/loss/none"]["on_norm_ratio"] < 1e-9
    assert rows["k3/reward+loss/none"]["on_rel_error"] < 1e-6
    assert rows["k3/loss/none"]["on_rel_error"] > 0.05
    assert rows["k1/reward/none"]["off_rel_error"] > 0.05
    prefix = rows["k1/reward/prefix"]
    assert prefix["off_rel_error"] < 1e-6 and prefix["unbiased_off_policy"]
    # K3 in reward+loss has the lowest variance of the unbiased on-policy rows
    unbiased = [r for r in rows.values() if r["on_rel_error"] < 1e-6 and r["importance"] == "none"]
    assert min(unbiased, key=lambda r: r["on_variance"])["config"] == "k3/reward+loss/none"
    sweep = result["lag_sweep"]
    assert sweep["lags"][0] == 0 and sweep["rel_error"]["k1/reward/none"][0] < 1e-6
    assert max(sweep["rel_error"]["k1/reward/prefix"]) < 1e-6
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "k3/reward+loss/prefix" in printed and "MISMATCH" not in printed
    # the trainer-level rows: every placement x kl_in_advantage x estimator/normalize x n
    trainer = result["trainer"]
    assert len(trainer["rows"]) == 6 * 5 * 2 and all(r["ok"] for r in trainer["rows"])
    claimed = [c for r in trainer["rows"] for c in r["cells"] if c["exact"]]
    assert len(claimed) > 800 and max(c["rel_error"] for c in claimed) < 1e-12
    cells = {(r["kl"], r["estimator"], r["n"], c["lag"], c["task_off_policy"]): c
             for r in trainer["rows"] for c in r["cells"]}
    assert cells[("separate/reward/k1", "grpo", 2, 3.0, "ppo_clip")]["exact"]
    assert not cells[("centered/reward/k1", "drgrpo", 2, 3.0, "ppo_clip")]["exact"]
    assert {(r["seed"], r["n"]) for r in trainer["kl_part_variance"]} == {
        (s, n) for s in range(4) for n in (2, 3)}
    assert "separate/reward+loss/k3  grpo/group  n=3" in printed
    assert cells[("separate/reward/k1", "rloo", 3, 3.0, "seq_mask_prod")]["exact"]
    # the task-term rows: on-policy every term is g_on; off-policy what each mask drops
    masks = result["task_terms"]
    assert masks["band"] == [0.5, 2.0] and all(r["ok"] for r in masks["rows"])
    row = {(r["task_off_policy"], r["lag"]): r for r in masks["rows"]}
    assert all(row[(o, 0.0)]["bias"] < 1e-12 for o in ("none", "icepop", "mis", "seq_mask_prod"))
    assert row[("icepop", 3.0)]["masked_tokens"] > 0 and 0 < row[("icepop", 3.0)]["dropped"] < 0.5
    assert row[("icepop", 3.0)]["bias"] > row[("tis", 3.0)]["bias"]
    # nothing leaves the band at lag 1: icepop is then per-token importance sampling (tis's
    # gradient, cap 2 not binding) and mis the sequence's, unbiased for this binary reward
    assert row[("icepop", 1.0)]["dropped"] == 0.0
    assert abs(row[("icepop", 1.0)]["bias"] - row[("tis", 1.0)]["bias"]) < 1e-12
    assert row[("mis", 1.0)]["bias"] < 1e-12 < row[("tis", 1.0)]["bias"]
    assert row[("mis", 3.0)]["dropped"] > row[("seq_mask_prod", 3.0)]["dropped"] > 0
    assert row[("seq_mask_geo", 3.0)]["masked_samples"] == 0.0  # no mean leaves [0.5, 2] here
    assert "on-policy: 7 of 7 task terms" in printed
    # docs/learner.md quotes these rows: the page cannot drift from the command
    page = (Path(__file__).resolve().parent.parent / "docs" / "learner.md").read_text()
    assert (f"IcePop at [0.5, 2] drops {row[('icepop', 3.0)]['dropped']:.1%} of the task "
            "gradient's norm at lag 3") in page
    for term in ("mis", "seq_mask_prod"):
        assert f"drops {row[(term, 3.0)]['dropped']:.1%} (bias {row[(term, 3.0)]['bias']:.3f})" \
            in " ".join(page.split()), term


def test_kl_table_fails_when_a_trainer_row_stops_matching(monkeypatch, capsys):
    """The command's exit status guards the trainer-level claims: the old KL baseline of
    `separate` (the group mean including the sample under grpo/drgrpo) fails it."""
    import kl.advantage
    import learner.loss

    monkeypatch.setattr(learner.loss.kl, "kl_baseline", kl.advantage.group_baseline)
    rc = main(["kl-table", "lags=[0]", "trainer.group_sizes=[2]", "trainer.lags=[0]"])
    assert rc == 1
    assert "MISMATCH" in capsys.readouterr().out


def test_kl_table_fails_when_a_mask_drops_on_policy_tokens(monkeypatch, capsys):
    """The task-term rows guard the on-policy claim: a band test that masks everything (as a
    band without 1 would) fails the command, with the rows marked."""
    import learner.task_terms

    monkeypatch.setattr(learner.task_terms, "in_band", lambda x, cfg: x != x)
    rc = main(["kl-table", "lags=[0]", "trainer.group_sizes=[2]", "trainer.lags=[0]"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "on-policy: 3 of 7 task terms" in out and out.count("MISMATCH") >= 4


def _refuse(*_args, **_kw):
    raise AssertionError("the command got past its checks")


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _refused(capsys, *named: str) -> None:
    """One or two lines on stderr, the first `error: ` naming each of `named`; nothing out."""
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert 1 <= len(lines) <= 2 and lines[0].startswith("error: "), captured.err
    assert all(n in captured.err for n in named), captured.err
    assert captured.out == ""


@pytest.mark.parametrize("override, named", [("vocab=1", "vocab"),
                                             (f"seed={2**64}", "seed"),
                                             (f"seed={2**31}", "seed")])
def test_kl_table_rejects_bad_override(override, named, monkeypatch, capsys):
    """A config error is an `error: ` on stderr before any computation; a seed torch cannot
    take (above 2**64 - 1 it raised from torch.manual_seed) is bounded as trainer.seed is."""
    import kl.table

    monkeypatch.setattr(kl.table, "compute_table", _refuse)
    assert main(["kl-table", override]) == 2
    _refused(capsys, named)


@pytest.mark.parametrize("case", ["json is a dir", "plot under a file", "same path"])
def test_kl_table_checks_outputs_before_computing(case, tmp_path, monkeypatch, capsys):
    """--json and --plot are checked before the tables are computed: a --plot that cannot be
    written no longer leaves the JSON behind."""
    import kl.table

    monkeypatch.setattr(kl.table, "compute_table", _refuse)
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("x")
    out_json, out_png, named = {
        "json is a dir": (tmp_path / "dir", tmp_path / "p.png", "--json"),
        "plot under a file": (tmp_path / "new" / "t.json", tmp_path / "file" / "p.png", "--plot"),
        "same path": (tmp_path / "t.out", tmp_path / "t.out", "--plot"),
    }[case]
    before = _tree(tmp_path)
    assert main(["kl-table", "--json", str(out_json), "--plot", str(out_png)]) == 2
    _refused(capsys, named)
    assert _tree(tmp_path) == before
