"""Exact resume and exact learner restart, end to end with real Ray + vLLM + DeepSpeed on the
tiny random model.

At max_lag 0, 4 steps in one go and 2 steps + resume + 2 steps must give bit-identical
parameters: the learner state (weights, AdamW moments, LR schedule, RNG) comes back from the
DeepSpeed checkpoint, the workers are re-synced to the checkpoint's version, the prompt
stream restarts at the saved data position and every sampling seed is a function of
(seed, data position). A half-written newer checkpoint lying around must be ignored, and
the samples table and the hf/ exports hold each step once, as if the run had gone in one go.

The resumed half also loses its learner rank (SIGKILL, in its train step of step 4, once step 3
is logged): the run restarts the learner from the checkpoint of step 2 in the run, redoes
step 3, and must still end bit-identical to the run that went in one go, with every per-step
metric the same and each step's rows once (one run carries both: each costs a Ray + vLLM +
DeepSpeed start).

The same holds for a SLURM job requeued mid-run (`klrl slurm`, last test): against a real
SLURM, Debian's munged, slurmctld and slurmd started as a one-node cluster on loopback
(tests/slurm_cluster.py), the job submitted with sbatch, requeued with `scontrol requeue` and
resumed by its next attempt with no flag, compared with the uninterrupted run above. Where
SLURM cannot run (not installed, not root) that test skips saying why.
"""
import json
import os
import subprocess
import time

import pytest
import torch
from safetensors.torch import load_file
from slurm_cluster import SlurmCluster, unavailable
from tiny_runs import LearnerKiller, tiny_run_config, tiny_run_overrides

from cluster.cli.main import main
from cluster.config.loader import DEMO_CONFIG, ConfigError
from cluster.train import checkpoint as ckpt
from cluster.train.run import train
from cluster.train.run_log import last_step, read_metrics, read_samples, samples_path

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def _ray(ray_cluster):  # the runs share the session's cluster (a run joins a running one)
    pass


EXTRA = ("learner.warmup_steps=2", "logging.samples_every=1", "logging.samples_per_log=2")


def _cfg(tiny_model_dir, out, name, steps, *extra):
    return tiny_run_config(tiny_model_dir, out, name, steps, *EXTRA, *extra)


def _final_params(run_dir) -> dict:
    out = {}
    for f in sorted((run_dir / "final").glob("*.safetensors")):
        out |= load_file(f)
    return out


# Metrics that measure the machine (times, throughput, engine idling) or count faults: the rest
# of a step's row is decided by the run alone.
MACHINE = ("time/", "throughput/", "faults/", "rollout/engine_idle_share")


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    straight, _ = train(_cfg(tiny_model_dir, out, "straight", 4))
    half, _ = train(_cfg(tiny_model_dir, out, "halves", 2, "checkpoint_every=2", "hf_every=1"))
    # debris of a later checkpoint whose writer was killed: must be ignored
    root = ckpt.checkpoint_root(half)
    (root / ".partial-step_000000003" / "learner").mkdir(parents=True)
    (root / "step_000000003").mkdir()
    # ... and of a step 3 that was logged and exported before the process died
    with open(samples_path(half), "a") as f:
        f.write(json.dumps({"step": 3, "response": "from the lost attempt"}) + "\n")
    (ckpt.hf_root(half) / "step_000000003").mkdir()
    (ckpt.hf_root(half) / "step_000000003" / "lost").write_text("")
    with LearnerKiller(half, after_step=3) as killer:
        resumed, _ = train(_cfg(tiny_model_dir, out, "halves", 4, "checkpoint_every=2",
                                "hf_every=1"), resume=True)
    assert killer.killed, "the learner rank was never seen in a train step after step 3"
    return straight, half, resumed


def test_half_resume_half_equals_one_go_bit_for_bit(runs):
    straight, _, resumed = runs
    a, b = _final_params(straight), _final_params(resumed)
    assert a.keys() == b.keys() and a
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # the runs did learn something (otherwise equality would prove nothing)
    assert max(m.get("grad/norm", 0) for m in read_metrics(straight)) > 0


def test_resumed_and_restarted_metrics_continue_the_log(runs):
    straight, half, resumed = runs
    assert resumed == half
    steps = [m["step"] for m in read_metrics(resumed)]
    assert steps == [0, 1, 2, 3, 4], steps  # each step once: nothing lost, nothing doubled
    one_go = {m["step"]: m for m in read_metrics(straight)}
    for m in read_metrics(resumed):
        # the first half ended at step 2, and a run evaluates at its end
        extra = ("eval/",) if m["step"] == 2 else ()
        decided = {k: v for k, v in m.items() if not k.startswith((*MACHINE, *extra))}
        assert decided == {k: v for k, v in one_go[m["step"]].items()
                           if not k.startswith(MACHINE)}, m["step"]
    last = read_metrics(resumed)[-1]  # step 3 was logged, lost with the rank, and redone
    assert last["faults/learner_restarts"] == 1 and last["faults/learner_steps_lost"] == 1


def test_resumed_samples_and_exports_hold_each_step_once(runs):
    straight, _, resumed = runs
    rows = read_samples(resumed)
    assert [r["step"] for r in rows] == [1, 1, 2, 2, 3, 3, 4, 4]
    assert rows == read_samples(straight)  # exact resume: the same samples, the lost row gone
    exports = ckpt.hf_exports(resumed)
    assert [p.name for p in exports] == [f"step_00000000{s}" for s in (1, 2, 3, 4)]
    assert (exports[2] / "config.json").is_file() and not (exports[2] / "lost").exists()


def test_resume_keeps_the_wandb_run_and_checkpoints(runs):
    _, half, _ = runs
    kept = ckpt.complete_checkpoints(ckpt.checkpoint_root(half))
    assert [p.name for p in kept] == ["step_000000002", "step_000000004"]
    state = ckpt.read_checkpoint(kept[-1])
    assert state.step == 4 and state.prompt_position == 16 and state.wandb_id
    assert state.learner_restarts == 1 and state.learner_steps_lost == 1
    ids = {d.name.rsplit("-", 1)[-1] for d in (half / "wandb").glob("offline-run-*")}
    assert ids == {state.wandb_id}, ids
    assert json.loads((kept[0] / "controller.json").read_text())["config"]["total_steps"] == 2


def test_resume_refuses_a_changed_objective(runs, tiny_model_dir):
    _, half, _ = runs
    cfg = _cfg(tiny_model_dir, half.parent, "halves", 6, "checkpoint_every=2", "kl.beta=0.5")
    with pytest.raises(ConfigError, match="kl"):
        train(cfg, resume=True)


def _wait(what: str, done, timeout: float, output=None):
    deadline = time.monotonic() + timeout
    while not (value := done()):
        if time.monotonic() > deadline:
            log = output.read_text(errors="replace")[-4000:] if output and output.exists() else ""
            raise AssertionError(f"{what}: not within {timeout:.0f} s\n{log}")
        time.sleep(0.3)
    return value


@pytest.fixture
def slurm():
    if reason := unavailable():
        pytest.skip(reason)
    cluster = SlurmCluster(cpus=os.cpu_count() or 1).start()
    yield cluster
    cluster.stop()


def test_a_slurm_job_requeued_mid_run_resumes_by_itself_and_ends_as_the_run_in_one_go(
        runs, slurm, tiny_model_dir, tmp_path, monkeypatch):
    """`klrl slurm` submits the 4-step run (sbatch); `scontrol requeue` once step 1 is logged
    sends every process of the job SIGTERM: the run stops with a checkpoint at the step it
    reached (checkpoint_every is 0: that checkpoint can only be the signal's), SLURM requeues
    the job, its second attempt (SLURM_RESTART_COUNT=1) resumes the run with no flag, and the
    run ends as the uninterrupted one: each step logged once, the same samples, bit-identical
    weights. No process of the job's Ray is left."""
    straight, _, _ = runs
    steps = 4
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "requeued"
    # Scored 0.1 s a completion (the same rewards, so the same run): the steps after the first
    # take seconds each, so the requeue lands mid-run. At full speed a quiet machine finished
    # all four steps between step 1's line and the requeue's SIGTERM, and the job ended whole.
    assert main(["slurm", str(DEMO_CONFIG),
                 *tiny_run_overrides(tiny_model_dir, tmp_path, "requeued", steps, *EXTRA),
                 "task.reward=scorers:short_answers_slowly",
                 "--cpus-per-node=2", "--ray-start-arg=--object-store-memory=200000000"]) == 0
    assert "--requeue" in (tmp_path / "slurm" / "requeued.sbatch").read_text()
    job_id = _wait("the job", lambda: slurm.run("squeue", "-h", "-o", "%i").stdout.strip(), 30)
    output = tmp_path / "slurm" / f"requeued-{job_id}.out"

    def logged() -> int:
        return last_step(run_dir) if (run_dir / "metrics.jsonl").is_file() else -1
    _wait("step 1 of the first attempt", lambda: logged() >= 1, 600, output)
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
    assert 1 <= stopped_at < steps and last_step(run_dir) == stopped_at  # stopped mid-run

    slurm.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")  # its BeginTime: now
    job = _wait("the second attempt to end", lambda: (j := slurm.job(job_id))["JobState"]
                in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") and j, 600, output)
    second = output.read_text()[len(first):]
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", second[-3000:]
    assert "attempt 2 (SLURM_RESTART_COUNT=1)" in second
    assert f"holds the run: resuming it from {kept[0].name}" in second

    assert [m["step"] for m in read_metrics(run_dir)] == list(range(steps + 1))
    assert read_samples(run_dir) == read_samples(straight)
    a, b = _final_params(straight), _final_params(run_dir)
    assert a.keys() == b.keys() and a
    for name in a:
        assert torch.equal(a[name], b[name]), name
    ps = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    left = [line for line in ps.splitlines() if f"/tmp/klrl-job-{job_id}-" in line]
    assert not left, left  # the launcher killed its Ray on both attempts
