"""`klrl bench`: overheads against the raw engines (`engines.py`), weight-sync latency
(`sync.py`) and end-to-end overlap (`pipeline.py`), run and reported by `run.py`; with
`--peer trl`, TRL's GRPOTrainer beside klrl (`peers.py`, `peer_trl.py`, `peer_record.py`)."""
