"""`klrl slurm` against a real SLURM: Debian's munged, slurmctld and slurmd as a one-node
cluster on loopback (tests/slurm_cluster.py), a run submitted with `klrl slurm` (sbatch),
requeued mid-run with `scontrol requeue`, released, and finished by its second attempt.

Checked: the requeue's SIGTERM (sent to every process of the job) stops the run cleanly with a
checkpoint at the step it reached (checkpoint_every is 0: that checkpoint can only come from the
signal), SLURM requeues the job, the second attempt (SLURM_RESTART_COUNT=1) resumes the run
with no flag given, and the run ends as one uninterrupted run does: steps 0..N each logged
once and, at max_lag 0, bit-identical final weights. Nothing of the job's Ray is left running.
Where SLURM cannot run (not installed, not root) the test skips saying why.
"""
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from slurm_cluster import SlurmCluster, unavailable
from tiny_runs import tiny_run_config, tiny_run_overrides

from cluster.cli.main import main
from cluster.config.loader import DEMO_CONFIG
from cluster.train import checkpoint as ckpt
from cluster.train.run import train
from cluster.train.run_log import last_step, read_metrics

pytestmark = pytest.mark.slow
XDIST_GROUP = "own-processes"  # runs of their own processes (tests/conftest.py)

STEPS = 6
REQUEUE_AT = 2  # the requeue is sent once this step is logged


def _wait(what: str, done, timeout: float, output: Path | None = None):
    deadline = time.monotonic() + timeout
    while not (value := done()):
        if time.monotonic() > deadline:
            log = output.read_text(errors="replace")[-4000:] if output and output.exists() else ""
            raise AssertionError(f"{what}: not within {timeout:.0f} s\n{log}")
        time.sleep(0.3)
    return value


def _final_params(run_dir: Path) -> dict:
    out = {}
    for f in sorted((run_dir / "final").glob("*.safetensors")):
        out |= load_file(f)
    return out


@pytest.fixture(scope="module")
def slurm():
    if reason := unavailable():
        pytest.skip(reason)
    cluster = SlurmCluster(cpus=os.cpu_count() or 1).start()
    yield cluster
    cluster.stop()


def test_requeued_job_resumes_by_itself_and_ends_as_one_uninterrupted_run(
        slurm, tiny_model_dir, tmp_path, monkeypatch, ray_cluster):
    straight, _ = train(tiny_run_config(tiny_model_dir, tmp_path, "straight", STEPS))

    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "requeued"
    assert main(["slurm", str(DEMO_CONFIG),
                 *tiny_run_overrides(tiny_model_dir, tmp_path, "requeued", STEPS),
                 "--cpus-per-node=2", "--ray-start-arg=--object-store-memory=200000000"]) == 0
    script = tmp_path / "slurm" / "requeued.sbatch"
    job_id = _wait("the job", lambda: slurm.run("squeue", "-h", "-o", "%i").stdout.strip(), 30)
    output = tmp_path / "slurm" / f"requeued-{job_id}.out"
    assert "--requeue" in script.read_text()

    def logged() -> int:
        return last_step(run_dir) if (run_dir / "metrics.jsonl").is_file() else -1
    _wait(f"step {REQUEUE_AT} of the first attempt", lambda: logged() >= REQUEUE_AT, 600, output)
    slurm.run("scontrol", "requeue", job_id)
    job = _wait("the requeued job pending", lambda: (j := slurm.job(job_id))["JobState"] ==
                "PENDING" and j, 180, output)
    assert job["Restarts"] == "1", job

    first = output.read_text()
    assert "SIGTERM: stopping the run with a checkpoint" in first, first[-3000:]
    assert "klrl train exited with 130" in first, first[-3000:]
    kept = ckpt.complete_checkpoints(ckpt.checkpoint_root(run_dir))
    assert len(kept) == 1, kept  # checkpoint_every: 0: the signal's checkpoint, none other
    stopped_at = ckpt.read_checkpoint(kept[0]).step
    assert REQUEUE_AT <= stopped_at < STEPS and last_step(run_dir) == stopped_at  # mid-run

    slurm.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
    job = _wait("the second attempt to finish", lambda: (j := slurm.job(job_id))["JobState"]
                in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") and j, 600, output)
    second = output.read_text()[len(first):]
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", second[-3000:]
    assert "attempt 2 (SLURM_RESTART_COUNT=1)" in second
    assert f"holds the run: resuming it from {kept[0].name}" in second

    steps = [m["step"] for m in read_metrics(run_dir)]
    assert steps == list(range(STEPS + 1)), steps  # each step once: none lost, none doubled
    a, b = _final_params(straight), _final_params(run_dir)
    assert a.keys() == b.keys() and a
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert max(m.get("grad/norm", 0) for m in read_metrics(straight)) > 0  # it did train

    ps = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    left = [line for line in ps.splitlines() if f"/tmp/klrl-job-{job_id}-" in line]
    assert not left, left  # the launcher killed its Ray on both attempts
