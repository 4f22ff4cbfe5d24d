"""One Ray process tree that SLURM's signals cannot stop before the run has checkpointed:
`ray_start(...)` for the head (in the batch step) and `python -m cluster.slurm.node ...` for
every other node (one srun task each).

Why: when SLURM requeues, preempts, cancels or times out a job it sends SIGTERM to every
process of the job (proctrack/linuxproc or cgroup alike), and Ray's raylet, GCS and actors exit
on it, so the run's learner would be gone before it could write its checkpoint. So each Ray
process starts with SIGTERM blocked (a signal mask is inherited by every child and kept across
exec; Ray's own handlers do not unblock it): a SIGTERM to them stays pending, and they end when
the launcher kills them after the run stopped, or at SLURM's SIGKILL (KillWait later). The
srun task itself (`main`) keeps SIGTERM: on it, it prints `STOP_LINE` (srun carries the line to
the launcher on the first node, which stops the run) and stays up, so that its step, and with
it the node's Ray, lives until the launcher ends the job.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

STARTED = "Ray runtime started"  # what `ray start` prints once the node is up
STOP_LINE = "klrl-slurm-node: SIGTERM"  # a node's srun task says it was signalled


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def ray_command(ray_args: list[str], num_cpus: int, num_gpus: int, resources: dict,
                temp_dir: Path, extra: list[str]) -> list[str]:
    """`ray start --block ...` with this job's own temp dir and free ports for what would
    otherwise take a fixed one (so that two jobs on one node do not collide)."""
    ray = Path(sys.executable).parent / "ray"
    return [str(ray) if ray.exists() else "ray", "start", "--block", *ray_args,
            f"--num-cpus={num_cpus}", f"--num-gpus={num_gpus}",
            f"--resources={json.dumps(resources)}", f"--temp-dir={temp_dir}",
            f"--dashboard-agent-listen-port={free_port()}", "--disable-usage-stats", *extra]


def block_sigterm() -> None:
    """preexec_fn of a Ray process tree: SIGTERM blocked from exec on (module docstring)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})


def ray_start(command: list[str], log: Path) -> subprocess.Popen:
    """Start `command` (a `ray start --block`) in a session of its own, SIGTERM blocked, its
    output to `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(command, stdout=log.open("ab"), stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=block_sigterm)


def wait_started(proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    """Until `ray start` says the node is up; RuntimeError (with the log's tail) otherwise."""
    deadline = time.monotonic() + timeout_s
    while STARTED not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            why = "exited" if proc.poll() is not None else f"did not start in {timeout_s:.0f} s"
            raise RuntimeError(f"ray start {why}:\n{log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.5)


def stop(proc: subprocess.Popen) -> None:
    """Kill the Ray process tree started by `ray_start` (its session: SIGTERM is blocked there,
    and nothing of it must outlive the job's run)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def main(argv: list[str] | None = None) -> int:
    """A Ray node joining `--address`, as one srun task on its node (module docstring)."""
    p = argparse.ArgumentParser(prog="python -m cluster.slurm.node")
    p.add_argument("--address", required=True, help="the head's GCS address, host:port")
    p.add_argument("--num-gpus", type=int, default=0)
    p.add_argument("--temp-dir", required=True)
    p.add_argument("--ray-start-arg", action="append", default=[])
    args = p.parse_args(argv)
    cpus = int(os.environ.get("SLURM_CPUS_ON_NODE") or os.cpu_count() or 1)
    temp_dir = Path(args.temp_dir)
    log = temp_dir / "node.log"
    proc = ray_start(ray_command([f"--address={args.address}"], cpus, args.num_gpus,
                                 {"worker_node": 1}, temp_dir, args.ray_start_arg), log)
    signalled = []
    signal.signal(signal.SIGTERM, lambda *_: signalled.append(True))
    try:
        wait_started(proc, log, timeout_s=600)
        print(f"{STARTED} on {socket.gethostname()}", flush=True)
        while proc.poll() is None:
            if signalled and signalled.pop():
                print(STOP_LINE, flush=True)
            time.sleep(0.5)
        print(f"ray on {socket.gethostname()} ended:\n{log.read_text(errors='replace')[-2000:]}",
              flush=True)
        return 1
    finally:
        stop(proc)


if __name__ == "__main__":
    sys.exit(main())
