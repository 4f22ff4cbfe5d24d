"""Running many runs: a sweep (a grid of training runs, `sweep.py`), running it through a launcher
of cluster/launchers/ (`sweep_run.py`), `make results` (`results.py`: the final evaluations
`final_eval.py`, keeping the runs' records `keep.py`, then the report of cluster/analysis/) and
the mismatch table of a sweep (`mismatch.py`). May import cluster/analysis/, never the reverse."""
