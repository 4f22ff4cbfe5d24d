"""How a sweep starts its runs: `LocalLauncher` (one local process each) or `RayJobLauncher`
(one Ray job each). Both offer start / poll / stop / where, which is all `run_sweep` uses."""
from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from cluster.experiments.sweep import RunSpec, SweepConfig, sweep_dir, train_command
from cluster.train.continuation import Continuation, continuation
from cluster.train.job_upload import UploadError, project_upload, python_candidates
from cluster.train.jobs import SubmitError, cluster_python, driver_lost, job_client, submit


class LocalLauncher:
    """Each run is `python -m cluster.cli train ...`, a child process with its own local Ray
    cluster, writing its output to SWEEP_DIR/logs/NAME.log (appended to on a resume). Children
    get their own process group, so only the signals the sweep forwards reach them."""

    def __init__(self, log_dir: Path):
        self.log_dir = Path(log_dir)

    def start(self, cfg: SweepConfig, run: RunSpec, verdict: Continuation):
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{run.name}.log"
        cmd = [sys.executable, "-m", "cluster.cli", *train_command(cfg, run, verdict)]
        log = open(log_path, "a")  # noqa: SIM115 - closed by poll() when the child exits
        log.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return proc, log, log_path

    def poll(self, handle) -> int | None:
        proc, log, _ = handle
        code = proc.poll()
        if code is not None:
            log.close()
        return code

    def stop(self, handle, signum: int) -> None:
        if handle[0].poll() is None:
            handle[0].send_signal(signum)  # klrl train: first signal checkpoints, second stops now

    def where(self, handle) -> str:
        return f"log: {handle[2]}"


@dataclass
class RunJob:
    """A run's current Ray job, and how often it was resubmitted after losing its driver."""

    cfg: SweepConfig
    run: RunSpec
    job_id: str
    resubmits: int = 0


class RayJobLauncher:
    """One Ray job per run (`klrl submit --no-wait`), polled for its status. The run
    directories must be on storage this machine shares with the cluster (see SweepConfig).
    A job whose driver is lost (jobs.driver_lost: killed, or its node gone) is submitted
    again, up to `max_resubmits` times per run, with `--resume` where the continuation rule
    says so (cluster/train/continuation.py): the run goes on from its last checkpoint; one
    that failed or stopped by itself is not."""

    def __init__(self, address: str, python: str | None = None, max_resubmits: int = 0,
                 upload_list: str | None = None):
        """`python`: the cluster's (None: this one's path, else `python`), checked there once,
        before any run's files are uploaded; `upload_list`: the files each job carries (None:
        the project's tracked files; cluster/train/job_upload.py). SubmitError otherwise."""
        self.address, self.max_resubmits = address, max_resubmits
        self.client = job_client(address)
        try:
            self.upload = project_upload(upload_list)
        except UploadError as exc:
            raise SubmitError(str(exc)) from None
        self.python = cluster_python(address, python_candidates(python))

    def start(self, cfg: SweepConfig, run: RunSpec, verdict: Continuation) -> RunJob:
        return RunJob(cfg, run, self._submit(cfg, run, verdict))

    def _submit(self, cfg: SweepConfig, run: RunSpec, verdict: Continuation) -> str:
        args = train_command(cfg, run, verdict)[2:]  # the overrides (and --resume)
        return submit(cfg.train_config, self.address, args, wait=False, python=self.python,
                      upload=self.upload)

    def poll(self, job: RunJob) -> int | None:
        from ray.job_submission import JobStatus  # Ray: only once a cluster sweep runs

        status = self.client.get_job_status(job.job_id)
        if not status.is_terminal():
            return None
        if status == JobStatus.SUCCEEDED:
            return 0
        why = driver_lost(self.client.get_job_info(job.job_id))
        if why is None or job.resubmits >= self.max_resubmits:
            return 1
        job.resubmits += 1
        verdict = continuation(sweep_dir(job.cfg) / job.run.name)  # the one rule
        lost, job.job_id = job.job_id, self._submit(job.cfg, job.run, verdict)
        print(f"{job.run.name}: job {lost}: {why}; resubmitted as {job.job_id} (resubmission "
              f"{job.resubmits}/{self.max_resubmits})", flush=True)
        return None

    def stop(self, job: RunJob, signum: int) -> None:
        self.client.stop_job(job.job_id)  # Ray sends SIGTERM (the run checkpoints), then SIGKILL

    def where(self, job: RunJob) -> str:
        return f"logs: ray job logs {job.job_id} --address {self.address}"
