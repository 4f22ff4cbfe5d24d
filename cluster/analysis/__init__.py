"""Analysing runs against a pre-registration: reading run directories (`runs.py`), the measures,
arms, statistical tests, gates, dose-response and findings they give, the report (`report.py`,
`report_findings.py`, plots in `report_plots.py` and `dose_plot.py`), its re-reading from a
runs.csv (`recheck.py`) and how config values become labels (`labels.py`). Imports neither
cluster/sweeps/ nor cluster/publish/."""
