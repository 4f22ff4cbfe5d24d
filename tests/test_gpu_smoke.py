"""The smoke driver of a lent GPU window (cluster/bench/smoke.py, gpu_smoke.py) on CPU, with a
fake short deadline and stand-in steps (small Python commands, no Ray or vLLM): a JSON line
appended after every step, a step that overruns killed and recorded as timed out, later steps
recorded as skipped for lack of time, the log archive packed after every step, and the
window's order. What the GPU steps find needs a GPU (docs/gpu.md: the run is pending)."""
from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import time

import pytest

from cluster.bench import gpu_smoke
from cluster.bench.smoke import ARCHIVE, PACK_MARGIN_S, RESULTS, Smoke, Step, exit_code

PY = sys.executable


def py(code: str) -> tuple[str, ...]:
    return (PY, "-c", code)


WRITES_DETAILS = py("import json, os; print('hello'); json.dump({'found': 7}, "
                    "open(os.environ['SMOKE_DETAILS'], 'w'))")
SKIPS_ITSELF = py("import json, os, sys; json.dump({'reason': 'nothing to unpack here'}, "
                  "open(os.environ['SMOKE_DETAILS'], 'w')); sys.exit(77)")
JUNIT = ('<testsuites><testsuite><testcase classname="tests.test_a" name="test_x" time="1.5"/>'
         '<testcase classname="tests.test_a" name="test_y" time="0.2"><skipped message="needs '
         'two GPUs"/></testcase></testsuite></testsuites>')
WRITES_JUNIT = py(f"import sys; open(sys.argv[1], 'w').write({JUNIT!r})") + ("{junit}",)
OVERRUNS = py("import time; print('started', flush=True); time.sleep(120)")


def _lines(out):
    return [json.loads(line) for line in (out / RESULTS).read_text().splitlines()]


def test_a_window_records_every_step_kills_the_overrun_and_skips_what_no_longer_fits(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    steps = [
        Step("quick", "writes its details", WRITES_DETAILS, cap_s=30, min_s=1),
        Step("self_skip", "skips itself", SKIPS_ITSELF, cap_s=30, min_s=1),
        Step("junit", "a test report", WRITES_JUNIT, cap_s=30, min_s=1, junit=True),
        Step("gpu_only", "needs CUDA", py("raise SystemExit(1)"), cap_s=30, min_s=1,
             needs_cuda=True),
        # its cap is past the deadline: it gets what is left of the deadline, and overruns it
        Step("overrun", "sleeps past the deadline", OVERRUNS, cap_s=600, min_s=1),
        Step("late", "comes after the deadline", WRITES_DETAILS, cap_s=30, min_s=1),
    ]
    seen = []

    def after_step(record):  # what a call killed now would bring back
        with tarfile.open(out / ARCHIVE) as tar:
            names = tar.getnames()
            results = tar.extractfile(RESULTS).read().decode()
        seen.append((record["step"], names, len(results.splitlines())))

    t0 = time.monotonic()
    records = Smoke(steps, out, work, deadline_s=PACK_MARGIN_S + 8, window="test",
                    cuda_missing=lambda: "no GPU on this machine", after_step=after_step).run()
    took = time.monotonic() - t0
    lines = _lines(out)
    assert [r["step"] for r in lines] == [s.name for s in steps]
    assert lines == json.loads(json.dumps(records))  # what was returned is what was written

    quick, skip, junit, gpu_only, overrun, late = lines
    assert quick["status"] == "passed" and quick["details"] == {"found": 7}
    assert quick["seconds"] >= 0 and quick["returncode"] == 0 and quick["timeout_s"] <= 8
    assert "hello" in (work / "logs" / "quick.log").read_text()
    assert (skip["status"], skip["reason"]) == ("skipped", "nothing to unpack here")
    assert junit["status"] == "passed"
    assert junit["details"]["tests"] == [
        {"test": "tests.test_a::test_x", "seconds": 1.5, "outcome": "passed"},
        {"test": "tests.test_a::test_y", "seconds": 0.2, "outcome": "skipped",
         "message": "needs two GPUs"}]
    assert gpu_only["status"] == "skipped"
    assert gpu_only["reason"] == "needs a CUDA GPU: no GPU on this machine"
    # cut at the deadline, not at its cap of 600 s; killed, its log kept
    assert overrun["status"] == "timed_out" and overrun["returncode"] in (124, 137)
    assert overrun["timeout_s"] <= 8 and overrun["seconds"] < 8 + 3
    assert "started" in (work / "logs" / "overrun.log").read_text()
    assert overrun["log_tail"][-1] == "started"
    assert late["status"] == "skipped" and late["reason"].startswith("no time")
    assert took < PACK_MARGIN_S + 8 + 5  # the window kept its deadline (the pack's margin)
    for line in lines:  # every line says what it ran on
        assert line["window"] == "test" and line["date"] and line["machine"]["host"]
        assert line["versions"]["python"] and "vllm" in line["versions"]
    # packed after every step: the archive held every line written so far, and the step's log
    assert [(step, n) for step, _, n in seen] == [(s.name, i + 1) for i, s in enumerate(steps)]
    for step, names, _ in seen:
        assert RESULTS in names
        if step not in ("gpu_only", "late"):
            assert f"logs/{step}.log" in names, (step, names)
    assert "details/junit.xml" in seen[-1][1]
    assert exit_code(records) == 1  # a step timed out
    assert exit_code(records[:4]) == 3  # one skipped for want of CUDA: another window runs it
    assert exit_code(records[:3]) == 0


def test_the_command_line_runs_a_steps_file_and_appends_to_the_results(tmp_path):
    steps = tmp_path / "steps.json"
    steps.write_text(json.dumps([{"name": "one", "what": "a step", "command": list(
        WRITES_DETAILS), "cap_s": 30, "min_s": 1}]))
    out = tmp_path / "out"
    (out).mkdir()
    (out / RESULTS).write_text('{"step": "before"}\n')  # a window's earlier call: kept
    done = subprocess.run([PY, "-m", "cluster.bench.gpu_smoke", "--steps-file", str(steps),
                           "--deadline-s", "60", "--out", str(out), "--work",
                           str(tmp_path / "work")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = _lines(out)
    assert [r["step"] for r in lines] == ["before", "one"]
    assert lines[1]["window"] == "steps" and lines[1]["details"] == {"found": 7}
    assert (out / ARCHIVE).is_file()


def test_the_verdict_window_runs_in_the_issues_order_and_its_gpu_steps_need_cuda():
    names = [s.name for s in gpu_smoke.VERDICT]
    assert names == ["unpack", "sanity", "in_flight_test", "demo_batch_lag0",
                     "demo_in_flight_lag2", "cheap_output_test", "tf32_probe", "other_gpu_tests"]
    assert not gpu_smoke.VERDICT[0].needs_cuda  # the unpack runs (or skips itself) anywhere
    assert all(s.needs_cuda for s in gpu_smoke.VERDICT[1:] + gpu_smoke.PERF[1:])
    # the tests the first steps run are not run again by the last one
    assert not set(gpu_smoke.FIRST_TESTS) & set(gpu_smoke.OTHER_TESTS)
    from cluster.bench.gpu import GPU_TEST_ORDER

    assert set(GPU_TEST_ORDER) == set(gpu_smoke.FIRST_TESTS) | set(gpu_smoke.OTHER_TESTS)
    assert [s.name for s in gpu_smoke.PERF] == ["unpack", "bench_e2e", "bench_engines",
                                                "bench_sync"]


def test_the_demo_runs_are_configs_the_trainer_takes(tmp_path, monkeypatch):
    """The demo steps' overrides pass the config's own checks (cuda_ipc's among them) here,
    so a window does not find a typo; the run itself needs the GPU."""
    from cluster.bench import gpu_probe
    from cluster.config.loader import REPO_ROOT
    from cluster.config.train_config import load_train_config

    monkeypatch.setenv("SMOKE_WORK", str(tmp_path))
    batch = load_train_config(REPO_ROOT / "configs" / "tiny_cpu.yaml",
                              gpu_probe._demo_overrides("batch_lag0"))
    assert (batch.max_lag, batch.sync.transport, batch.learner.dtype) == (0, "cuda_ipc",
                                                                          "float32")
    assert batch.rollout.dtype is None  # the engine follows the learner: the fp32 default
    flying = load_train_config(REPO_ROOT / "configs" / "tiny_cpu.yaml",
                               gpu_probe._demo_overrides("in_flight_lag2"))
    assert flying.rollout.in_flight_updates and flying.max_lag == 2
    assert flying.model.path == str(tmp_path / "models" / "random_tiny")


def test_a_demo_runs_metrics_are_summarised_for_its_checks():
    from cluster.bench.gpu_probe import summarise

    rows = [{"step": s, "reward/mean": 0.1, "is/ratio_min": 0.99 - s / 100, "is/ratio_max": 1.01,
             "is/abs_log_ratio_max": 0.01 * s, "lag/max": s % 3, "lag/token_max": 2,
             "lag/multi_version_share": 0.0 if s < 3 else 0.25, "rollout/preempted": s,
             "time/step": 2.0} for s in range(1, 5)] + [{"step": 4, "eval/in_domain": 0.5}]
    found = summarise(rows)
    assert found["steps"] == 4 and found["ratio_min"] == 0.95 and found["lag_max"] == 2
    assert found["multi_version_share_max"] == 0.25 and found["preempted"] == 10
    assert found["abs_log_ratio_max"] == 0.04 and found["step_s_mean_after_2"] == 2.0


def test_the_verdict_window_on_a_machine_without_cuda_records_why_each_gpu_step_skipped(
        tmp_path):
    """The real first window, as `make gpu-smoke` runs it, here: the unpack step finds no
    payload (and says what it found), every later step is recorded as skipped for want of
    CUDA, and the run exits 3 (another window has to run them)."""
    import os

    out = tmp_path / "out"
    done = subprocess.run([PY, "-m", "cluster.bench.gpu_smoke", "--deadline-s", "120", "--out",
                           str(out), "--work", str(tmp_path / "work")], capture_output=True,
                          text=True, timeout=300,
                          env={**os.environ, "GPU_DIR": str(tmp_path / "no-payload"),
                               "PYTHON": PY})
    assert done.returncode == 3, done.stdout + done.stderr
    lines = _lines(out)
    assert [r["step"] for r in lines] == [s.name for s in gpu_smoke.VERDICT]
    assert lines[0]["status"] in ("passed", "skipped") and lines[0]["details"], lines[0]
    for line in lines[1:]:
        assert line["status"] == "skipped" and line["reason"].startswith("needs a CUDA GPU: ")
    with tarfile.open(out / ARCHIVE) as tar:
        assert "logs/unpack.log" in tar.getnames()


def test_the_batch_demo_checks_the_fp32_default_and_the_start_order_it_is_for(tmp_path,
                                                                              monkeypatch):
    from cluster.bench import gpu_probe
    from cluster.config.loader import REPO_ROOT
    from cluster.config.train_config import load_train_config

    monkeypatch.setenv("SMOKE_WORK", str(tmp_path))
    cfg = load_train_config(REPO_ROOT / "configs" / "tiny_cpu.yaml",
                            gpu_probe._demo_overrides("batch_lag0"))
    assert cfg.worker_rollout.dtype == "float32" and cfg.learner_may_share_a_gpu
    assert not cfg.rollout.in_flight_updates  # batch mode: vLLM's async scheduling stays on


@pytest.mark.slow
def test_the_probes_engine_and_its_hf_comparison_run_on_vllm_cpu(tmp_path, monkeypatch,
                                                                  tiny_model_dir):
    """The TF32 probe's plumbing, on vllm-cpu: an engine of klrl's building in a process of its
    own reports its facts and samples, and their log-probs match HF fp32 to vllm-cpu's 1e-4
    (on a GPU the same comparison measures the kernels' numerics)."""
    from cluster.bench import gpu_probe

    monkeypatch.setenv("SMOKE_WORK", str(tmp_path))
    ran = gpu_probe.run_engine(tiny_model_dir, "float32", "cpu", 600)
    assert ran["returncode"] == 0, ran.get("log_lines")
    assert ran["facts"][0]["model_runner"] and ran["facts"][0]["dtype"] == "torch.float32"
    assert len(ran["samples"]) == gpu_probe.PROMPTS
    found = gpu_probe.compare(tiny_model_dir, ran["samples"], device="cpu")
    assert found["tokens_compared"] > gpu_probe.PROMPTS and found["max_abs_logprob_diff"] < 1e-3
