"""What a Ray job carries and where it runs: the project's files, and the cluster's Python.

`klrl submit` and `klrl sweep --address` upload the klrl checkout the command is run in (the
git checkout holding the current directory, when it is one of klrl; else the one klrl is
imported from): its tracked files (`git ls-files`, as they are in the working tree), or the
files an explicit list names (`--upload-list FILE`). Never an untracked or ignored file:
checkpoints, runs, environments and data sets beside the code stay where they are. docs/ and
tests/ are left out too (the figures and kept runs of the docs are most of a checkout's bytes,
and no job reads them). The files are staged in a temporary directory, which becomes the
job's working_dir, and the upload's size is said before it is sent.

Before the run's files are uploaded, the Python that will run the job's driver is checked on
the cluster by a probe job (nothing uploaded): it must exist and find klrl's dependencies. By
default the candidates are the Python running this command (the same path on the cluster, as
with a shared environment) and then `python` on the head's PATH; the first that passes runs
the job. A failure names each candidate's problem and the fix (`--python PATH`).
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from cluster.config.loader import REPO_ROOT

# The top-level modules of klrl's dependencies (pyproject.toml's, and vLLM's from the cpu or gpu
# extra; tests/test_submit.py checks this list against pyproject.toml).
DEPENDENCY_MODULES = ("torch", "pydantic", "omegaconf", "yaml", "rich", "matplotlib", "numpy",
                      "scipy", "transformers", "tokenizers", "safetensors", "math_verify",
                      "datasets", "ray", "deepspeed", "wandb", "peft", "vllm")
# Tracked folders no job reads: the docs (figures, kept runs) and the tests.
NOT_FOR_JOBS = ("docs/", "tests/")
# How long the probe of the cluster's Python may take (a job start, a few imports' lookups).
PROBE_TIMEOUT_S = 120.0
_PROBE_TAG = "KLRL_PROBE"


class UploadError(Exception):
    """The files a job should carry cannot be listed: one line with the fix."""


@dataclass(frozen=True)
class Upload:
    """The files of `root` a job carries (`files`: paths relative to it, posix)."""

    root: Path
    files: tuple[str, ...]
    source: str  # how they were chosen, for people

    @property
    def size(self) -> int:
        return sum((self.root / f).stat().st_size for f in self.files)

    def holds(self, path: Path) -> bool:
        """Whether the job gets the file `path` (resolved), or some file under the directory
        `path`, with this upload."""
        if not path.is_relative_to(self.root):
            return False
        rel = path.relative_to(self.root).as_posix()
        return rel in self.files or any(f.startswith(rel + "/") for f in self.files)

    def describe(self) -> str:
        return f"{self.root}: {len(self.files)} {self.source}, {_size(self.size)}"

    def stage(self, into: Path) -> Path:
        """The files copied (hard-linked where possible) into `into`, the job's working_dir."""
        for rel in self.files:
            target = into / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(self.root / rel, target)
            except OSError:  # another file system, or links not allowed
                shutil.copy2(self.root / rel, target)
        return into


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def project_root(cwd: Path | None = None) -> Path:
    """The klrl checkout a command run in `cwd` means: the git checkout holding it when that is
    one of klrl (it has cluster/cli/job_entry.py), else the one klrl is imported from."""
    top = _git(cwd or Path.cwd(), "rev-parse", "--show-toplevel")
    if top and (Path(top.strip()) / "cluster" / "cli" / "job_entry.py").is_file():
        return Path(top.strip()).resolve()
    return REPO_ROOT


def project_upload(listing: str | Path | None = None, root: Path | None = None) -> Upload:
    """The upload of the project (`project_root`): its tracked files but NOT_FOR_JOBS, or with
    `listing` the files that file names (one path per line, relative to the project; a
    directory stands for the files under it; `#` starts a comment)."""
    root = root or project_root()
    if listing is not None:
        return Upload(root, _listed(root, Path(listing)), f"files listed in {listing}")
    out = _git(root, "ls-files", "-z", "--cached")
    if out is None:
        raise UploadError(f"{root} is not a git checkout, so its tracked files are unknown; give "
                          "the files the job needs with --upload-list FILE (one path per line, "
                          "relative to it)")
    files = tuple(sorted(f for f in out.split("\0") if f and not f.startswith(NOT_FOR_JOBS)
                         and (root / f).is_file()))
    return Upload(root, files, "tracked files (git ls-files; docs/ and tests/ left out)")


def _listed(root: Path, listing: Path) -> tuple[str, ...]:
    try:
        lines = listing.read_text().splitlines()
    except OSError as exc:
        raise UploadError(f"--upload-list {listing}: {exc.strerror or exc}") from None
    files: set[str] = set()
    for line in (raw.split("#", 1)[0].strip() for raw in lines):
        if not line:
            continue
        path = (root / line).resolve()
        if not path.is_relative_to(root) or not path.exists():
            raise UploadError(f"--upload-list {listing}: {line!r} is not a file or directory "
                              f"inside {root} (paths are relative to it)")
        found = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        files |= {p.relative_to(root).as_posix() for p in found}
    if not files:
        raise UploadError(f"--upload-list {listing}: it names no file")
    return tuple(sorted(files))


def _git(where: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True,
                              timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def staged(upload: Upload) -> tuple[tempfile.TemporaryDirectory, Path]:
    """A temporary directory holding `upload`'s files (removed with the returned object), and
    the working_dir inside it."""
    holder = tempfile.TemporaryDirectory(prefix="klrl-upload-")
    return holder, upload.stage(Path(holder.name) / "project")


def python_candidates(python: str | None) -> list[str]:
    """The Pythons the job may run with: the one given, else this one's path, then `python`."""
    return [python] if python else [sys.executable, "python"]


def probe_python(client, candidates: list[str]) -> str:
    """The first of `candidates` that exists on the cluster and finds every module of
    DEPENDENCY_MODULES, checked by a job that uploads nothing. SubmitError-like UploadError
    naming what each candidate lacks, with the fix, when none does."""
    from ray.job_submission import JobStatus

    code = ("import importlib.util as u, sys; print(" + repr(_PROBE_TAG) + ", sys.executable, "
            "','.join(m for m in " + repr(DEPENDENCY_MODULES) + " if u.find_spec(m) is None) "
            "or '-')")
    checks = [f"if command -v {shlex.quote(py)} >/dev/null 2>&1; then {shlex.quote(py)} -c "
              f"{shlex.quote(code)} || echo {_PROBE_TAG} - failed; else echo {_PROBE_TAG} - "
              "absent; fi" for py in candidates]
    job = client.submit_job(entrypoint="; ".join(checks), metadata={"klrl": "python probe"})
    deadline = time.monotonic() + PROBE_TIMEOUT_S
    while not client.get_job_status(job).is_terminal():
        if time.monotonic() > deadline:
            client.stop_job(job)
            raise UploadError(f"the cluster did not run the check of its Python within "
                              f"{PROBE_TIMEOUT_S:.0f} s (Ray job {job}); is its head busy?")
        time.sleep(0.5)
    if client.get_job_status(job) != JobStatus.SUCCEEDED:
        raise UploadError(f"the check of the cluster's Python failed (Ray job {job}): "
                          f"{client.get_job_info(job).message}")
    answers = [line.split(" ", 2)[1:] for line in client.get_job_logs(job).splitlines()
               if line.startswith(_PROBE_TAG + " ")]
    problems = []
    for py, (path, missing) in zip(candidates, answers, strict=False):
        if missing == "-":
            return py
        problems.append(f"`{py}` " + ("is not found there" if missing == "absent" else
                                      "does not run" if missing == "failed" else
                                      f"({path}) lacks {missing.replace(',', ', ')}"))
    raise UploadError(
        "the job's Python on the cluster cannot run klrl: " + "; ".join(problems) + ". Give "
        "--python PATH, the Python of the cluster's environment with klrl's dependencies (the "
        "one its `ray start` runs, e.g. /path/to/.venv/bin/python), or install them into it "
        "(pip install -e '.[gpu]' from this repository)")
