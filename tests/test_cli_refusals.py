"""Where `klrl report`, `sweep --address`, `bench` and `slurm` write, or whom they reach, is
checked before they start: a mistake seen there exits 2 with one `error:` line naming the
option, nothing heavy runs (each heavy step is a stand-in that fails the test) and nothing is
created or set aside. A path under a regular file stands for a place nothing can be written
(root, which runs the suite in CI, passes permission checks; a file in the way stops it)."""
from __future__ import annotations

import os
import socket
import sys
import time
import types
from pathlib import Path

import pytest
import yaml

from cluster.cli.main import main

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_cpu.yaml"


class GotPastTheDoor(AssertionError):
    """Raised where something heavy would start."""


def _refuse(*_args, **_kw):
    raise GotPastTheDoor("the command got past its checks")


def _refused(capsys, argv: list[str], *names: str) -> str:
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for name in names:
        assert name in lines[0], lines[0]
    return lines[0]


def _tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.fixture
def a_file(tmp_path) -> Path:
    (tmp_path / "a-file").write_text("x")
    return tmp_path / "a-file"


# --------------------------------------------------------------------------- klrl report


@pytest.fixture
def runs(tmp_path, monkeypatch) -> Path:
    """A directory with one run that logged a step; the report's writing is a stand-in."""
    from cluster.cli import cmd_sweep

    monkeypatch.setattr(cmd_sweep, "write_report", _refuse)
    (tmp_path / "runs" / "r1").mkdir(parents=True)
    (tmp_path / "runs" / "r1" / "metrics.jsonl").write_text('{"step": 1}\n')
    return tmp_path / "runs"


def test_report_out_under_a_file_is_refused(runs, a_file, tmp_path, capsys):
    before = _tree(tmp_path)
    line = _refused(capsys, ["report", str(runs), "--out", str(a_file / "report"), "--no-wandb"],
                    "--out", "cannot write the report there")
    assert "give --out DIR" in line
    assert _tree(tmp_path) == before
    with pytest.raises(GotPastTheDoor):  # a place that can be made passes, and is not made yet
        main(["report", str(runs), "--out", str(tmp_path / "new" / "report"), "--no-wandb"])
    assert _tree(tmp_path) == before


def test_report_with_a_file_where_its_directory_goes_is_refused(runs, tmp_path, capsys):
    (runs / "report").write_text("not a directory")
    before = _tree(tmp_path)
    _refused(capsys, ["report", str(runs), "--no-wandb"], f"{runs / 'report'}", "give --out DIR")
    assert _tree(tmp_path) == before


def test_report_comparison_beside_a_file_is_refused(runs, tmp_path, capsys):
    (runs / "r2").mkdir()
    (runs / "r2" / "metrics.jsonl").write_text('{"step": 1}\n')
    (runs / "report-r1-vs-r2").write_text("in the way")
    before = _tree(tmp_path)
    _refused(capsys, ["report", str(runs / "r1"), str(runs / "r2"), "--no-wandb"],
             "report-r1-vs-r2", "give --out DIR")
    assert _tree(tmp_path) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_report_of_a_read_only_runs_directory_is_refused(runs, capsys):
    runs.chmod(0o555)
    try:
        _refused(capsys, ["report", str(runs), "--no-wandb"], "the report directory", "--out")
        assert not (runs / "report").exists()
    finally:
        runs.chmod(0o755)


# --------------------------------------------------------------------------- klrl sweep


def _free_port() -> int:
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def sweep(tmp_path, monkeypatch) -> Path:
    """A one-run sweep writing under tmp_path/runs, whose run was recorded with another
    kl.beta (so --rerun would set it aside); the runs and the Ray client are stand-ins."""
    from cluster.cli import cmd_sweep
    from cluster.config.loader import dump_config
    from cluster.config.train_config import load_train_config
    from cluster.sweeps.sweep import expand, load_sweep, sweep_dir
    from cluster.launchers import ray_jobs as jobs
    from cluster.train.door.paths import resolve_paths

    monkeypatch.setattr(cmd_sweep, "run_sweep", _refuse)
    monkeypatch.setattr(cmd_sweep, "make_launcher", _refuse)
    monkeypatch.setattr(jobs, "CONNECT_TIMEOUT_S", 2.0)
    for var in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY", "RAY_ADDRESS"):
        monkeypatch.delenv(var, raising=False)
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"name": "s", "train_config": str(TINY),
                                    "output_dir": str(tmp_path / "runs"),
                                    "overrides": {"logging.wandb_mode": "disabled"},
                                    "grid": {"seed": [0]}}))
    cfg = load_sweep(path)
    (run,) = expand(cfg)
    run_dir = sweep_dir(cfg) / run.name
    run_dir.mkdir(parents=True)
    recorded = load_train_config(cfg.train_config, [*run.overrides, "kl.beta=0.5"])
    dump_config(resolve_paths(recorded), run_dir / "config.yaml")
    return path


def test_sweep_with_an_address_nothing_answers_on_is_refused_before_anything_moves(
        sweep, tmp_path, capsys):
    port = _free_port()
    before = _tree(tmp_path)
    t0 = time.monotonic()
    line = _refused(capsys, ["sweep", str(sweep), "--address", f"http://127.0.0.1:{port}",
                             "--rerun"], f"cannot reach the Ray dashboard at http://127.0.0.1:{port}")
    assert time.monotonic() - t0 < 30
    assert "8265" in line  # names the fix: the dashboard's address
    assert _tree(tmp_path) == before  # the changed run was not set aside, nothing was created
    assert not (tmp_path / "runs" / "s" / "replaced").exists()
    # --dry-run contacts nothing, as `klrl submit --dry-run`: it lists what would happen
    assert main(["sweep", str(sweep), "--address", f"127.0.0.1:{port}", "--rerun",
                 "--dry-run"]) == 0
    assert "would move to" in capsys.readouterr().out and _tree(tmp_path) == before


# --------------------------------------------------------------------------- klrl bench


@pytest.fixture
def bench(monkeypatch):
    """The measurements and the TRL comparison are stand-ins; the peers extra counts as
    installed, so only the door can refuse."""
    from cluster.bench import peer_trl

    run = types.ModuleType("cluster.bench.run")
    run.FULL = run.QUICK = None
    run.gpu_plan = run.print_tables = run.run_bench = _refuse
    peers = types.ModuleType("cluster.bench.peers")
    peers.PEERS_FULL = peers.PEERS_QUICK = None
    peers.check_peers = peers.print_peer_table = peers.run_peers = _refuse
    monkeypatch.setitem(sys.modules, "cluster.bench.run", run)
    monkeypatch.setitem(sys.modules, "cluster.bench.peers", peers)
    monkeypatch.setattr(peer_trl, "missing_extra", lambda: None)


@pytest.mark.parametrize("peer", [[], ["--peer", "trl"]], ids=["bench", "peer"])
@pytest.mark.parametrize("case", ["json-dir", "json-under-file", "work-dir-file"])
def test_bench_refuses_where_it_cannot_write_before_it_measures(
        bench, tmp_path, a_file, capsys, peer, case):
    (tmp_path / "results").mkdir()
    flag, value, says, fixed = {
        "json-dir": ("--json", tmp_path / "results", "is a directory",
                     tmp_path / "results" / "b.json"),
        "json-under-file": ("--json", a_file / "b.json", "cannot create it",
                            tmp_path / "new" / "b.json"),
        "work-dir-file": ("--work-dir", a_file, "cannot create it", tmp_path / "work"),
    }[case]
    before = _tree(tmp_path)
    _refused(capsys, ["bench", *peer, "--quick", flag, str(value)], f"{flag}=", says)
    assert _tree(tmp_path) == before
    with pytest.raises(GotPastTheDoor):  # the fix the line names passes, nothing made yet
        main(["bench", *peer, "--quick", flag, str(fixed)])
    assert _tree(tmp_path) == before


def test_bench_peer_refuses_a_docs_page_without_its_block(bench, tmp_path, capsys):
    page = tmp_path / "bench.md"
    page.write_text("# Bench\n<!-- bench:figures -->\nx\n<!-- /bench:figures -->\n")
    _refused(capsys, ["bench", "--peer", "trl", "--docs", str(page)], "--docs", "bench:peers")
    _refused(capsys, ["bench", "--peer", "trl", "--docs", str(tmp_path / "none.md")], "--docs")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.md"]
    page.write_text(page.read_text() + "<!-- bench:peers -->\nold\n<!-- /bench:peers -->\n")
    with pytest.raises(GotPastTheDoor):  # the page with its block passes
        main(["bench", "--peer", "trl", "--docs", str(page)])


# --------------------------------------------------------------------------- klrl slurm


@pytest.fixture
def sbatch(tmp_path, monkeypatch) -> Path:
    """A stand-in sbatch on PATH that records that it ran; returns the record's path."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    called = tmp_path / "sbatch-called"
    (bin_dir / "sbatch").write_text(f"#!/bin/sh\ntouch {called}\necho 4242\n")
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.chdir(tmp_path)
    return called


@pytest.mark.parametrize("where", ["under-a-file", "slurm-is-a-file"])
def test_slurm_refuses_an_output_dir_it_cannot_write_the_script_into(
        sbatch, tmp_path, a_file, capsys, where):
    if where == "under-a-file":
        output_dir = a_file / "runs"
    else:
        output_dir = tmp_path / "out"
        output_dir.mkdir()
        (output_dir / "slurm").write_text("in the way")
    before = _tree(tmp_path)
    _refused(capsys, ["slurm", str(TINY), "run_name=r", f"output_dir={output_dir}"],
             f"output_dir={output_dir}", "writable output_dir")
    assert _tree(tmp_path) == before and not sbatch.exists()
    good = tmp_path / "good"  # a writable output_dir: the script is written and submitted
    assert main(["slurm", str(TINY), "run_name=r", f"output_dir={good}"]) == 0
    assert "submitted job 4242" in capsys.readouterr().out and sbatch.exists()
    assert (good / "slurm" / "r.sbatch").is_file()


def test_a_job_sbatch_refuses_leaves_nothing_and_exits_2(sbatch, tmp_path, capsys):
    """sbatch's own refusal (a partition or account SLURM does not have) is a mistake in the
    command, seen before anything ran: exit 2 with sbatch's reason, and the script and the
    slurm/ directory it made are gone."""
    refusing = tmp_path / "bin" / "sbatch"
    refusing.write_text("#!/bin/sh\necho 'sbatch: error: invalid partition specified: gpuz' >&2"
                        "\nexit 1\n")
    out = tmp_path / "out"
    before = _tree(tmp_path)
    _refused(capsys, ["slurm", str(TINY), "run_name=r", f"output_dir={out}",
                      "--partition=gpuz"], "sbatch refused the job", "invalid partition")
    assert _tree(tmp_path) == before
