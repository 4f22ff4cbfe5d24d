"""Publishing: the docs' figures (`figures.py`), a report as a wandb summary run (`dashboard.py`)
and a sweep's wandb workspace (`workspace.py`). May import cluster/analysis/."""
