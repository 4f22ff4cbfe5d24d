"""What code produced a run: klrl's version and the git commit of its checkout, recorded in
every run directory (run_log.py) and printed by `klrl --version`."""
from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

from cluster.config.loader import REPO_ROOT


def klrl_version() -> str:
    """The installed package's version ("unknown" when klrl runs from a bare checkout)."""
    try:
        return metadata.version("klrl")
    except metadata.PackageNotFoundError:
        return "unknown"


def git_state() -> dict[str, object]:
    """{"git_commit": sha or None, "git_dirty": bool or None} of the checkout klrl runs from.
    None where it is not a git checkout (for example a Ray job's uploaded working_dir)."""
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                                 timeout=10, check=True)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip()

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"git_commit": commit, "git_dirty": None if status is None else bool(status)}


def machine() -> str:
    """The machine in words: CPU model, cores, memory, Python (and the GPU when there is one)."""
    cpu = platform.machine()
    try:
        info = Path("/proc/cpuinfo").read_text()
        cpu = next(line.split(":", 1)[1].strip() for line in info.splitlines()
                   if line.startswith("model name"))
        meminfo = Path("/proc/meminfo").read_text().splitlines()
        mem_kb = next(int(line.split()[1]) for line in meminfo if line.startswith("MemTotal"))
        memory = f", {mem_kb / 2**20:.0f} GiB"
    except (OSError, StopIteration, ValueError):
        memory = ""
    return f"{cpu}, {os.cpu_count()} cores{memory}, {_gpu()}, Python {platform.python_version()}"


def _gpu() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU only"


def provenance() -> dict[str, object]:
    """What a run directory records at each start: code (version, commit) and machine."""
    return {"klrl_version": klrl_version(), **git_state(), "machine": machine()}


def version_line() -> str:
    state = git_state()
    commit = state["git_commit"]
    where = f" (git {commit[:12]}{', modified' if state['git_dirty'] else ''})" if commit else ""
    return f"klrl {klrl_version()}{where}"
