"""A replaced rollout worker's engine starts only once the killed worker's process is gone
(cluster/train/worker_pool.py): on a GPU the old engine's memory would otherwise still be
held when vLLM checks and profiles the free memory. The wait itself, on a process of this
machine; tests/test_faults.py replaces real workers."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

from cluster.train.worker_pool import _poll_gone, process_gone


def test_the_wait_ends_when_the_killed_process_has_exited_and_not_before():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not process_gone(proc.pid)
        t0 = time.monotonic()
        assert not _poll_gone(proc.pid, 0.3)  # still there: the wait gives up, says so
        assert time.monotonic() - t0 >= 0.3
        proc.send_signal(signal.SIGKILL)
        assert _poll_gone(proc.pid, 10)  # exited, not yet reaped: a zombie counts as gone
        assert process_gone(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert process_gone(proc.pid)
