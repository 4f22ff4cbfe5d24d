"""`klrl slurm` without a SLURM cluster: the script it writes, what it refuses, and the launcher's
parts that decide what a job's attempt does (resume or not, one stop per job, SIGTERM kept from
the Ray processes). The real job, requeued on a real SLURM, is tests/test_slurm.py."""
import os
import signal
import subprocess
import sys
import time

import pytest

from cluster.cli.main import main
from cluster.config.loader import DEMO_CONFIG
from cluster.slurm import job as launcher
from cluster.slurm.node import block_sigterm


def test_the_script_states_the_allocation_and_execs_the_launcher(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["slurm", str(DEMO_CONFIG), "total_steps=5", "output_dir=out", "--nodes", "2",
                 "rollout.num_gpus_per_worker=1", "--gpus-per-node", "8", "--partition", "gpu",
                 "--time", "1-00:00:00",
                 "--sbatch-arg=--account=proj", "--dry-run"]) == 0
    script = capsys.readouterr().out
    lines = script.splitlines()
    sbatch = [line.removeprefix("#SBATCH ") for line in lines if line.startswith("#SBATCH")]
    name = next(a for a in sbatch if a.startswith("--job-name=")).removeprefix("--job-name=klrl-")
    assert name.startswith("k1-reward-none-b0.05-lag0-s0-")  # run_name fixed at submission
    assert {"--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=8", "--partition=gpu",
            "--time=1-00:00:00", "--requeue", "--signal=B:USR1@300", "--open-mode=append",
            "--account=proj", f"--output={tmp_path}/out/slurm/{name}-%j.out"} <= set(sbatch)
    assert lines[-1].startswith(f"exec {sys.executable} -m cluster.slurm.job --gpus-per-node=8 "
                                f"-- train {DEMO_CONFIG} total_steps=5 output_dir=out "
                                f"rollout.num_gpus_per_worker=1 run_name={name}")
    assert f"cd {tmp_path}" in lines and not (tmp_path / "out").exists()  # dry run: no file


@pytest.mark.parametrize("args, message", [
    (["--time", "4h"], "--time: '4h' is not a SLURM time"),
    (["--nodes", "0"], "--nodes: Input should be greater than or equal to 1"),
    (["--sbatch-arg=account=x"], "give each option as --key=value"),
    (["kl.estimator=k9"], "kl.estimator"),
    (["--signal-lead", "-1"], "--signal-lead: Input should be greater than or equal to 0"),
    (["--sbatch-arg=x"], "--sbatch-arg: 'x': give each option as --key=value"),
    # an allocation the run's actors do not use, or cannot fit in
    (["--nodes", "2", "--gpus-per-node", "8"], "--gpus-per-node 8: the job would reserve 16 "
     "GPU(s), but the run's actors ask for none (rollout.num_gpus_per_worker=0, "
     "learner.num_gpus_per_rank=0); drop --gpus-per-node"),
    (["learner.num_gpus_per_rank=1"], "the run requests 1 GPU (1 x learner.num_gpus_per_rank=1) "
     "but the job (--nodes 1 --gpus-per-node 0) has 0; raise --gpus-per-node"),
    (["--cpus-per-node", "1"], "the run requests 2 CPU"),
    # a sweep file where a run's config goes, and the reverse
    (["--sweep"], "is a training config, not a sweep file"),
])
def test_refusals_are_one_line_before_anything_is_written(tmp_path, capsys, monkeypatch,
                                                          args, message):
    monkeypatch.chdir(tmp_path)
    assert main(["slurm", str(DEMO_CONFIG), *args, "--dry-run"]) == 2
    assert message in capsys.readouterr().err


def test_a_sweep_file_without_sweep_is_named_as_one(tmp_path, capsys, monkeypatch):
    from cluster.config.loader import REPO_ROOT

    monkeypatch.chdir(tmp_path)
    sweep = REPO_ROOT / "configs" / "sweeps" / "offpolicy_tiny.yaml"
    assert main(["slurm", str(sweep), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{sweep} is a sweep file" in err and "--sweep" in err


def test_no_sbatch_here_is_refused_naming_the_dry_run(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert main(["slurm", str(DEMO_CONFIG), "run_name=r"]) == 2
    assert "sbatch not found" in capsys.readouterr().err and not (tmp_path / "runs").exists()


def test_the_launcher_runs_only_inside_a_job(monkeypatch, capsys):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert launcher.main(["train", str(DEMO_CONFIG)]) == 2
    assert "SLURM_JOB_ID is not set" in capsys.readouterr().err


def test_each_attempt_resumes_the_run_once_it_started_and_leaves_a_finished_one(tmp_path):
    from test_continuation import checkpoint

    args = [f"output_dir={tmp_path}", "run_name=r", "total_steps=4"]
    first = launcher.driver_command("py", "train", str(DEMO_CONFIG), args)
    assert first == ["py", "-m", "cluster.cli.main", "train", str(DEMO_CONFIG), *args]
    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0}\n')  # a requeued attempt: the run started
    assert launcher.driver_command("py", "train", str(DEMO_CONFIG), args) == [*first, "--resume"]
    checkpoint(run, 4)  # whole, as the rule checks it (tests/test_continuation.py)
    (run / "final").mkdir()
    (run / "final" / "config.json").write_text("{}")
    assert launcher.driver_command("py", "train", str(DEMO_CONFIG), args) is None  # finished
    sweep = launcher.driver_command("py", "sweep", "s.yaml", ["parallel=2"])
    assert sweep == ["py", "-m", "cluster.cli.main", "sweep", "s.yaml", "parallel=2"]


SIGNALS = """
import signal, sys, time
got = []
for s in (signal.SIGINT, signal.SIGTERM):
    signal.signal(s, lambda n, f: got.append(signal.Signals(n).name))
print("ready", flush=True)
end = time.monotonic() + 5
while time.monotonic() < end and not got:
    time.sleep(0.05)
time.sleep(0.5)
print(" ".join(got), flush=True)
"""


def _child(**kwargs) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", SIGNALS], stdout=subprocess.PIPE, text=True,
                            **kwargs)
    assert proc.stdout.readline() == "ready\n"
    return proc


def test_the_driver_gets_one_sigint_however_many_signals_the_job_gets():
    stop = launcher.Stop()
    stop.driver = driver = _child(preexec_fn=block_sigterm)
    driver.send_signal(signal.SIGTERM)  # SLURM's job-wide SIGTERM: blocked in the driver
    stop.handle(signal.SIGTERM, None)  # ... and the launcher's: one SIGINT to the driver
    stop.handle(signal.SIGUSR1, None)  # a second signal changes nothing
    assert driver.stdout.readline().split() == ["SIGINT"]
    driver.wait()
    assert stop.reason == "SIGTERM" and not stop.requeue
    lead = launcher.Stop()
    lead.handle(signal.SIGUSR1, None)  # the time-limit signal: the job requeues itself
    assert lead.requeue


def test_a_process_started_with_sigterm_blocked_outlives_sigterm():
    proc = _child(preexec_fn=block_sigterm, start_new_session=True)
    proc.send_signal(signal.SIGTERM)
    time.sleep(1)
    assert proc.poll() is None  # still running: the signal is pending, never delivered
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    plain = _child()
    plain.send_signal(signal.SIGTERM)
    assert plain.stdout.readline().split() == ["SIGTERM"]
    plain.wait()


def test_a_sweep_runs_as_one_job_named_after_it(tmp_path, capsys, monkeypatch):
    from cluster.config.loader import REPO_ROOT

    monkeypatch.chdir(tmp_path)
    sweep = REPO_ROOT / "configs" / "sweeps" / "offpolicy_tiny.yaml"
    assert main(["slurm", str(sweep), "--sweep", "output_dir=/shared/x", "--dry-run"]) == 0
    script = capsys.readouterr().out
    assert "#SBATCH --output=/shared/x/slurm/offpolicy_tiny-%j.out" in script
    assert script.rstrip().endswith(f"-- sweep {sweep} output_dir=/shared/x")  # no run_name
