"""`klrl bench`: overheads against the raw engines (`engines.py`), weight-sync latency
(`sync.py`) and end-to-end overlap (`pipeline.py`), run and reported by `run.py`."""
