"""The SLURM launcher: one batch job per request (`klrl slurm`), its script written by
cluster/slurm/script.py and run on the allocation by cluster/slurm/job.py, which asks the
continuation rule at each attempt (a requeued or preempted job resumes its run by itself: the
scheduler resubmits, not this launcher). Talks to SLURM through its commands (sbatch, sacct,
scancel), which a login node has."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from cluster.launchers.base import RunRequest, SubmitError
from cluster.slurm.script import SlurmJob, render

# sacct's job states that are over, and the exit code each gives (COMPLETED: the job's own).
_FAILED_STATES = ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                  "DEADLINE", "PREEMPTED")


class SlurmLauncher:
    """Submits each request as a SLURM job on the allocation `settings` describe (SlurmJob's
    fields other than the command, config, overrides and name)."""

    def __init__(self, **settings):
        self.settings = settings

    def job(self, request: RunRequest) -> SlurmJob:
        """The job of `request`, validated (pydantic's ValidationError names the field)."""
        return SlurmJob(command=request.command, config=Path(request.config),
                        overrides=[*request.overrides, *request.flags], name=request.name,
                        **self.settings)

    def start(self, request: RunRequest) -> tuple[str, SlurmJob]:
        """Write the job's script and submit it with sbatch; (job id, job). SubmitError when
        sbatch refuses: nothing is left behind (the script, the directories made for it)."""
        job = self.job(request)
        if shutil.which("sbatch") is None:
            raise SubmitError("sbatch not found: run `klrl slurm` on a machine of the SLURM "
                              "cluster (a login node); --dry-run prints the script without "
                              "submitting it")
        missing = [d for d in (job.slurm_dir, *job.slurm_dir.parents) if not d.exists()]
        job.slurm_dir.mkdir(parents=True, exist_ok=True)
        job.script_path.write_text(render(job))
        done = subprocess.run(["sbatch", "--parsable", str(job.script_path)], capture_output=True,
                              text=True, env=os.environ)
        if done.returncode != 0:  # a job SLURM will not take (a partition, an account)
            job.script_path.unlink(missing_ok=True)
            if missing:  # the directories made for it, from the outermost
                shutil.rmtree(missing[-1], ignore_errors=True)
            why = " ".join(done.stderr.split()) or f"exit {done.returncode}"
            raise SubmitError(f"sbatch refused the job ({why}); nothing was submitted (--dry-run "
                              "prints the script)")
        return done.stdout.strip().split(";")[0], job

    def poll(self, handle: tuple[str, SlurmJob]) -> int | None:
        """The job's exit code once SLURM says it is over (sacct), else None (pending,
        running, requeued)."""
        out = subprocess.run(["sacct", "-j", handle[0], "-X", "-n", "-P", "-o", "State,ExitCode"],
                             capture_output=True, text=True, check=False).stdout.splitlines()
        if not out or not out[0].strip():
            return None
        state, _, code = out[0].strip().partition("|")  # e.g. `CANCELLED by 0|0:15`
        state = state.split()[0]
        if state == "COMPLETED":
            return int(code.split(":")[0] or 0)
        return 1 if state.startswith(_FAILED_STATES) else None

    def stop(self, handle: tuple[str, SlurmJob], signum: int) -> None:
        # the launcher inside the job turns it into one clean stop (cluster/slurm/job.py)
        subprocess.run(["scancel", "--batch", f"--signal={signum}", handle[0]], check=False)

    def where(self, handle: tuple[str, SlurmJob]) -> str:
        return f"output: {handle[1].output_file(handle[0])}"
