"""`make test-durations` (tests/durations.py): the development docs' timing block is rewritten
from a pytest JUnit report, never typed by hand."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import durations

ROOT = Path(__file__).resolve().parents[1]

REPORT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="0" failures="1" skipped="2" tests="5" time="654.3"
 timestamp="2026-11-24T04:00:00.000000" hostname="h">
<testcase classname="tests.test_e2e_train" name="test_lag0@stack" time="30.5"/>
<testcase classname="tests.test_e2e_train" name="test_lag2" time="20.25"/>
<testcase classname="tests.test_kl_exact" name="test_exact[k1]" time="0.2"/>
<testcase classname="tests.test_kl_exact" name="test_exact[k3]" time="0.1">
<failure message="x"/></testcase>
<testcase classname="tests.test_gpu" name="test_nccl" time="0.0"><skipped/></testcase>
</testsuite></testsuites>"""


def test_the_block_is_rewritten_from_the_report(tmp_path):
    xml = tmp_path / "junit.xml"
    xml.write_text(REPORT)
    doc = tmp_path / "dev.md"
    doc.write_text(f"# Dev\n\nbefore\n\n{durations.BEGIN}\nold figures\n{durations.END}\n\nafter\n")
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "durations.py"), str(xml), str(doc)],
                         capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    text = doc.read_text()
    assert "old figures" not in text
    assert text.startswith("# Dev\n\nbefore\n") and text.endswith("after\n")
    assert "**10.9 minutes** of pytest time, 2 passed, 1 failed, 0 errors, 2 skipped" in text
    # per file: the two e2e tests summed; the files under a second summed in one row
    assert "| `tests/test_e2e_train.py` | 51 | 99% |" in text
    assert "| 2 other files, under 1 s each | 0 | |" in text
    assert "| `tests/test_e2e_train.py::test_lag0` | 30.5 |" in text


def test_a_missing_report_or_block_is_refused(tmp_path):
    missing = subprocess.run([sys.executable, str(ROOT / "tests" / "durations.py"),
                              str(tmp_path / "none.xml"), str(tmp_path / "dev.md")],
                             capture_output=True, text=True, check=False)
    assert missing.returncode == 2 and "run `make test` first" in missing.stderr
    (tmp_path / "junit.xml").write_text(REPORT)
    (tmp_path / "dev.md").write_text("# no block\n")
    no_block = subprocess.run([sys.executable, str(ROOT / "tests" / "durations.py"),
                               str(tmp_path / "junit.xml"), str(tmp_path / "dev.md")],
                              capture_output=True, text=True, check=False)
    assert no_block.returncode != 0
    assert "no <!-- durations --> ... <!-- /durations --> block" in no_block.stderr


def test_the_development_docs_hold_the_block():
    text = (ROOT / "docs" / "development.md").read_text()
    assert text.count(durations.BEGIN) == 1 and text.count(durations.END) == 1
