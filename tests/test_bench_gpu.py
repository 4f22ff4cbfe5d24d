"""`klrl bench --device cuda` and `--only` without a GPU and without running anything: the
refusals (one line, exit 2, before anything starts), the configs the GPU workloads run with,
the weight-sync transports picked up from actors.weight_sync, the merge of parts into one
JSON, the check of the required figures per part, the JUnit counts of the gpu-marked tests,
and the rendering of GPU and partial JSONs. The figures of the synthetic JSONs below are
made up: these test the rendering, not a GPU. One test needs CUDA (the copy bound)."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from cluster.bench import gpu, report
from cluster.bench.results import FLOOR_KEY, OUTSIDE_KEY, check_result, merge, summary
from cluster.cli.main import main
from cluster.config.loader import DEMO_CONFIG
from cluster.config.options import read_block
from cluster.config.train_config import TrainConfig, load_train_config

ROOT = Path(__file__).resolve().parents[1]
BENCH_JSON = ROOT / "docs" / "figures" / "bench.json"


def _refused(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""  # nothing started, nothing announced
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


def test_bench_device_cuda_without_cuda_is_refused_in_one_line(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = _refused(capsys, ["bench", "--device", "cuda", "--only", "engines"])
    assert "--device cuda" in err and "torch.cuda.is_available() is False" in err


def test_bench_options_that_cannot_run_are_refused_before_anything_starts(capsys, tmp_path):
    assert "--device cuda" in _refused(capsys, ["bench", "--dtype", "bfloat16"])
    assert "--device cuda" in _refused(capsys, ["bench", "--sync-transport", "shm"])
    assert "--peer" in _refused(capsys, ["bench", "--peer", "trl", "--only", "sync"])
    earlier = tmp_path / "gpu-check.json"
    earlier.write_text(json.dumps({"device": "cuda", "workloads": {}}))
    assert "holds a cuda bench" in _refused(capsys, ["bench", "--only", "sync",
                                                     "--json", str(earlier)])
    earlier.write_text("not json")
    assert "not a bench JSON" in _refused(capsys, ["bench", "--only", "e2e",
                                                   "--json", str(earlier)])
    page = tmp_path / "page.md"
    page.write_text("no block here\n")
    assert "bench:figures" in _refused(capsys, ["bench", "--docs", str(page)])


def test_gpu_workloads_share_one_gpu_and_validate_as_train_configs(monkeypatch):
    """Every workload of the GPU plans validates (nothing starts): learner on CUDA at half a
    GPU, the worker's engine at half a GPU and 0.3 of its memory, float32 on both sides unless
    asked (the 0.5B headline: bf16 always), a shared-GPU transport (cuda_ipc where this
    checkout has it); the CPU plans' configs are what they were."""
    from actors.weight_sync import TRANSPORTS
    from cluster.bench.run import FULL, QUICK, RANDOM_QWEN05, gpu_plan, workload_config

    ipc = "cuda_ipc" in TRANSPORTS
    for dtype, transport in (("float32", None), ("bfloat16", None), ("float32", "shm")):
        for plan in (gpu_plan(FULL, dtype, transport), gpu_plan(QUICK, dtype, transport)):
            assert plan.device == "cuda" and plan.lags == (0, 2) and plan.reference == "max_lag 0"
            runs_ipc = ipc and transport is None
            assert plan.transports == ("shm", "object_store") + (("cuda_ipc",) if runs_ipc else ())
            names = [w.name for w in plan.workloads]
            assert names and not any("lora" in n for n in names), names
            for w in (*plan.workloads, plan.outside):
                cfg = workload_config(w, "/models/m", plan)
                assert isinstance(cfg, TrainConfig)
                assert cfg.learner.device_kind == "cuda" and cfg.learner.num_gpus_per_rank == 0.5
                assert cfg.rollout.num_gpus_per_worker == 0.5
                assert cfg.rollout.gpu_memory_utilization == 0.3
                want = "bfloat16" if w is RANDOM_QWEN05 else dtype
                assert cfg.learner.dtype == cfg.worker_rollout.dtype == want
                assert cfg.sync.transport == ("cuda_ipc" if runs_ipc else "shm")
                assert cfg.model.path == "/models/m"
                # the end-to-end runs load the same overrides with a max_lag
                load_train_config(DEMO_CONFIG, [*plan.overrides, *w.overrides, "max_lag=2"])
    # On a GPU the 0.5B workload replaces the CPU headline (25M: all per-step overhead there):
    # Qwen2.5-0.5B's shape, 256 samples x 64 new tokens, measured in every part.
    full = gpu_plan(FULL)
    assert full.headline == RANDOM_QWEN05.name and RANDOM_QWEN05 in full.workloads
    assert [w.name for w in full.workloads] == ["demo-1M", "random-100M", RANDOM_QWEN05.name]
    assert RANDOM_QWEN05.engines and gpu_plan(QUICK).headline == QUICK.headline
    head = workload_config(RANDOM_QWEN05, "/models/m", full)
    assert (head.rollout.prompts_per_step * head.rollout.samples_per_prompt,
            head.rollout.max_new_tokens) == (256, 64)
    from cluster.bench.run import SIZE_QWEN05
    assert SIZE_QWEN05 == {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
                           "num_key_value_heads": 2, "intermediate_size": 4864}
    out = gpu_plan(FULL).outside
    shape = workload_config(out, "/models/m", gpu_plan(FULL)).rollout
    assert (shape.prompts_per_step * shape.samples_per_prompt, shape.max_new_tokens) == (256, 64)
    for plan in (FULL, QUICK):
        assert plan.device == "cpu" and not plan.overrides
        for w in plan.workloads:
            assert workload_config(w, "/m", plan) == load_train_config(
                DEMO_CONFIG, [*w.overrides, "model.path=/m"])
    # picked up from actors.weight_sync: without cuda_ipc there, shm and object_store only
    monkeypatch.setattr("actors.weight_sync.TRANSPORTS",
                        {k: t for k, t in TRANSPORTS.items() if k != "cuda_ipc"})
    assert gpu.sync_transports() == ("shm", "object_store") and gpu.run_transport() == "shm"
    assert gpu_plan(FULL).transports == ("shm", "object_store")


def _gpu_parts() -> list[dict]:
    """A GPU bench as four `--only` runs would write it, from the CPU run's figures reshaped
    (made-up figures: these are rendering and merging tests, not measurements)."""
    cpu = json.loads(BENCH_JSON.read_text())
    workloads = {n: w for n, w in copy.deepcopy(cpu["workloads"]).items()  # as gpu_plan's
                 if "lora" not in n and "long-tail" not in n}
    for w in workloads.values():
        if r := w["rollout"]:  # the floor: raw vLLM without log-probs, made up as 0.8 x raw
            r["floor_seconds"] = 0.8 * r["raw_seconds"]
            r |= {"floor_tokens_per_s": r["tokens"] / r["floor_seconds"],
                  "floor_ratio": r["klrl_seconds"] / r["floor_seconds"]}
        if w["pipeline"]:
            p = w["pipeline"]
            runs = {(r["max_lag"], r.get("in_flight", False)): r for r in p["runs"]}
            # the GPU plan's runs: max_lag 0 and 2, then 2 in flight, during which some
            # samples span two versions (the GPU check requires it: nothing in flight on CPU)
            p |= {"reference": "max_lag 0", "cores": 1,
                  "runs": [runs[0, False], runs[2, False],
                           runs[2, True] | {"multi_version_share": 0.05}]}
    cfg = load_train_config(DEMO_CONFIG, list(gpu.gpu_overrides()))
    common = {"headline_workload": "random-25M", "device": "cuda", "dtype": "float32",
              "machine": cpu["machine"] | {"gpu": "NVIDIA H100 80GB HBM3"},
              "split": gpu.gpu_split(cfg), "sync_transports": ["shm", "object_store"],
              "versions": {"klrl": "klrl 0.1.0", "torch": "2.11.0+cu130", "vllm": "0.26.0",
                           "deepspeed": "0.19.8", "ray": "2.60.0", "cuda": "13.0",
                           "driver": "580.65.06"}}

    def part(name, workloads, **extra):
        body = common | {"workloads": workloads, **extra,
                         "parts": {name: {"finished_at": f"2026-12-01 {name}"}},
                         "finished_at": f"2026-12-01 {name}"}
        return summary(workloads, "random-25M", extra.get("outside_engine")) | body

    def only(*keys):
        blank = {"parameters": 0, "trainable_parameters": 0, "rollout": None, "learner": None,
                 "pipeline": None, "weight_sync": [], "learner_memory": None}
        return {n: blank | {k: w[k] for k in keys} for n, w in workloads.items()
                if any(w[k] for k in keys)}

    outside = {"workload": "demo-1M", "prompts": 32, "samples": 256, "new_tokens": 64,
               "tokens": 16384, "reps": 3, "klrl_ms": 180.0, "engine_ms": 165.0,
               "outside_engine_ms": 15.0, "outside_engine_unscored_ms": 11.0,
               "parts_ms": {"requests": 1.5, "scoring": 4.0, "records": 6.0, "ray_trip": 3.5}}
    tests = {"command": "python -m pytest -q -m gpu -rs", "returncode": 0, "timed_out": False,
             "seconds": 95.0, "passed": 5, "failed": 0, "errors": 0, "skipped": 1,
             "skip_reasons": [{"test": "tests.test_weight_sync::test_nccl_sync_gpu",
                               "reason": "nccl weight sync needs two CUDA GPUs "
                                         "(learner + worker)"}],
             "failures": []}
    return [part("engines", only("parameters", "trainable_parameters", "rollout", "learner",
                                 "learner_memory"), outside_engine=outside),
            part("sync", only("parameters", "weight_sync", "learner_memory"), d2d_gb_per_s=1480.0),
            part("e2e", only("pipeline")),
            part("tests", {}, gpu_tests=tests)]


def test_parts_merge_into_one_json_and_the_check_follows_the_parts():
    engines, sync, e2e, tests = _gpu_parts()
    assert check_result(engines) == [] and check_result(e2e) == []
    merged = engines
    for later in (sync, e2e, tests):
        merged = merge(merged, json.loads(json.dumps(later)))  # as read back from the file
    assert list(merged["parts"]) == ["engines", "sync", "e2e", "tests"]
    head = merged["workloads"]["random-25M"]
    assert head["rollout"] and head["learner"] and head["weight_sync"] and head["pipeline"]
    assert head["parameters"] > 0  # a part that did not count them kept the count
    assert merged[OUTSIDE_KEY] == 15.0 and merged["gpu_tests"]["passed"] == 5
    # the headline's rollout against raw vLLM without log-probs, and its tokens/s
    assert merged[FLOOR_KEY] == head["rollout"]["floor_ratio"] == pytest.approx(
        head["rollout"]["klrl_seconds"] / (0.8 * head["rollout"]["raw_seconds"]))
    assert merged["generation_tokens_per_s"] == head["rollout"]["klrl_tokens_per_s"]
    assert merged["training_tokens_per_s"] == head["learner"]["klrl_tokens_per_s"]
    assert merged["d2d_gb_per_s"] == 1480.0 and list(merged)[-1] == "finished_at"
    assert set(merged["weight_sync_seconds"]) == {"shm", "object_store"}
    assert "overlap_efficiency_lag2" in merged and "overlap_efficiency_lag1" not in merged
    assert check_result(merged) == []
    # a part measured again replaces its sections and nothing else
    again = copy.deepcopy(sync)
    syncs = again["workloads"]["random-25M"]["weight_sync"]
    again["workloads"]["random-25M"]["weight_sync"] = syncs[:1]
    remerged = merge(merged, summary(again["workloads"], "random-25M", None) | again)
    assert set(remerged["weight_sync_seconds"]) == {"shm", "object_store"}  # other workloads kept
    assert len(remerged["workloads"]["random-25M"]["weight_sync"]) == 1
    assert remerged["workloads"]["random-25M"]["pipeline"] == head["pipeline"]
    with pytest.raises(ValueError, match="cpu"):
        merge(json.loads(BENCH_JSON.read_text()), sync)
    failed = merge(merged, tests | {"gpu_tests": tests["gpu_tests"]
                                    | {"returncode": 1, "failed": 2}})
    assert check_result(failed) == ["gpu_tests (2 failed, 0 errors)"]
    assert check_result({k: v for k, v in merged.items() if k != OUTSIDE_KEY}) == [OUTSIDE_KEY]


def test_the_committed_cpu_json_passes_the_check_of_its_parts():
    """docs/figures/bench.json (no `parts`: the CPU ones) holds every required figure, but
    the 256 x 64 workload's and the floor's where it predates them."""
    assert set(check_result(json.loads(BENCH_JSON.read_text()))) <= {OUTSIDE_KEY, FLOOR_KEY}


def test_junit_report_counts_and_skip_reasons(tmp_path):
    xml = tmp_path / "report.xml"
    xml.write_text(
        '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_a" name="test_ok" time="1.0"/>'
        '<testcase classname="tests.test_a" name="test_skip" time="0">'
        '<skipped type="pytest.skip" message="needs a CUDA GPU">tests/test_a.py:3: needs a CUDA GPU'
        '</skipped></testcase>'
        '<testcase classname="tests.test_b" name="test_bad" time="2.0">'
        '<failure message="AssertionError: 1 != 2&#10;more">trace</failure></testcase>'
        '<testcase classname="tests.test_b" name="test_err" time="0">'
        '<error message="fixture failed">trace</error></testcase>'
        '</testsuite></testsuites>')
    assert gpu.parse_junit(xml) == {
        "passed": 1, "failed": 1, "errors": 1, "skipped": 1,
        "skip_reasons": [{"test": "tests.test_a::test_skip", "reason": "needs a CUDA GPU"}],
        "failures": [{"test": "tests.test_b::test_bad", "message": "AssertionError: 1 != 2"},
                     {"test": "tests.test_b::test_err", "message": "fixture failed"}]}


def test_a_gpu_json_renders_its_own_tables_into_its_own_block(tmp_path):
    engines, sync, e2e, tests = _gpu_parts()
    result = merge(merge(merge(engines, sync), e2e), tests)
    text = report.markdown(result)
    for expected in (
            ("`klrl bench --device cuda` on NVIDIA H100 80GB HBM3 (driver 580.65.06, "
             "CUDA 13.0)"), "vLLM 0.26.0", "device-to-device copy 1480 GB/s",
            "| device-to-device copy bound s |", "**The rollout's cost outside the engine**",
            "| outside engine, ms per call | raw without log-probs tok/s | x floor |",
            "| publish s/GB | load s/GB |",
            "**Headline** (random-25M, through klrl): generation ",
            "| demo-1M | 16384 | 180 | 165 | **15.0** | **11.0** | 1.5 | 4.0 | 6.0 | 3.5 |",
            "on one GPU)", "Reference (the max_lag 0 run, learner and worker sharing the GPU)",
            "**GPU tests** (`python -m pytest -q -m gpu -rs`): 5 passed, 1 skipped, 0 failed",
            "- skipped: tests.test_weight_sync::test_nccl_sync_gpu: nccl weight sync needs"):
        assert expected in text, expected
    assert "One-core reference" not in text and "| random-25M | 1 |" not in text
    learner_row = next(line for line in text.splitlines() if line.startswith("| learner, "))
    assert learner_row.endswith(" | - | - |")  # no floor for the learner
    # one part alone renders what it has
    alone = report.markdown(sync)
    assert "**Weight sync**" in alone
    assert "End to end" not in alone and "Engine overheads" not in alone
    page = tmp_path / "gpu.md"
    page.write_text("<!-- bench:figures -->\nCPU\n<!-- /bench:figures -->\n"
                    "<!-- bench:gpu -->\nold\n<!-- /bench:gpu -->\n")
    report.write_docs(result, page)
    assert read_block(page.read_text(), "bench:gpu") == text
    assert read_block(page.read_text(), "bench:figures") == "CPU"


def test_the_outside_engine_table_adds_to_the_cpu_rendering_and_changes_nothing_else():
    # The committed CPU JSON without its own outside-engine part, then with another one.
    cpu = {k: v for k, v in json.loads(BENCH_JSON.read_text()).items() if k != "outside_engine"}
    outside = _gpu_parts()[0]["outside_engine"]
    text = report.markdown(cpu | {"outside_engine": outside})
    table = "\n".join(report._outside_table(outside))
    assert table in text and text.replace(table + "\n", "", 1) == report.markdown(cpu)
    assert (text.index("Engine overheads") < text.index("outside the engine**")
            < text.index("Weight sync"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_device_to_device_copy_bound_gpu():
    """GPU only: the sync's bound on CUDA is a timed device-to-device copy of the same bytes."""
    assert gpu.cuda_missing() is None
    small, large = gpu.d2d_copy_seconds(2**20), gpu.d2d_copy_seconds(256 * 2**20)
    assert 0 < small < large < 1.0
    assert gpu.d2d_bytes_per_s() > 1e10  # any CUDA GPU copies well above 10 GB/s


def test_a_json_from_another_machine_is_rendered_into_its_page(tmp_path, capsys):
    """`klrl bench --from-json PATH --docs PAGE`: the JSON `make gpu-check` wrote on a GPU
    machine goes into the page's gpu block here, measuring nothing; options of a measurement
    and files that are no bench JSON are refused in one line."""
    engines, sync, e2e, tests = _gpu_parts()
    result = merge(merge(merge(engines, sync), e2e), tests)
    path = tmp_path / "gpu-check.json"
    path.write_text(json.dumps(result))
    page = tmp_path / "gpu.md"
    page.write_text("intro\n<!-- bench:gpu -->\nnot yet run\n<!-- /bench:gpu -->\n")
    assert main(["bench", "--from-json", str(path), "--docs", str(page)]) == 0
    assert read_block(page.read_text(), "bench:gpu") == report.markdown(result)
    assert "Engine overheads" in capsys.readouterr().out
    assert "--only" in _refused(capsys, ["bench", "--from-json", str(path), "--only", "sync"])
    cpu_page = tmp_path / "bench.md"
    cpu_page.write_text("<!-- bench:figures -->\nx\n<!-- /bench:figures -->\n")
    assert "bench:gpu" in _refused(capsys, ["bench", "--from-json", str(path),
                                            "--docs", str(cpu_page)])
    path.write_text("[1, 2]")
    assert "not a" in _refused(capsys, ["bench", "--from-json", str(path)])
    # a JSON missing a required figure renders, and exits 1 as its run would have
    path.write_text(json.dumps({k: v for k, v in result.items() if k != OUTSIDE_KEY}))
    assert main(["bench", "--from-json", str(path)]) == 1
    assert OUTSIDE_KEY in capsys.readouterr().err
