"""The launchers, one per place a run can start (base.py's protocol): the registry that
`klrl sweep`, `klrl submit` and `klrl slurm` choose from."""
from __future__ import annotations

from typing import Literal, get_args

from cluster.launchers.local import LocalLauncher
from cluster.launchers.ray_job import RayJobLauncher
from cluster.launchers.slurm import SlurmLauncher

LauncherKind = Literal["local", "ray-job", "slurm"]
LAUNCHERS: dict[str, type] = {
    "local": LocalLauncher,      # a child process with its own local Ray (klrl sweep)
    "ray-job": RayJobLauncher,   # a Ray job on a cluster (klrl submit, klrl sweep --address)
    "slurm": SlurmLauncher,      # a SLURM batch job (klrl slurm)
}
if set(LAUNCHERS) != set(get_args(LauncherKind)):  # the table names exactly its Literal's names
    raise AssertionError(f"LAUNCHERS {sorted(LAUNCHERS)} != LauncherKind "
                         f"{sorted(get_args(LauncherKind))}")


def launcher(kind: LauncherKind, **settings):
    """The launcher of `kind`, built with its own settings."""
    if kind not in LAUNCHERS:
        raise ValueError(f"unknown launcher {kind!r}; the launchers are {', '.join(LAUNCHERS)}")
    return LAUNCHERS[kind](**settings)
