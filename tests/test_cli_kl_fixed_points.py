"""`klrl kl-fixed-points` end to end: a mistake in its options is refused before any training
(exit 2, one `error: ` line naming the option, no --out left behind), and a single lag, which
once failed in the plot after the JSON and the table were written, writes all three files."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.cli import cmd_kl_fixed_points
from cluster.cli.main import main


def _refuse(*_args, **_kw):
    raise AssertionError("the command got past its checks")


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _exit_code(argv: list[str]) -> int:
    """main's exit status; argparse's refusals raise SystemExit."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


@pytest.mark.parametrize("extra, named", [
    (["--steps", "0"], "--steps"),
    (["--samples", "1"], "--samples"),
    (["--lr", "0"], "--lr"),
    (["--lr", "-1"], "--lr"),
    (["--sampled-lr", "nan"], "--sampled-lr"),
    (["--beta", "0"], "--beta"),
    (["--beta", "inf"], "--beta"),
    (["--lags", "0,-2"], "--lags"),
    (["--lags", "0,2.5"], "--lags"),
    (["--lags", "0,,2"], "--lags"),
    (["--lags", "2,2"], "--lags"),
    (["--seed", "-1"], "--seed"),
    (["--seed", str(2**64)], "--seed"),
])
def test_kl_fixed_points_refuses_bad_option(extra, named, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cmd_kl_fixed_points, "compute", _refuse)
    monkeypatch.chdir(tmp_path)
    assert _exit_code(["kl-fixed-points", "--out", "out", *extra]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], captured.err
    assert captured.out == ""
    assert _tree(tmp_path) == set()


@pytest.mark.parametrize("case", ["out is a file", "parent is a file", "an output is a dir"])
def test_kl_fixed_points_refuses_unwritable_out(case, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cmd_kl_fixed_points, "compute", _refuse)
    (tmp_path / "file").write_text("x")
    out = {"out is a file": tmp_path / "file",
           "parent is a file": tmp_path / "file" / "sub" / "out",
           "an output is a dir": tmp_path / "out"}[case]
    if case == "an output is a dir":
        (out / "table.md").mkdir(parents=True)
    before = _tree(tmp_path)
    assert _exit_code(["kl-fixed-points", "--out", str(out), "--lags", "0"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --out="), captured.err
    assert _tree(tmp_path) == before


def test_kl_fixed_points_single_lag_writes_everything(tmp_path, capsys):
    out = tmp_path / "new" / "toy"
    rc = main(["kl-fixed-points", "--out", str(out), "--lags", "8", "--steps", "3",
               "--samples", "2"])
    assert rc == 0
    assert (out / "fixed_points.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads((out / "fixed_points.json").read_text())
    assert result["settings"]["lags"] == [8] and result["settings"]["steps"] == 3
    assert len(result["rows"]) == 7 and {r["lag"] for r in result["rows"]} == {8}
    table = (out / "table.md").read_text()
    assert table.count("-lag-8\"></a>") == 7
    assert "| K1 in reward | 8 |" in table.replace('<a id="k1-in-reward-lag-8"></a>', "")
    assert "K1 in reward" in capsys.readouterr().out
