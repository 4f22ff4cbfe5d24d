"""The run directory's one owner (cluster/train/run_log.py): what RunLog writes, and the one
rule every reader of metrics.jsonl applies to a bad line (skip it)."""
import json
import math

from cluster.config.loader import DEMO_CONFIG
from cluster.config.train_config import load_train_config
from cluster.experiments.report import load_run
from cluster.experiments.sweep import run_state
from cluster.train.run_log import (
    RunLog,
    abandon_metrics,
    final_dir,
    is_finished,
    keep_metrics_through,
    last_step,
    metrics_path,
    read_config,
    read_metrics,
)

GOOD = [{"step": 0, "eval/in_domain/accuracy": 0.1}, {"step": 1, "reward/mean": 0.5},
        {"step": 2, "reward/mean": 0.6}]
BAD = ["", "not json", "[1, 2]", '{"reward/mean": 1.0}', '{"step": "3"}']


def _write(run_dir, cut_last=True):
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(GOOD[0]), BAD[0], BAD[1], json.dumps(GOOD[1]), *BAD[2:],
             json.dumps(GOOD[2])]
    text = "\n".join(lines) + "\n" + ('{"step": 3, "rew' if cut_last else "")
    metrics_path(run_dir).write_text(text)


def test_every_reader_skips_the_same_bad_lines(tmp_path):
    _write(tmp_path / "run")
    assert read_metrics(tmp_path / "run") == GOOD
    assert last_step(tmp_path / "run") == 2  # the cut last line is skipped
    assert sorted(load_run(tmp_path / "run").rows) == [0, 1, 2]
    keep_metrics_through(tmp_path / "run", 1)  # what a resume from step 1 does
    assert metrics_path(tmp_path / "run").read_text() == "".join(
        json.dumps(r) + "\n" for r in GOOD[:2])
    assert last_step(tmp_path / "missing") == 0


def test_run_log_writes_config_and_metrics_and_marks_nothing_finished(tmp_path):
    cfg = load_train_config(DEMO_CONFIG, ["logging.wandb_mode=disabled", "seed=3"])
    with RunLog(cfg, tmp_path / "run") as log:
        log.log({"step": 0, "reward/mean": 0.25})
        log.log({"step": 1, "grad/norm": math.inf, "kl/pi_ref": math.nan})
    assert read_metrics(tmp_path / "run") == [{"step": 0, "reward/mean": 0.25},
                                              {"step": 1, "grad/norm": "inf", "kl/pi_ref": "nan"}]
    assert read_config(tmp_path / "run")["seed"] == 3
    assert not is_finished(tmp_path / "run") and run_state(tmp_path / "run") == "partial"
    final_dir(tmp_path / "run").mkdir()
    (final_dir(tmp_path / "run") / "config.json").write_text("{}")
    assert is_finished(tmp_path / "run") and run_state(tmp_path / "run") == "finished"


def test_abandoned_metrics_are_numbered(tmp_path):
    for n in range(2):
        _write(tmp_path, cut_last=False)
        assert abandon_metrics(tmp_path).name == f"metrics.jsonl.abandoned-{n}"
    assert not metrics_path(tmp_path).exists()


def test_every_start_records_the_klrl_version_and_git_commit(tmp_path):
    import subprocess
    import sys

    from cluster.config.loader import REPO_ROOT

    import tomllib

    version = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                          text=True, check=True).stdout.strip()
    cfg = load_train_config(DEMO_CONFIG, ["logging.wandb_mode=disabled"])
    with RunLog(cfg, tmp_path / "run"):
        pass
    with RunLog(cfg, tmp_path / "run", resume_wandb_id="abc"):  # a resume adds a line
        pass
    starts = [json.loads(line) for line in (tmp_path / "run" / "provenance.jsonl").open()]
    assert [s["resumed"] for s in starts] == [False, True]
    assert all(s["git_commit"] == head and s["klrl_version"] == version for s in starts)
    assert isinstance(starts[0]["git_dirty"], bool) and starts[0]["started_at"]

    out = subprocess.run([sys.executable, "-m", "cluster.cli", "--version"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.startswith(f"klrl {version} (git {head[:12]}")
