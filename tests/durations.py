"""Rewrite the test-suite timing block of docs/development.md from a pytest JUnit report.

`make test` writes `.cache/pytest-junit.xml`; `make test-durations` then runs

    python tests/durations.py .cache/pytest-junit.xml docs/development.md

which replaces the text between `<!-- durations -->` and `<!-- /durations -->` with the
run's totals (pytest's own wall time, counts), the time per test file and the slowest tests,
plus the machine, commit and date, so the figures in the docs always come from a real run.
A test's time in the report is its setup + call + teardown: a module-scoped fixture (one
real training run, say) is counted in the first test that uses it.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

BEGIN, END = "<!-- durations -->", "<!-- /durations -->"
SLOWEST = 15


def read_report(path: Path) -> dict:
    """Totals and per-test times ({file::name: seconds}) of a pytest JUnit XML report."""
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        raise SystemExit(f"{path}: no <testsuite> in this JUnit report")
    tests = {}
    for case in suite.iter("testcase"):
        module = case.get("classname", "").split(".")
        file = "/".join(module[:2]) + ".py" if len(module) >= 2 else case.get("file", "?")
        name = case.get("name", "").split("@")[0]  # pytest-xdist's loadgroup suffix
        tests[f"{file}::{name}"] = float(case.get("time", 0.0))
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    return {"seconds": float(suite.get("time", 0.0)), "timestamp": suite.get("timestamp", ""),
            "counts": counts, "tests": tests}


def _machine() -> str:
    model = "unknown CPU"
    cpuinfo = Path("/proc/cpuinfo")
    for line in cpuinfo.read_text().splitlines() if cpuinfo.exists() else []:
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{model}, {os.cpu_count()} cores, {mem:.0f} GiB"


def _commit(repo: Path) -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True,
                         text=True, check=False)
    return out.stdout.strip() or "unknown"


def render(report: dict, machine: str, commit: str) -> str:
    c = report["counts"]
    passed = c["tests"] - c["failures"] - c["errors"] - c["skipped"]
    per_file: dict[str, float] = defaultdict(float)
    for name, seconds in report["tests"].items():
        per_file[name.split("::")[0]] += seconds
    when = report["timestamp"][:16].replace("T", " ")
    lines = [
        f"Measured by `make test` at commit `{commit}` ({when} UTC) on {machine}: "
        f"**{report['seconds'] / 60:.1f} minutes** of pytest time, "
        f"{passed} passed, {c['failures']} failed, {c['errors']} errors, {c['skipped']} skipped.",
        "",
        "| test file | seconds | share |",
        "|---|---:|---:|",
    ]
    total = sum(per_file.values()) or 1.0
    shown = [(f, s) for f, s in sorted(per_file.items(), key=lambda kv: -kv[1]) if s >= 1.0]
    lines += [f"| `{f}` | {s:.0f} | {s / total:.0%} |" for f, s in shown]
    rest = len(per_file) - len(shown)
    if rest:
        others = total - sum(s for _, s in shown)
        lines.append(f"| {rest} other files, under 1 s each | {others:.0f} | |")
    lines += ["", f"The {SLOWEST} slowest tests (setup + call + teardown):", "",
              "| test | seconds |", "|---|---:|"]
    slowest = sorted(report["tests"].items(), key=lambda kv: -kv[1])[:SLOWEST]
    lines += [f"| `{name}` | {seconds:.1f} |" for name, seconds in slowest]
    return "\n".join(lines)


def rewrite(doc: Path, block: str) -> None:
    text = doc.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{doc}: no {BEGIN} ... {END} block to rewrite")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{BEGIN}\n{block}\n{END}{tail}")


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python tests/durations.py JUNIT_XML DOC_MD", file=sys.stderr)
        return 2
    report_path, doc = Path(argv[0]), Path(argv[1])
    if not report_path.is_file():
        print(f"{report_path}: no report; run `make test` first", file=sys.stderr)
        return 2
    report = read_report(report_path)
    block = render(report, _machine(), _commit(doc.resolve().parent))
    rewrite(doc, block)
    age_h = (time.time() - report_path.stat().st_mtime) / 3600
    print(f"{doc}: durations of {report['counts']['tests']} tests, "
          f"{report['seconds'] / 60:.1f} min (report written {age_h:.1f} h ago)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
