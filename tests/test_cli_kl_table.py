"""`klrl kl-table` end to end: the printed table, JSON and plot reproduce docs/design.md's table."""
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
    assert rows["k1/reward/prefix"]["off_rel_error"] < 1e-6 and rows["k1/reward/prefix"]["unbiased_off_policy"]
    # K3 in reward+loss has the lowest variance of the unbiased on-policy rows
    unbiased = [r for r in rows.values() if r["on_rel_error"] < 1e-6 and r["importance"] == "none"]
    assert min(unbiased, key=lambda r: r["on_variance"])["config"] == "k3/reward+loss/none"
    sweep = result["lag_sweep"]
    assert sweep["lags"][0] == 0 and sweep["rel_error"]["k1/reward/none"][0] < 1e-6
    assert max(sweep["rel_error"]["k1/reward/prefix"]) < 1e-6
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "k3/reward+loss/prefix" in printed and "MISMATCH" not in printed


def test_kl_table_rejects_bad_override(capsys):
    assert main(["kl-table", "vocab=1"]) == 2
    assert "vocab" in capsys.readouterr().out
