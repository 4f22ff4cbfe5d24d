"""The launcher protocol (cluster/launchers/): one registry, and each launcher turning the same
`RunRequest` into its own start, poll and stop. No Ray: a local child that klrl refuses at
its door, and SLURM's commands as stand-ins on PATH."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from cluster.launchers.base import RunRequest, SubmitError
from cluster.launchers.local import LocalLauncher
from cluster.launchers.ray_job import RayJobLauncher
from cluster.launchers.ray_jobs import RESUME_IF_STARTED, job_spec, resubmission
from cluster.launchers.registry import LAUNCHERS, launcher
from cluster.launchers.slurm import SlurmLauncher
from cluster.train.continuation import continuation


def test_the_registry_names_one_launcher_per_place_a_run_starts():
    assert LAUNCHERS == {"local": LocalLauncher, "ray-job": RayJobLauncher,
                         "slurm": SlurmLauncher}
    with pytest.raises(ValueError, match="the launchers are local, ray-job, slurm"):
        launcher("ssh")


def test_a_request_carries_the_continuation_verdicts_flags(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0}\n')  # started: resumed
    request = RunRequest.for_run("r", "c.yaml", ["seed=1"], continuation(run))
    assert request.args() == ["train", "c.yaml", "seed=1", "--resume"]
    fresh = RunRequest.for_run("s", "c.yaml", [], continuation(tmp_path / "s"))
    assert fresh.args() == ["train", "c.yaml"]


def test_a_resubmission_asks_the_rule_again_once_whatever_the_first_flags(tmp_path):
    spec = job_spec("configs/tiny_cpu.yaml", ["--resume"], job_name="j")
    again = resubmission(resubmission(spec, 1), 2)
    assert again.entrypoint.endswith(f"--resume {RESUME_IF_STARTED}")
    assert again.entrypoint.count(RESUME_IF_STARTED) == 1 and again.job_name == "j-r1-r2"
    assert resubmission(spec, 2).job_name == "j-r2"  # the launcher words each from the first


def test_the_local_launcher_runs_the_request_and_reports_its_exit(tmp_path):
    local = launcher("local", log_dir=tmp_path / "logs")
    handle = local.start(RunRequest("r", str(tmp_path / "missing.yaml")))
    deadline = time.monotonic() + 120
    while (code := local.poll(handle)) is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert code == 2  # klrl train refused the missing config at its door
    log = (tmp_path / "logs" / "r.log").read_text()
    assert f"{sys.executable} -m cluster.cli train {tmp_path / 'missing.yaml'}" in log
    assert local.where(handle) == f"log: {tmp_path / 'logs' / 'r.log'}"


@pytest.fixture
def slurm_commands(tmp_path, monkeypatch) -> Path:
    """sbatch, sacct and scancel stand-ins on PATH: sbatch answers job 4242, sacct reads its
    answer from a file, scancel records its arguments."""
    bin_dir, state = tmp_path / "bin", tmp_path / "sacct-state"
    bin_dir.mkdir()
    scripts = {"sbatch": "echo 4242", "sacct": f"cat {state} 2>/dev/null",
               "scancel": f'echo "$@" > {tmp_path / "scancel-args"}'}
    for name, body in scripts.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return state


def test_the_slurm_launcher_submits_polls_and_stops_a_job(tmp_path, slurm_commands):
    slurm = launcher("slurm", workdir=tmp_path, slurm_dir=tmp_path / "slurm", python="py")
    handle = slurm.start(RunRequest("r", str(tmp_path / "c.yaml"), ("seed=1",)))
    assert handle[0] == "4242" and (tmp_path / "slurm" / "r.sbatch").is_file()
    assert "-- train " in (tmp_path / "slurm" / "r.sbatch").read_text()
    assert slurm.poll(handle) is None  # not known to sacct yet
    for answer, code in (("RUNNING|0:0", None), ("REQUEUED|0:0", None),
                         ("COMPLETED|0:0", 0), ("COMPLETED|2:0", 2), ("CANCELLED by 0|0:15", 1)):
        slurm_commands.write_text(answer + "\n")
        assert slurm.poll(handle) == code, answer
    slurm.stop(handle, 2)
    assert (tmp_path / "scancel-args").read_text().split() == ["--batch", "--signal=2", "4242"]
    assert slurm.where(handle) == f"output: {tmp_path / 'slurm' / 'r-4242.out'}"


def test_the_slurm_launcher_without_sbatch_refuses_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SubmitError, match="sbatch not found"):
        SlurmLauncher(workdir=tmp_path, slurm_dir=tmp_path / "slurm", python="py").start(
            RunRequest("r", "c.yaml"))
    assert not (tmp_path / "slurm").exists()
