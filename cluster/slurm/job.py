"""The launcher inside a klrl SLURM job (`python -m cluster.slurm.job [options] -- train|sweep
FILE [overrides]`, exec'd by the script `klrl slurm` writes; it is the batch shell).

1. Ray's head on this node (the job's first), a Ray node on each other node (one srun task
   each, `cluster/slurm/node.py`), all with SIGTERM blocked and the job's own auth token.
2. The driver against that cluster (RAY_ADDRESS): `klrl train FILE ...`, with `--resume` or
   not, or nothing at all, as the continuation rule says (cluster/train/continuation.py: a
   requeued job continues its run, nobody types the flag); or `klrl sweep FILE ...`, which
   asks the same rule for each of its runs.
3. Signals. SIGTERM (a requeue, a preemption, scancel, the time limit), SIGINT, and the lead
   signal (`--signal=B:USR1@N`, N seconds before the time limit) all stop the driver once,
   with SIGINT: it finishes its step, checkpoints and exits. The driver's SIGTERM is blocked,
   so the SIGTERM SLURM sends every process of the job does not reach it as a second signal
   (which would stop it at once, without a checkpoint). A node whose srun task was signalled
   (a preemption signals the steps first) says so on its output, which stops the run too.
   After the lead signal the launcher requeues the job itself (`scontrol requeue`): at the
   time limit SLURM would not. A requeue, a preemption with PreemptMode=REQUEUE, or a node
   failure requeue it without help.
4. The Ray processes are killed once the driver has exited; the exit code is the driver's.
"""
from __future__ import annotations

import argparse
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

from cluster.config.loader import ConfigError
from cluster.config.train_config import load_train_config
from cluster.slurm import node as ray_node
from cluster.slurm.script import LEAD_SIGNAL

RAY_START_TIMEOUT_S = 600


def say(text: str) -> None:
    print(f"klrl slurm: {text}", flush=True)


def hostnames(nodelist: str) -> list[str]:
    """SLURM_JOB_NODELIST expanded (`scontrol show hostnames`), the first being this node."""
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    return out.split()


def driver_command(python: str, command: str, config: str,
                   overrides: list[str]) -> list[str] | None:
    """The klrl command of this attempt. `train`: as the continuation rule says, so that a
    requeued job continues its run: with --resume or without; None when there is nothing to
    do (a job requeued after its run's end); ConfigError when the rule refuses (a run recorded
    with other settings, a damaged checkpoint: its reason names the fix)."""
    args = [python, "-m", "cluster.cli.main", command, config, *overrides]
    if command != "train":
        return args  # a sweep asks the rule for each of its runs
    from cluster.train.continuation import Action, continuation_of

    verdict = continuation_of(load_train_config(config, overrides))
    if verdict.action is Action.REFUSE:
        raise ConfigError(verdict.reason)
    if verdict.action is not Action.START:
        say(verdict.reason)
    return [*args, *verdict.train_flags] if verdict.runs else None


class Stop:
    """The first stopping signal (or a node's word) stops the driver once, with SIGINT."""

    def __init__(self):
        self.reason: str | None = None
        self.requeue = False
        self.driver: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def request(self, reason: str, requeue: bool = False) -> None:
        with self._lock:
            if self.reason is not None:
                return
            self.reason, self.requeue = reason, requeue
            driver = self.driver
        say(f"{reason}: stopping the run with a checkpoint"
            + (", then requeueing the job" if requeue else ""))
        if driver is not None and driver.poll() is None:
            driver.send_signal(signal.SIGINT)

    def handle(self, signum, _frame) -> None:
        name = signal.Signals(signum).name
        self.request(name, requeue=name == f"SIG{LEAD_SIGNAL}")


def _follow(proc: subprocess.Popen, host: str, stop: Stop, started: threading.Event) -> None:
    """Print a node's srun output; its start and its signal are lines of it."""
    for line in proc.stdout:
        print(f"[{host}] {line}", end="", flush=True)
        if line.startswith(ray_node.STARTED):
            started.set()
        elif line.startswith(ray_node.STOP_LINE):
            stop.request(f"node {host} was signalled")


class JobRay:
    """The job's Ray cluster: the head here, a node on each other host; `stop` kills them all."""

    def __init__(self, hosts: list[str], temp_dir: Path, gpus: int, extra: list[str]):
        self.hosts, self.temp_dir, self.gpus, self.extra = hosts, temp_dir, gpus, extra
        self.head: subprocess.Popen | None = None
        self.nodes: list[subprocess.Popen] = []
        self.address = ""

    def start(self, stop: Stop) -> None:
        import ray  # the node's address as Ray sees it: where the other nodes reach the head

        ip = ray.util.get_node_ip_address()
        port = ray_node.free_port()
        self.address = f"{ip}:{port}"
        log = self.temp_dir / "head.log"
        cpus = int(os.environ.get("SLURM_CPUS_ON_NODE") or os.cpu_count() or 1)
        self.head = ray_node.ray_start(ray_node.ray_command(
            ["--head", f"--port={port}", f"--node-ip-address={ip}", "--include-dashboard=false",
             f"--ray-client-server-port={ray_node.free_port()}",
             f"--dashboard-port={ray_node.free_port()}"],  # its job API runs even so
            cpus, self.gpus, {"head": 1}, self.temp_dir, self.extra), log)
        ray_node.wait_started(self.head, log, RAY_START_TIMEOUT_S)
        say(f"Ray head at {self.address} ({cpus} CPUs, {self.gpus} GPUs)")
        started = []
        for host in self.hosts[1:]:
            proc = subprocess.Popen(
                ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={host}", sys.executable, "-m",
                 "cluster.slurm.node", f"--address={self.address}", f"--num-gpus={self.gpus}",
                 f"--temp-dir={self.temp_dir}", *(f"--ray-start-arg={a}" for a in self.extra)],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                preexec_fn=ray_node.block_sigterm)
            self.nodes.append(proc)
            event = threading.Event()
            threading.Thread(target=_follow, args=(proc, host, stop, event), daemon=True).start()
            started.append((host, proc, event))
        for host, proc, event in started:
            if not event.wait(RAY_START_TIMEOUT_S) or proc.poll() is not None:
                raise RuntimeError(f"the Ray node on {host} did not start (its output is above)")
        if started:
            say(f"{len(started)} more Ray node(s) joined")

    def stop(self) -> None:
        for proc in self.nodes:
            if proc.poll() is None:
                proc.kill()  # the srun client; SLURM ends the step with the job
        if self.head is not None:
            ray_node.stop(self.head)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cluster.slurm.job")
    p.add_argument("--gpus-per-node", type=int, default=0)
    p.add_argument("--ray-start-arg", action="append", default=[],
                   help="passed to every `ray start` (e.g. --object-store-memory=N)")
    p.add_argument("command", choices=["train", "sweep"])
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)

    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        print("error: python -m cluster.slurm.job runs inside a SLURM job (`klrl slurm` submits "
              "one); SLURM_JOB_ID is not set", file=sys.stderr)
        return 2
    stop = Stop()
    for signum in (signal.SIGTERM, signal.SIGINT, getattr(signal, f"SIG{LEAD_SIGNAL}")):
        signal.signal(signum, stop.handle)
    restarts = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    hosts = hostnames(os.environ.get("SLURM_JOB_NODELIST") or os.uname().nodename)
    say(f"job {job_id}, attempt {restarts + 1} (SLURM_RESTART_COUNT={restarts}), "
        f"nodes {', '.join(hosts)}")
    try:
        command = driver_command(sys.executable, args.command, args.config, args.overrides)
    except ConfigError as exc:  # refused before Ray starts: nothing to requeue
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    if command is None:
        return 0
    # The job's Ray cluster admits only holders of this token (srun passes the environment on).
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ.pop("RAY_ADDRESS", None)
    cluster = JobRay(hosts, Path(f"/tmp/klrl-job-{job_id}-{restarts}"),  # short: socket paths
                     args.gpus_per_node, args.ray_start_arg)
    try:
        cluster.start(stop)
        code = _drive(command, cluster.address, stop)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        code = 1
    finally:
        cluster.stop()
    if stop.requeue and code != 0:
        subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=False)
        say(f"requeued job {job_id}: its next attempt resumes the run")
    return code


def _drive(command: list[str], address: str, stop: Stop) -> int:
    """Run the driver to its end (SIGTERM blocked in it: module docstring); its exit code."""
    if stop.reason is not None:  # signalled while Ray started: nothing to checkpoint yet
        return 128 + signal.SIGINT
    say("running: klrl " + shlex.join(command[3:]))
    driver = subprocess.Popen(command, env=dict(os.environ, RAY_ADDRESS=address),
                              preexec_fn=ray_node.block_sigterm)
    stop.driver = driver
    if stop.reason is not None:  # a signal between the check above and here
        driver.send_signal(signal.SIGINT)
    code = driver.wait()
    say(f"klrl {command[3]} exited with {code}")
    return code


if __name__ == "__main__":
    sys.exit(main())
