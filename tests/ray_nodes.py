"""Real Ray nodes for tests, as a user starts them: `ray start --head --block` (and `ray start
--address=HEAD --block` for more nodes) on loopback, each on free ports with its own temp dir.

Each node is exactly one subprocess tree, started in a session of its own and stopped by
terminating that process (SIGTERM makes `ray start --block` drain and stop its raylet, GCS
and dashboard), then killing what is left of its process group. Never `ray stop`: it stops
every Ray process on the machine, other users' clusters included.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RayNode:
    """One `ray start --block` process; `address` is the GCS address (head only)."""

    def __init__(self, args: list[str], temp_dir: Path, log: Path, address: str | None = None,
                 dashboard: str | None = None):
        self.temp_dir, self.log, self.address, self.dashboard = temp_dir, log, address, dashboard
        # The job drivers and actors use the python beside this one (PATH), and import klrl.
        env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}",
                   PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH"))
                                              if p))
        env.pop("RAY_ADDRESS", None)
        # Ray 2.60 turns token auth on for a new head (with ~/.ray/auth_token, written if
        # missing); a joining node uses it only when told to.
        env["RAY_AUTH_MODE"] = "token"
        self.proc = subprocess.Popen([str(BIN / "ray"), "start", "--block", *args], env=env,
                                     stdout=log.open("w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_started(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while "Ray runtime started" not in self.log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"ray start failed:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        """Terminate this node's process tree (and only it)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        try:  # anything of its session left behind (a worker that ignored the drain)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        deadline = time.monotonic() + 10
        while self.pids_left() and time.monotonic() < deadline:  # killed ones still exiting
            time.sleep(0.2)

    def pids_left(self) -> list[str]:
        """Processes still alive in this node's session, or still using its temp dir (a
        raylet, GCS or worker that left the session); the tests assert none."""
        out = subprocess.run(["ps", "-eo", "pid=,sid=,stat=,args="], check=False,
                             capture_output=True, text=True).stdout
        return [line.strip() for line in out.splitlines()
                if (line.split()[1] == str(self.proc.pid) or str(self.temp_dir) in line)
                and not line.split()[2].startswith("Z")]


def _common(num_cpus: int, resources: dict | None, temp_dir: Path) -> list[str]:
    args = [f"--num-cpus={num_cpus}", "--num-gpus=0", "--node-ip-address=127.0.0.1",
            f"--temp-dir={temp_dir}", "--object-store-memory=200000000",
            f"--dashboard-agent-listen-port={free_port()}", "--disable-usage-stats"]
    if resources:
        args.append(f"--resources={json.dumps(resources)}")
    return args


def short_temp_dir() -> Path:
    """A temp dir with a short path: Ray's unix sockets live under it (session_*/sockets/...),
    and a socket path may not exceed 107 bytes, which pytest's deep tmp_path can."""
    return Path(tempfile.mkdtemp(prefix="klrl-ray-", dir="/tmp"))


# How Ray's components say a port was taken (ray start's checks, the GCS's and raylet's bind).
_PORT_TAKEN = ("already in use", "already occupied", "eaddrinuse", "address in use")


def _with_fresh_ports(start, attempts: int = 3) -> RayNode:
    """`start()` again, with newly chosen ports, when Ray failed because one was taken: a
    port chosen free here is bound later by `ray start`, and on a busy machine (CI's two
    pytest workers, their Ray clusters and vLLM) another process can take it in between."""
    for _ in range(attempts - 1):
        try:
            return start()
        except RuntimeError as exc:
            if not any(m in str(exc).lower() for m in _PORT_TAKEN):
                raise
    return start()


def start_head(temp_dir: Path, num_cpus: int, resources: dict | None = None,
               dashboard: bool = False) -> RayNode:
    return _with_fresh_ports(lambda: _start_head(temp_dir, num_cpus, resources, dashboard))


def _start_head(temp_dir: Path, num_cpus: int, resources: dict | None, dashboard: bool) -> RayNode:
    port = free_port()
    args = ["--head", f"--port={port}", f"--ray-client-server-port={free_port()}",
            *_common(num_cpus, resources, temp_dir)]
    url = None
    if dashboard:
        dash = free_port()
        args += ["--include-dashboard=true", "--dashboard-host=127.0.0.1",
                 f"--dashboard-port={dash}"]
        url = f"http://127.0.0.1:{dash}"
    else:
        args.append("--include-dashboard=false")
    node = RayNode(args, temp_dir, temp_dir / "head.log", address=f"127.0.0.1:{port}",
                   dashboard=url)
    node.wait_started()
    return node


def start_worker(head: RayNode, num_cpus: int, resources: dict | None = None) -> RayNode:
    temp_dir = head.temp_dir / "node2"
    temp_dir.mkdir(exist_ok=True)
    return _with_fresh_ports(lambda: _start_worker(head, num_cpus, resources, temp_dir))


def _start_worker(head: RayNode, num_cpus: int, resources: dict | None, temp_dir: Path) -> RayNode:
    node = RayNode([f"--address={head.address}", *_common(num_cpus, resources, temp_dir)],
                   temp_dir, temp_dir.parent / "node2.log")
    node.wait_started()
    return node


def remove(temp_dir: Path) -> None:
    shutil.rmtree(temp_dir, ignore_errors=True)
