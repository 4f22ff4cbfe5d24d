"""The Ray job launcher: one Ray job per run on a cluster's dashboard (ray_jobs.py, the client),
for `klrl submit` and `klrl sweep --address` alike, with the one resubmission rule: a job whose
driver is lost (`ray_jobs.driver_lost`: killed, or its node gone; not a run that failed or
stopped by itself) is submitted again, up to `max_resubmits` times per run, as
`ray_jobs.resubmission` words it (`--resume-if-started`: the continuation rule decides where it
runs again)."""
from __future__ import annotations

import sys
from dataclasses import dataclass

from cluster.config.train_config import load_train_config
from cluster.launchers.base import RunRequest, SubmitError
from cluster.launchers.job_upload import UploadError, project_upload, python_candidates
from cluster.launchers.ray_jobs import (
    JobFailed,
    JobSpec,
    cluster_python,
    driver_lost,
    follow,
    job_client,
    job_spec,
    plugin_specs,
    resubmission,
    submit,
)


@dataclass
class RayJob:
    """A run's current Ray job, the spec it was submitted with, and how often it was
    resubmitted after losing its driver."""

    request: RunRequest
    spec: JobSpec            # the first job's: each resubmission is worded from it
    job_id: str
    resubmits: int = 0


class RayJobLauncher:
    """One Ray job per run (module docstring). The run directories must be on storage the
    submitting machine shares with the cluster wherever it reads them (a sweep's skipping)."""

    def __init__(self, address: str, python: str | None = None, max_resubmits: int = 0,
                 upload_list: str | None = None, env: dict[str, str] | None = None,
                 runtime_env: dict | None = None, runtime_env_source: str = "--runtime-env",
                 job_name: str | None = None):
        """`python`: the cluster's (None: this one's path, else `python`), checked there once
        (`connect`), before any run's files are uploaded; `upload_list`: the files each job
        carries (None: the project's tracked files; job_upload.py); `env`, `runtime_env`,
        `job_name`: `klrl submit`'s options (ray_jobs.job_spec). SubmitError otherwise."""
        self.address, self.max_resubmits = address, max_resubmits
        self.asked_python, self.python = python, None
        self.env, self.runtime_env, self.source = env or {}, runtime_env, runtime_env_source
        self.job_name = job_name
        try:
            self.upload = project_upload(upload_list)
        except UploadError as exc:
            raise SubmitError(str(exc)) from None
        self.client = None

    def connect(self) -> None:
        """Reach the dashboard and check the cluster's Python (once; SubmitError)."""
        if self.client is None:
            self.client = job_client(self.address)
            self.python = cluster_python(self.address, python_candidates(self.asked_python))

    def spec(self, request: RunRequest, cfg=None) -> JobSpec:
        """The job of `request`, built here without the cluster (what `klrl submit --dry-run`
        prints); `cfg`: its TrainConfig when the caller has loaded it (plug-ins to upload)."""
        if cfg is None:
            cfg = load_train_config(request.config, [o for o in request.overrides if "=" in o])
        spec = job_spec(request.config, [*request.overrides, *request.flags],
                        plugins=plugin_specs(cfg),
                        python=self.python or self.asked_python or sys.executable,
                        env=self.env, job_name=self.job_name, runtime_env=self.runtime_env,
                        runtime_env_source=self.source, upload=self.upload)
        return spec.with_python(self.python) if self.python else spec

    def start(self, request: RunRequest, spec: JobSpec | None = None) -> RayJob:
        self.connect()
        spec = (spec or self.spec(request)).with_python(self.python)
        return RayJob(request, spec, submit(request.config, self.address, [], wait=False,
                                            spec=spec))

    def poll(self, job: RayJob) -> int | None:
        from ray.job_submission import JobStatus  # Ray: only once a cluster run is followed

        status = self.client.get_job_status(job.job_id)
        if not status.is_terminal():
            return None
        if status == JobStatus.SUCCEEDED:
            return 0
        return None if self._resubmitted(job, self.client.get_job_info(job.job_id)) else 1

    def follow(self, job: RayJob) -> None:
        """Print the job's logs until it ends, resubmitting it while its driver is lost (the
        rule of `poll`) and following the new one; JobFailed unless the last one SUCCEEDED."""
        while True:
            try:
                follow(job_client(self.address), job.job_id)
                return
            except JobFailed as failed:
                if failed.info is None or not self._resubmitted(job, failed.info):
                    raise

    def stop(self, job: RayJob, signum: int) -> None:
        self.client.stop_job(job.job_id)  # Ray sends SIGTERM (the run checkpoints), then SIGKILL

    def where(self, job: RayJob) -> str:
        return f"logs: ray job logs {job.job_id} --address {self.address}"

    def _resubmitted(self, job: RayJob, info) -> bool:
        """Submit the run again when its job lost its driver and resubmissions are left."""
        why = driver_lost(info)
        if why is None or job.resubmits >= self.max_resubmits:
            return False
        job.resubmits += 1
        print(f"job {job.job_id}: {why}; resubmitting it to continue its run (resubmission "
              f"{job.resubmits}/{self.max_resubmits})", flush=True)
        again = resubmission(job.spec, job.resubmits)  # named from the first job's name
        job.job_id = submit(job.request.config, self.address, [], wait=False, spec=again)
        return True
