"""Where runs start: one protocol (`base.py`: start, poll, stop, where, and the `RunRequest`
they start) and one registry (`registry.py`) of launchers: a local process (`local.py`), a Ray
job (`ray_job.py`, with the Ray Jobs client `ray_jobs.py` and the files a job carries,
`job_upload.py`) and a SLURM job (`slurm.py`). Whether a run starts, resumes, is skipped or
refused is the continuation rule's (cluster/train/continuation.py), never a launcher's."""
