"""A real one-node SLURM cluster on loopback for the tests: Debian's munge, slurmctld and slurmd
(`slurm-client` for sbatch/scontrol/squeue), each started by the test with its own munge key
and socket, its own slurm.conf (`SLURM_CONF`), state, spool, log and pid files in one temp
directory and ports chosen free, so that nothing of the machine's own configuration is read or
changed. Stopped by the pids in its pid files (never by name: other users' daemons may run).

`unavailable()` says why this machine cannot run one (the reason a test skips with): the
daemons need root (slurmd runs jobs as their submitter, munged and slurmctld check file
owners) and the Debian packages (`make test` installs them where it runs as root with apt;
`make slurm-packages`).
"""
from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

PACKAGES = "slurmctld slurmd slurm-client munge"
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue")


def _which(name: str) -> str | None:
    # slurmctld, slurmd and munged live in /usr/sbin, which a non-login PATH may lack.
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin")


def unavailable() -> str | None:
    """Why no SLURM cluster can be started here, or None when one can."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "SLURM runs on Linux only"
    missing = [d for d in DAEMONS if _which(d) is None]
    if missing:
        return (f"SLURM is not installed ({', '.join(missing)} missing): `apt-get install "
                f"{PACKAGES}` as root, which `make test` does where it runs as root with apt")
    if os.geteuid() != 0:
        return ("starting slurmctld, slurmd and munged needs root (slurmd starts jobs as their "
                "submitter); `make test` as root runs this test")
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return "the munge user is missing (the munge package creates it)"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(what: str, ready, timeout: float, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
            raise RuntimeError(f"{what} did not come up within {timeout:.0f} s\n{tail}")
        time.sleep(0.2)


class SlurmCluster:
    """munged + slurmctld + slurmd for one node named after this host, partition `debug`.
    `env` is the environment the SLURM client commands (and the jobs) need: SLURM_CONF."""

    def __init__(self, cpus: int, kill_wait_s: int = 120):
        self.dir = Path(tempfile.mkdtemp(prefix="klrl-slurm-", dir="/tmp"))  # short socket path
        self.host = socket.gethostname().split(".")[0]
        self.cpus, self.kill_wait_s = cpus, kill_wait_s
        self.conf = self.dir / "slurm.conf"
        self.munge_socket = self.dir / "munge.socket"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self._started: list[Path] = []  # pid files, in start order

    def start(self) -> SlurmCluster:
        try:
            self._start_munge()
            self._write_conf()
            for daemon in ("slurmctld", "slurmd"):
                self._start(daemon)
            _wait("the node", self._node_idle, 60, self.dir / "slurmctld.log")
        except BaseException:
            self.stop()
            raise
        return self

    def _start_munge(self) -> None:
        key = self.dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        munge = pwd.getpwnam("munge")
        os.chown(key, munge.pw_uid, munge.pw_gid)
        key.chmod(0o400)
        pid = self.dir / "munged.pid"
        subprocess.run([_which("munged"), "--force", f"--socket={self.munge_socket}",
                        f"--key-file={key}", f"--pid-file={pid}",
                        f"--log-file={self.dir / 'munged.log'}",
                        f"--seed-file={self.dir / 'munged.seed'}"],
                       check=True, capture_output=True, timeout=30)
        self._started.append(pid)
        _wait("munged", self.munge_socket.exists, 30, self.dir / "munged.log")

    def _write_conf(self) -> None:
        d = self.dir
        for sub in ("state", "spool"):
            (d / sub).mkdir()
        self.conf.write_text(f"""\
ClusterName=klrltest
SlurmctldHost={self.host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
JobRequeue=1
KillWait={self.kill_wait_s}
StateSaveLocation={d / 'state'}
SlurmdSpoolDir={d / 'spool'}
SlurmctldPidFile={d / 'slurmctld.pid'}
SlurmdPidFile={d / 'slurmd.pid'}
SlurmctldLogFile={d / 'slurmctld.log'}
SlurmdLogFile={d / 'slurmd.log'}
NodeName={self.host} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN
PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP
""")

    def _start(self, daemon: str) -> None:
        pid = self.dir / f"{daemon}.pid"
        args = [_which(daemon)] + (["-i"] if daemon == "slurmctld" else [])  # -i: no old state
        subprocess.run(args, env=self.env, check=True, capture_output=True, timeout=60)
        self._started.append(pid)
        _wait(daemon, pid.exists, 30, self.dir / f"{daemon}.log")

    def _node_idle(self) -> bool:
        out = self.run("sinfo", "-h", "-o", "%t", check=False).stdout.strip()
        return out.startswith("idle")

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """A SLURM client command against this cluster."""
        return subprocess.run(list(args), env=self.env, check=check, capture_output=True,
                              text=True, timeout=60)

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, Reason, ...)."""
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return dict(f.split("=", 1) for f in out.split() if "=" in f)

    def stop(self) -> None:
        """Each daemon by its pid file, newest first, then the temp directory."""
        for pid_file in reversed(self._started):
            try:
                pid = int(pid_file.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
            for sig, wait_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 5)):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    break
                deadline = time.monotonic() + wait_s
                while time.monotonic() < deadline and _alive(pid):
                    time.sleep(0.1)
                if not _alive(pid):
                    break
        self._started.clear()
        shutil.rmtree(self.dir, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie of ours counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False
