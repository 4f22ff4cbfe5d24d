"""The Ray Jobs client: a training run submitted to a Ray cluster (`klrl submit`, and one job
per run of `klrl sweep --address`).

A job runs `python -m cluster.cli train ...` on the head node with this repository uploaded as
its working directory, so the cluster's Python needs klrl's dependencies (not klrl itself).
Ray is imported inside the functions: `klrl --help` and local sweeps must not pay for it.
"""
from __future__ import annotations

import asyncio
import os
import shlex
from pathlib import Path

from cluster.config.loader import REPO_ROOT

# Never uploaded with the repository: environments, run outputs, caches.
EXCLUDES = [".venv", "runs", ".git", "**/__pycache__", "wandb", ".pytest_cache"]


def job_client(address: str):
    """A `JobSubmissionClient` for the dashboard at `address`, with the cluster's token."""
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(address, headers=auth_headers())


def auth_headers() -> dict:
    """Bearer token for a token-auth cluster (`ray start --head` writes ~/.ray/auth_token):
    RAY_AUTH_TOKEN, else the file at RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token. Sent explicitly
    because Ray's client decides whether to attach it from process-wide state read once,
    before a token may exist; so RAY_AUTH_MODE=token is not needed here."""
    token = os.environ.get("RAY_AUTH_TOKEN")
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    if not token and path.is_file():
        token = path.read_text().strip()
    return {"Authorization": f"Bearer {token}"} if token else {}


def submit(config: str, address: str, overrides: list[str], wait: bool = True,
           python: str = "python") -> str:
    """Submit `klrl train CONFIG overrides` as a Ray job with this repository as working_dir;
    with `wait`, follow its logs and raise RuntimeError unless it succeeds. Returns the job id."""
    from ray.job_submission import JobStatus

    client = job_client(address)
    rel = Path(config).resolve().relative_to(REPO_ROOT)
    entrypoint = " ".join([shlex.quote(python), "-m cluster.cli train", shlex.quote(str(rel)),
                           *map(shlex.quote, overrides)])
    job_id = client.submit_job(entrypoint=entrypoint, runtime_env={
        "working_dir": str(REPO_ROOT), "excludes": EXCLUDES})
    print(f"submitted {job_id}: {entrypoint}")
    if wait:
        for chunk in _tail(client, job_id):
            print(chunk, end="")
        status = client.get_job_status(job_id)
        print(f"job {job_id}: {status}")
        if status != JobStatus.SUCCEEDED:
            raise RuntimeError(f"job {job_id} ended {status}")
    return job_id


def _tail(client, job_id):
    """The job's log lines as they come (the client's async iterator, driven here)."""
    async def collect():
        async for lines in client.tail_job_logs(job_id):
            yield lines

    agen = collect()
    loop = asyncio.new_event_loop()
    try:
        while True:
            try:
                yield loop.run_until_complete(agen.__anext__())
            except StopAsyncIteration:
                return
    finally:
        loop.close()
