"""ruff over the whole repository with the project's rules (pyproject.toml, [tool.ruff]).

The selection there is explicit and includes E501 at line-length 100, so a 101-character line
anywhere fails this test. It runs ruff's own binary from the dev extra (`python -m ruff`),
which takes well under a second; nothing is imported from klrl.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _ruff(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise",
         *args],
        cwd=ROOT, input=stdin, capture_output=True, text=True, timeout=120, check=False)


def test_ruff_finds_nothing():
    result = _ruff(".")
    # ruff exits 1 when it reports violations and 2 when it cannot run (bad configuration).
    assert result.returncode == 0, (
        f"ruff check (exit {result.returncode}) on {ROOT}:\n{result.stdout}{result.stderr}")


def test_a_101_character_line_fails():
    """The configuration really enforces the length: a probe file inside the repository (read
    from stdin, so nothing is written) with one line of 100 characters passes and one of 101
    fails with E501."""
    probe = str(ROOT / "tests" / "_lint_probe.py")
    assigned = "x = " + "1" * 96 + "\n"
    assert len(assigned) == 101  # 100 characters and the newline
    assert _ruff("--stdin-filename", probe, "-", stdin=assigned).returncode == 0
    longer = "x = " + "1" * 97 + "\n"
    result = _ruff("--stdin-filename", probe, "-", stdin=longer)
    assert result.returncode == 1 and "E501" in result.stdout, result.stdout + result.stderr
