"""The sbatch script of a klrl job: `SlurmJob` (what `klrl slurm` was asked for, validated) and
`render` (the script's text). The script only states the allocation and hands over to
`python -m cluster.slurm.job` with `exec`, so that the process SLURM signals as the batch
shell (`--signal=B:...`) is the launcher itself."""
from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# The signal SLURM sends the batch shell `signal_lead_s` before the time limit; the launcher
# turns it into a checkpoint and a requeue (cluster/slurm/job.py).
LEAD_SIGNAL = "USR1"
# SLURM's time formats (sbatch --time): M, M:S, H:M:S, D-H, D-H:M, D-H:M:S, or UNLIMITED.
_TIME = re.compile(r"^(\d+(:\d{1,2}){0,2}|\d+-\d+(:\d{1,2}){0,2}|UNLIMITED|INFINITE)$")


class SlurmJob(BaseModel):
    """One klrl job on SLURM: the allocation (nodes, GPUs and CPUs per node, partition, time
    limit, extra sbatch options), the klrl command it runs (`train` a config, or `sweep` a sweep
    file, with overrides), and where its script and output go. Paths are absolute: the job runs
    them from the directory it was submitted in, on whichever nodes it gets."""

    model_config = ConfigDict(extra="forbid")

    command: Literal["train", "sweep"] = Field(description="`klrl train` or `klrl sweep`.")
    config: Path = Field(description="The config (train) or sweep file, absolute.")
    overrides: list[str] = Field(default_factory=list, description="key=value overrides; with "
                                 "train they include run_name, fixed at submission so that a "
                                 "requeued job finds its run.")
    name: str = Field(min_length=1, max_length=200, description="The run's (or sweep's) name: "
                      "the job name is klrl-NAME, its script and output are named by it.")
    workdir: Path = Field(description="The directory the job runs in (where it was submitted).")
    slurm_dir: Path = Field(description="Where the script and the job's output file go.")
    python: str = Field(min_length=1, description="The Python, with klrl's dependencies, that "
                        "runs the launcher on the nodes (the same path on each).")
    nodes: int = Field(1, ge=1, le=10_000, description="Nodes: Ray's head on the first, a Ray "
                       "node on each other one.")
    gpus_per_node: int = Field(0, ge=0, le=64, description="GPUs per node (--gpus-per-node), "
                               "given to Ray as the node's GPUs.")
    cpus_per_node: int | None = Field(None, ge=1, le=100_000, description="CPUs per node "
                                      "(--cpus-per-task of the node's one task), given to Ray "
                                      "as the node's CPUs. null: what SLURM allocates.")
    partition: str | None = Field(None, min_length=1, description="--partition.")
    time: str | None = Field(None, description="--time, the time limit (e.g. 4:00:00, 2-00:00:00).")
    signal_lead_s: int = Field(300, ge=0, le=65_535, description="Seconds before the time limit "
                               f"at which SLURM sends the launcher SIG{LEAD_SIGNAL} (--signal="
                               f"B:{LEAD_SIGNAL}@N): the run checkpoints and the job requeues "
                               "itself. It must cover a step and a checkpoint. 0: no signal.")
    sbatch_args: list[str] = Field(default_factory=list, description="More sbatch options, "
                                   "each one `--key=value` (e.g. --account=proj, --qos=low).")
    ray_start_args: list[str] = Field(default_factory=list, description="More `ray start` "
                                      "options for every node, each one `--key=value` (e.g. "
                                      "--object-store-memory=N).")

    @field_validator("time")
    @classmethod
    def _slurm_time(cls, value: str | None) -> str | None:
        if value is not None and not _TIME.match(value):
            raise ValueError(f"{value!r} is not a SLURM time (minutes, HH:MM:SS or D-HH:MM:SS)")
        return value

    @field_validator("sbatch_args", "ray_start_args")
    @classmethod
    def _options(cls, value: list[str]) -> list[str]:
        for arg in value:
            if not arg.startswith("--") or "\n" in arg:
                raise ValueError(f"{arg!r}: give each option as --key=value")
        return value

    @property
    def script_path(self) -> Path:
        return self.slurm_dir / f"{self.name}.sbatch"

    @property
    def output_pattern(self) -> Path:
        """The job's output file (`%j`: the job id; each requeued attempt appends to it)."""
        return self.slurm_dir / f"{self.name}-%j.out"

    def output_file(self, job_id: str) -> Path:
        return self.slurm_dir / f"{self.name}-{job_id}.out"


def render(job: SlurmJob) -> str:
    """The sbatch script: #SBATCH lines for the allocation, then `exec` the launcher."""
    lines = [f"--job-name=klrl-{job.name}", f"--nodes={job.nodes}", "--ntasks-per-node=1",
             f"--output={job.output_pattern}", "--open-mode=append", "--requeue"]
    if job.gpus_per_node:
        lines.append(f"--gpus-per-node={job.gpus_per_node}")
    if job.cpus_per_node:
        lines.append(f"--cpus-per-task={job.cpus_per_node}")
    if job.partition:
        lines.append(f"--partition={job.partition}")
    if job.time:
        lines.append(f"--time={job.time}")
    if job.signal_lead_s:
        lines.append(f"--signal=B:{LEAD_SIGNAL}@{job.signal_lead_s}")
    lines += job.sbatch_args
    launcher = [job.python, "-m", "cluster.slurm.job", f"--gpus-per-node={job.gpus_per_node}",
                *(f"--ray-start-arg={a}" for a in job.ray_start_args),
                "--", job.command, str(job.config), *job.overrides]
    repo = Path(__file__).resolve().parents[2]
    return "\n".join([
        "#!/bin/bash",
        f"# Written by `klrl slurm` for {job.name}; submit it again with `sbatch "
        f"{job.script_path}`.",
        *(f"#SBATCH {shlex.quote(line)}" for line in lines),
        "set -e",
        f"cd {shlex.quote(str(job.workdir))}",
        f"export PYTHONPATH={shlex.quote(str(repo))}${{PYTHONPATH:+:$PYTHONPATH}}",
        "# exec: the launcher is the batch shell, so SLURM's signals reach it directly",
        "exec " + shlex.join(launcher),
        "",
    ])
