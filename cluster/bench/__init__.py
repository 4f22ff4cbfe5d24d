"""`klrl bench`: overheads against the raw engines (`engines.py`), the rollout's cost outside
the engine at a fixed shape (`outside.py`), weight-sync latency (`sync.py`) and end-to-end
overlap (`pipeline.py`), run by `run.py`, on CPU or one CUDA GPU (`gpu.py`), written and
merged part by part (`results.py`) and reported by `report.py`; with `--peer trl`, TRL's
GRPOTrainer beside klrl (`peers.py`, `peer_trl.py`, `peer_record.py`)."""
