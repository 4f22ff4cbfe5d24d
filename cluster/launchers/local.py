"""The local launcher: each run is `python -m cluster.cli train ...`, a child process of this
one with its own local Ray cluster (so one run's crash or leftover actors cannot touch
another's)."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from cluster.launchers.base import RunRequest


class LocalLauncher:
    """Each run a child process writing its output to LOG_DIR/NAME.log (appended to on a
    resume). Children get their own process group, so only the signals passed on (`stop`)
    reach them. No resubmission: a local sweep run again continues its runs."""

    def __init__(self, log_dir: Path):
        self.log_dir = Path(log_dir)

    def start(self, request: RunRequest):
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{request.name}.log"
        cmd = [sys.executable, "-m", "cluster.cli", *request.args()]
        log = open(log_path, "a")  # noqa: SIM115 - closed by poll() when the child exits
        log.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return proc, log, log_path

    def poll(self, handle) -> int | None:
        proc, log, _ = handle
        code = proc.poll()
        if code is not None:
            log.close()
        return code

    def stop(self, handle, signum: int) -> None:
        if handle[0].poll() is None:
            handle[0].send_signal(signum)  # klrl train: first signal checkpoints, second stops now

    def where(self, handle) -> str:
        return f"log: {handle[2]}"
