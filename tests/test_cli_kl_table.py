"""`klrl kl-table` end to end: the printed tables, JSON and plot reproduce docs/design.md's table
and the README's trainer-level forms."""
import json

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
    assert len(claimed) > 300 and max(c["rel_error"] for c in claimed) < 1e-12
    cells = {(r["kl"], r["estimator"], r["n"], c["lag"], c["task_off_policy"]): c
             for r in trainer["rows"] for c in r["cells"]}
    assert cells[("separate/reward/k1", "grpo", 2, 3.0, "ppo_clip")]["exact"]
    assert not cells[("centered/reward/k1", "drgrpo", 2, 3.0, "ppo_clip")]["exact"]
    assert {(r["seed"], r["n"]) for r in trainer["kl_part_variance"]} == {
        (s, n) for s in range(4) for n in (2, 3)}
    assert "separate/reward+loss/k3  grpo/group  n=3" in printed


def test_kl_table_fails_when_a_trainer_row_stops_matching(monkeypatch, capsys):
    """The command's exit status guards the trainer-level claims: the old KL baseline of
    `separate` (the group mean including the sample under grpo/drgrpo) fails it."""
    import kl.advantage
    import learner.loss

    monkeypatch.setattr(learner.loss.kl, "kl_baseline", kl.advantage.group_baseline)
    rc = main(["kl-table", "lags=[0]", "trainer.group_sizes=[2]", "trainer.lags=[0]"])
    assert rc == 1
    assert "MISMATCH" in capsys.readouterr().out


def test_kl_table_rejects_bad_override(capsys):
    assert main(["kl-table", "vocab=1"]) == 2
    assert "vocab" in capsys.readouterr().out
