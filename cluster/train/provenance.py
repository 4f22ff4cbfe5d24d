"""What code produced a run: klrl's version and the git commit of its checkout, recorded in
every run directory (run_log.py) and printed by `klrl --version`."""
from __future__ import annotations

import subprocess
from importlib import metadata

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


def provenance() -> dict[str, object]:
    return {"klrl_version": klrl_version(), **git_state()}


def version_line() -> str:
    state = git_state()
    commit = state["git_commit"]
    where = f" (git {commit[:12]}{', modified' if state['git_dirty'] else ''})" if commit else ""
    return f"klrl {klrl_version()}{where}"
