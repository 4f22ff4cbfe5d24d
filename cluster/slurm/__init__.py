"""klrl on SLURM: `klrl slurm` writes and submits an sbatch script (`script.py`) whose job runs
`python -m cluster.slurm.job` (`job.py`): Ray's head on the job's first node, a Ray node on every
other one (`node.py`, through srun), then `klrl train` (or `klrl sweep`) against that cluster,
with the scheduler's signals turned into one clean stop and a requeued job resuming by itself.
No SLURM library is imported: the job talks to SLURM through its environment variables and
its commands (`scontrol`, `srun`), which the nodes of a SLURM cluster have."""
