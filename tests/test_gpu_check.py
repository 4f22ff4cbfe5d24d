"""`make gpu-check` (cluster/bench/gpu_check.py) without a GPU: which parts a budget lets run,
in which order, what the JSON says after every part and on the next call, the refusal without
CUDA, the slices of the GPU plan the parts measure, the stopping of a part with everything it
started, and the outcomes of a pytest run stopped before its report. The parts themselves need
a GPU: a stand-in runs them here, on a clock that it moves by the seconds each part takes."""
from __future__ import annotations

import json
import os
import sys
import time

import pytest
import torch

from cluster.bench import gpu, gpu_check, report
from cluster.bench.gpu_check import PARTS, STOPPED_EXIT, plan_for, remaining, run_check
from cluster.bench.results import merge

BUDGET = 480


class Parts:
    """Runs the parts on a made-up clock: each takes `takes[name]` seconds and returns
    `codes[name]` (default 0), or is stopped (None) if it would outlast its time. Records
    what the JSON said when each part started."""

    def __init__(self, json_path, takes, codes=None):
        self.json_path, self.takes, self.codes = json_path, takes, codes or {}
        self.now = 0.0
        self.seen: list[tuple[str, dict]] = []

    def clock(self):
        return self.now

    def __call__(self, part, seconds):
        record = json.loads(self.json_path.read_text())["gpu_check"] if \
            self.json_path.is_file() else {}
        self.seen.append((part.name, record.get("parts", {})))
        if self.takes[part.name] > seconds:
            self.now += seconds
            return None
        self.now += self.takes[part.name]
        return self.codes.get(part.name, 0)


def test_parts_run_most_informative_first_within_the_budget_and_resume_next_call(tmp_path):
    path = tmp_path / "gpu-check.json"
    assert [p.name for p in PARTS] == ["tests", "e2e", "engines", "sync"]
    # Call 1: the tests fit, e2e and engines no longer do, sync still does.
    parts = Parts(path, {"tests": 300, "e2e": 460, "engines": 200, "sync": 100})
    record = run_check(path, BUDGET, parts, parts.clock)
    assert [name for name, _ in parts.seen] == ["tests", "sync"]
    # the JSON was written before and after every part: sync started knowing what the others
    # did, and a call killed in a part leaves it marked as running (run again next time)
    assert parts.seen[0][1]["tests"]["status"] == "running"
    assert parts.seen[1][1]["tests"]["status"] == "passed"
    assert parts.seen[1][1]["e2e"]["status"] == "not started"
    assert "needs about 450 s, 150 s of the budget left" in record["parts"]["e2e"]["why"]
    assert remaining(record) == ["e2e", "engines"]
    assert json.loads(path.read_text())["gpu_check"] == record
    # Call 2, same JSON: e2e outlasts its time and is stopped; engines does not fit after it.
    parts.now = 0.0
    record = run_check(path, BUDGET, parts, parts.clock)
    assert [name for name, _ in parts.seen[2:]] == ["e2e"]
    e2e = record["parts"]["e2e"]
    assert e2e["status"] == "stopped" and e2e["stopped_after_s"] == BUDGET - 30
    # Call 3: e2e is estimated at a quarter more than it ran, which 480 s cannot hold, so
    # the engines run; with a longer budget (call 4) e2e runs through.
    parts.now = 0.0
    record = run_check(path, BUDGET, parts, parts.clock)
    assert [name for name, _ in parts.seen[3:]] == ["engines"]
    assert record["parts"]["e2e"]["status"] == "not started"
    assert "needs about 562 s" in record["parts"]["e2e"]["why"]
    parts.now = 0.0
    record = run_check(path, 900, parts, parts.clock)
    assert [name for name, _ in parts.seen[4:]] == ["e2e"] and remaining(record) == []
    assert record["parts"]["e2e"] | {} == {"status": "passed", "seconds": 460, "returncode": 0,
                                           "estimate_s": 450, "stopped_after_s": 450}
    assert [c["ran"] for c in record["calls"]] == [["tests", "sync"], ["e2e"], ["engines"],
                                                   ["e2e"]]
    line = report._gpu_check_line(record)
    assert line.startswith("**GPU check** (`make gpu-check`, 4 call(s) with a budget of 480 / "
                           "900 s): tests passed in 300 s; ") and "e2e passed in 460 s" in line


def test_a_failed_part_is_not_run_again_and_a_part_that_stopped_itself_is(tmp_path):
    path = tmp_path / "gpu-check.json"
    parts = Parts(path, {"tests": 100, "e2e": 100, "engines": 100, "sync": 100},
                  codes={"tests": STOPPED_EXIT, "e2e": 1})
    record = run_check(path, 2000, parts, parts.clock)
    assert {n: r["status"] for n, r in record["parts"].items()} == {
        "tests": "stopped", "e2e": "failed", "engines": "passed", "sync": "passed"}
    assert remaining(record) == ["tests"]
    assert "e2e failed in 100 s" in report._gpu_check_line(record)
    killed = record | {"parts": record["parts"] | {"tests": {"status": "running"}}}
    assert "tests was running when the call ended" in report._gpu_check_line(killed)
    assert "tests" in remaining(killed)


def test_the_parts_slice_the_gpu_plan_to_its_headline():
    from cluster.bench.run import FULL, RANDOM_QWEN05, gpu_plan

    plan = gpu_plan(FULL)
    slices = {p.name: plan_for(p, plan) for p in PARTS}
    assert slices["tests"].workloads == () and slices["tests"].outside is None
    for name in ("e2e", "engines", "sync"):
        assert slices[name].workloads == (RANDOM_QWEN05,)
    assert slices["engines"].outside == plan.outside and slices["sync"].outside is None
    assert slices["e2e"].lags == (0, 2) and slices["e2e"].in_flight_lags == (2,)


def test_a_part_merges_into_a_json_that_holds_only_the_record():
    """The first part may find the JSON the runner wrote alone (an earlier part stopped
    before it wrote anything): its sections go in beside the record."""
    from test_bench_gpu import _gpu_parts

    engines = _gpu_parts()[0]
    merged = merge({"device": "cuda", "gpu_check": {"parts": {}, "calls": []}}, engines)
    assert merged["gpu_check"] == {"parts": {}, "calls": []}
    assert merged["rollout_overhead_ratio"] == engines["rollout_overhead_ratio"]


def test_the_check_without_cuda_is_refused_in_one_line(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--json", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs a CUDA GPU" in err
    assert not (tmp_path / "x.json").exists()


def test_a_part_is_stopped_with_everything_it_started():
    """run_bounded stops the part's whole process session at its time: a grandchild (as a
    bench part's Ray cluster and engines are) goes too."""
    code = ("import subprocess, sys, time; "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "print(c.pid, flush=True); time.sleep(60)")
    t0 = time.monotonic()
    returncode, out = gpu.run_bounded([sys.executable, "-c", code], 3)
    assert returncode is None and time.monotonic() - t0 < 30
    grandchild = int(out.split()[0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        try:  # reaped by init once its parent died; a zombie until then
            with open(f"/proc/{grandchild}/stat") as f:
                if f.read().split()[2] == "Z":
                    break
        except FileNotFoundError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the grandchild {grandchild} outlived the stopped part")
    assert gpu.run_bounded([sys.executable, "-c", "print('done')"], 30) == (0, "done\n")


def test_the_outcomes_of_a_stopped_pytest_run_are_read_from_its_progress():
    output = ("tests/test_in_flight_gpu.py::test_an_update PASSED                [ 10%]\n"
              "tests/test_outputs.py::test_the_cheap_output_path_on_a_gpu FAILED  [ 20%]\n"
              "tests/test_own_model.py::test_the_page_config_trains_on_a_gpu SKIPPED (x) [ 30%]\n"
              "tests/test_weight_sync.py::test_nccl_sync_gpu ")
    assert gpu.parse_progress(output) == {
        "passed": 1, "failed": 1, "errors": 0, "skipped": 1, "skip_reasons": [],
        "failures": [{"test": "tests/test_outputs.py::test_the_cheap_output_path_on_a_gpu",
                      "message": "(stopped before pytest's summary)"}],
        "stopped": True}
    tests = {"command": "python -m pytest -v -m gpu -rs", "returncode": None,
             "timed_out": True, "seconds": 300.0, **gpu.parse_progress(output)}
    assert report._gpu_tests(tests)[1].endswith(
        "1 passed, 1 skipped, 1 failed, 0 errors in 300 s (stopped at its time: the tests "
        "after these did not run)")
    assert gpu.GPU_TEST_ORDER[0] == "tests/test_in_flight_gpu.py"
    assert all((gpu.REPO_ROOT / p).is_file() for p in gpu.GPU_TEST_ORDER)


def test_make_gpu_check_runs_the_check_and_the_payload_builds_the_gpu_extras_vllm():
    """The Makefile target runs this runner with its default budget; the payload script
    parses, refuses a wrong command, and carries the vLLM the gpu extra pins."""
    import re
    import subprocess

    makefile = (gpu.REPO_ROOT / "Makefile").read_text()
    recipe = re.search(r"^gpu-check:.*\n\t(.+)$", makefile, re.MULTILINE).group(1)
    assert "-m cluster.bench.gpu_check" in recipe and "--budget-s $(GPU_CHECK_BUDGET)" in recipe
    assert f"GPU_CHECK_BUDGET ?= {gpu_check.DEFAULT_BUDGET_S}" in makefile
    script = gpu.REPO_ROOT / "cluster" / "bench" / "gpu_payload.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    usage = subprocess.run(["bash", str(script)], capture_output=True, text=True)
    assert usage.returncode == 2 and "usage:" in usage.stderr and "chunks" in usage.stderr
    pin = re.search(r'gpu = \["(vllm==[^"]+)"\]', (gpu.REPO_ROOT / "pyproject.toml").read_text())
    assert pin.group(1) in re.findall(r"[\w.-]+==[\w.]+", script.read_text())
    assert f"check {gpu_check.DEFAULT_BUDGET_S}" in (gpu.REPO_ROOT / "docs" / "gpu.md").read_text()


def test_the_device_script_joins_checks_and_unpacks_the_chunks_then_runs_the_check(tmp_path):
    """`gpu_payload.sh check`, as the last call of a window runs it, on a made-up payload in
    two chunks: the one an earlier call left in CHUNKS and the one this call carries. It
    checks their sha256, unpacks them into SITE and runs the check, which here, without CUDA,
    refuses (exit 2) once the payload is in place; chunks of two builds are refused first."""
    import hashlib
    import shutil
    import subprocess

    script = gpu.REPO_ROOT / "cluster" / "bench" / "gpu_payload.sh"
    src, g, chunks, site = (tmp_path / n for n in ("src", "gpu", "up", "site"))
    (src / "fakepkg").mkdir(parents=True)
    (src / "fakepkg" / "__init__.py").write_text("X = 1\n")
    tarball = tmp_path / "payload.tar.xz"
    subprocess.run(f"tar -C {src} -cf - . | xz -1 > {tarball}", shell=True, check=True)
    data = tarball.read_bytes()
    half = len(data) // 2
    for i, chunk in ((1, data[:half]), (2, data[half:])):
        (g / f"up{i}").mkdir(parents=True)
        (g / f"up{i}" / f"part.0{i - 1}").write_bytes(chunk)
    (g / "check" / "klrl_home" / "models").mkdir(parents=True)
    (g / "check" / "parts.txt").write_text("part.00\npart.01\n")
    sha = hashlib.sha256(data).hexdigest()
    (g / "check" / "payload.sha256").write_text(f"{sha}  payload.tar.xz\n")
    chunks.mkdir()
    shutil.copy(g / "up1" / "part.00", chunks)  # what the window's first call did
    shutil.rmtree(g / "up1")                     # the last call carries its own chunk only
    env = {**os.environ, "GPU_DIR": str(g), "SITE": str(site), "CHUNKS": str(chunks),
           "OUT": str(tmp_path / "out"), "PYTHON": sys.executable,
           "KLRL_HOME": str(tmp_path / "home"), "PTH_DIR": str(tmp_path / "pth")}

    def check():
        return subprocess.run(["bash", str(script), "check", "60"], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)

    proc = check()
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr, proc.stderr[-2000:]
    assert (site / "fakepkg" / "__init__.py").read_text() == "X = 1\n"
    assert (site / ".payload").read_text().strip() == sha
    assert (tmp_path / "home" / "models").is_dir()
    (site / ".payload").unlink()
    (chunks / "part.00").write_bytes(b"x" + data[1:half])  # a chunk of another build
    (g / "up2" / "part.01").unlink()
    proc = check()
    assert proc.returncode == 3 and "chunks of two builds" in proc.stderr, proc.stderr[-2000:]
