"""Many runs: sweeps (a grid of training runs, `sweep.py`, run by `sweep_run.py` and started by
a launcher of cluster/launchers/), reports (`report.py`, figures in `report_plots.py`) and how
config values become labels (`labels.py`)."""
