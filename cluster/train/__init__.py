"""One training run: its entry point (`run.py`), the controller and what it drives (rollout
worker pool, prompt stream, rollouts -> TrainBatch, Ray start-up), the run directory
(`run_log.py`, its one owner; `checkpoint.py` for checkpoints/), stopping, progress, and the
Ray Jobs client that submits a run to a cluster (`jobs.py`)."""
