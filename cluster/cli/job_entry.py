"""The entrypoint of a Ray job whose config file lay outside the repository on the submitting
machine (cluster/launchers/ray_jobs.py, job_spec): `python -m cluster.cli.job_entry NAME [args ...]`
writes the config's YAML, sent in the environment variable KLRL_JOB_CONFIG, to NAME in a
temporary directory and runs `klrl train` on it with the same arguments. The run directory
keeps its own copy (config.yaml), so the temporary file goes when the run ends."""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from cluster.cli.main import main
from cluster.launchers.ray_jobs import CONFIG_ENV


def run(argv: list[str]) -> int:
    text = os.environ.get(CONFIG_ENV)
    if text is None or not argv:
        print(f"error: python -m cluster.cli.job_entry NAME [overrides] runs a config sent in "
              f"{CONFIG_ENV} by `klrl submit`; it is not set here", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="klrl-job-") as tmp:
        path = Path(tmp) / Path(argv[0]).name
        path.write_text(text)
        return main(["train", str(path), *argv[1:]])


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
