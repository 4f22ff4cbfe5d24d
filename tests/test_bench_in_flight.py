"""`klrl bench`'s in-flight weight-update runs without running one: the plans (which max_lags
run in flight, the long-tail workload end to end only), the per-run figures and the speed-up
(PipelineResult), the top-level keys, the check of a result, the merge of parts, the
rendering, and the long-tail model's end-of-sequence probability. The figures of the
synthetic runs are made up: these test the arithmetic and the rendering, not a machine."""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest

from cluster.bench import report
from cluster.bench.pipeline import STEP_MEANS, LagRun, PipelineResult, step_mean
from cluster.bench.results import check_result, merge, summary

ROOT = Path(__file__).resolve().parents[1]
BENCH_JSON = ROOT / "docs" / "figures" / "bench.json"


def _run(lag: int, step_s: float, in_flight: bool = False, idle: float | None = 0.4) -> LagRun:
    return LagRun(max_lag=lag, steps=3, step_seconds=step_s, samples_per_step=32,
                  gen_seconds=0.5, train_seconds=1.0, engine_gen_seconds=0.4,
                  in_flight=in_flight, engine_idle_share=idle, token_lag_mean=lag * 0.7,
                  multi_version_share=0.3 if in_flight else 0.0,
                  preempted=6.0 if in_flight else 0.0, response_tokens_mean=25.0,
                  response_tokens_max=110.0)


def _pipeline() -> PipelineResult:
    p = PipelineResult("w", _run(0, 2.0), cores=2)
    # in flight at max_lag 2 is the fastest run: best_lag stays a batch-level one
    p.runs += [_run(0, 2.0), _run(1, 1.6), _run(2, 1.5), _run(1, 1.4, True, 0.2),
               _run(2, 1.0, True, 0.1)]
    return p


def test_in_flight_runs_get_the_bound_and_a_speed_up_over_their_batch_level_run():
    p = _pipeline()
    assert p.run(2).step_seconds == 1.5 and p.run(2, in_flight=True).step_seconds == 1.0
    assert p.in_flight_speedup(2) == pytest.approx(1.5 / 1.0)
    assert p.in_flight_speedup(1) == pytest.approx(1.6 / 1.4)
    assert p.in_flight_speedup(0) is None  # no in-flight run at max_lag 0
    assert p.best_lag == 2  # batch-level
    d = p.to_dict()
    # the bound: the reference's work of one step spread over the 2 cores; the ideal above
    # max_lag 0: one step's samples over the longer of the two phases (pipeline.py)
    assert d["bound_samples_per_s"] == pytest.approx(2 * 32 / (0.5 + 1.0))
    assert p.ideal_samples_per_s(1) == pytest.approx(32 / 1.0) == p.ideal_samples_per_s(2, True)
    assert p.efficiency(1) == pytest.approx((32 / 1.6) / 32.0)
    flying = [r for r in d["runs"] if r["in_flight"]]
    assert [r["max_lag"] for r in flying] == [1, 2]
    for r in d["runs"]:
        assert r["of_bound"] == pytest.approx(r["samples_per_s"] / d["bound_samples_per_s"])
        assert set(STEP_MEANS) <= set(r)
        assert ("in_flight_speedup" in r) == r["in_flight"]
    assert flying[1]["in_flight_speedup"] == pytest.approx(1.5)
    # the means of a step metric skip the steps that did not log it, None where none did
    assert step_mean([{"a": 1.0}, {}, {"a": 0.0}], "a") == 0.5
    assert step_mean([{}, {"a": None}], "a") is None


def _before_in_flight() -> dict:
    """The committed CPU bench as a JSON from before in-flight runs has it: batch-level runs
    only, without their in_flight flag, and none of the figures that came with them (the
    in-flight keys, the engines' idle shares)."""
    result = json.loads(BENCH_JSON.read_text())
    for w in result["workloads"].values():
        if w.get("pipeline"):
            w["pipeline"]["runs"] = [{k: v for k, v in r.items() if k != "in_flight"}
                                     for r in w["pipeline"]["runs"] if not r.get("in_flight")]
    return {k: v for k, v in result.items()
            if not k.startswith(("in_flight_", "engine_idle_share_"))}


def _result_with_in_flight() -> dict:
    """The committed CPU bench with made-up engine figures and in-flight runs on the
    headline's pipeline."""
    result = _before_in_flight()
    head = result["workloads"][result["headline_workload"]]["pipeline"]
    for r in head["runs"]:
        r |= {"in_flight": False, "engine_idle_share": 0.5, "token_lag_mean": r["max_lag"],
              "multi_version_share": 0.0, "preempted": 0.0, "response_tokens_mean": 30.0,
              "response_tokens_max": 32.0}
    for lag in (1, 2):
        off = next(r for r in head["runs"] if r["max_lag"] == lag)
        head["runs"].append(off | {"in_flight": True, "samples_per_s": 1.25 * off["samples_per_s"],
                                   "engine_idle_share": 0.05, "multi_version_share": 0.4,
                                   "preempted": 3.5,
                                   "in_flight_speedup": 1.25})
    return summary(result["workloads"], result["headline_workload"],
                   result.get("outside_engine")) | result


def test_top_level_keys_and_check_of_a_result_with_in_flight_runs():
    result = _result_with_in_flight()
    for lag in (1, 2):
        assert result[f"in_flight_speedup_lag{lag}"] == pytest.approx(1.25)
        assert result[f"in_flight_engine_idle_share_lag{lag}"] == 0.05
    assert {result[f"engine_idle_share_lag{lag}"] for lag in (0, 1, 2)} == {0.5}
    # of_bound and overlap efficiency stay the batch-level runs' (the committed figures)
    committed = json.loads(BENCH_JSON.read_text())
    for key in ("of_bound_best_lag", "overlap_efficiency_lag1", "overlap_efficiency_lag2"):
        assert result[key] == committed[key]
    assert check_result(result) == []
    broken = copy.deepcopy(result)
    broken["in_flight_engine_idle_share_lag2"] = 1.5
    del broken["engine_idle_share_lag0"]
    broken["in_flight_speedup_lag1"] = math.nan
    assert set(check_result(broken)) == {"in_flight_engine_idle_share_lag2",
                                         "engine_idle_share_lag0", "in_flight_speedup_lag1"}
    # a JSON from before in-flight runs asks for none of their figures; the committed one
    # (with them) passes its check
    assert check_result(_before_in_flight()) == [] and check_result(committed) == []
    # --only e2e into a file of other parts: the in-flight keys are derived again
    old = {k: v for k, v in committed.items() if not k.startswith("overlap_efficiency")}
    e2e = {"device": "cpu", "headline_workload": result["headline_workload"],
           "workloads": {result["headline_workload"]: {
               "pipeline": result["workloads"][result["headline_workload"]]["pipeline"]}},
           "parts": {"e2e": {"finished_at": "later"}}, "finished_at": "later"}
    merged = merge(old, e2e)
    assert merged["in_flight_speedup_lag2"] == pytest.approx(1.25)
    assert merged["overlap_efficiency_lag2"] == committed["overlap_efficiency_lag2"]


def test_in_flight_rows_render_beside_the_batch_level_ones():
    result = _result_with_in_flight()
    page = report.markdown(result)
    head = result["headline_workload"]
    assert f"| {head} | 2, in flight | " in page and f"| {head} | 1, in flight | " in page
    table = page[page.index("**In-flight weight updates**"):].splitlines()
    rows = [line for line in table if line.startswith(f"| {head} |")]
    assert len(rows) == 2 and all("| **1.25** |" in row for row in rows), rows
    assert all("| 50% | 5% |" in row and "| 40% |" in row for row in rows), rows
    # JSONs from before in-flight runs: no in-flight table
    assert "In-flight" not in report.markdown(_before_in_flight())


def test_the_plans_run_in_flight_where_a_batch_level_run_shares_the_max_lag():
    from cluster.bench.run import FULL, LONG_TAIL, QUICK, BenchPlan, gpu_plan, workload_config

    assert FULL.in_flight_lags == (1, 2) and QUICK.in_flight_lags == ()
    assert gpu_plan(FULL).in_flight_lags == gpu_plan(QUICK).in_flight_lags == (2,)
    assert LONG_TAIL in FULL.workloads and LONG_TAIL not in gpu_plan(FULL).workloads
    # the long-tail workload runs end to end only
    assert LONG_TAIL.measured(["e2e"]) and not LONG_TAIL.measured(["engines", "sync"])
    cfg = workload_config(LONG_TAIL, "/m", FULL)
    assert cfg.rollout.max_new_tokens == 128 and not cfg.learner.lora
    with pytest.raises(ValueError, match="in_flight_lags"):
        BenchPlan(workloads=(), headline="x", engine_reps=1, sync_reps=1, measured_steps=1,
                  lags=(0, 2), in_flight_lags=(1,))
    with pytest.raises(ValueError, match="in_flight_lags"):
        BenchPlan(workloads=(), headline="x", engine_reps=1, sync_reps=1, measured_steps=1,
                  lags=(0, 2), in_flight_lags=(0,))


@pytest.mark.slow  # transformers' model import and two model builds: seconds on a loaded CPU
def test_the_long_tail_model_ends_a_response_with_about_the_asked_probability(tmp_path):
    """At every position of random sequences the end-of-sequence token has about the asked
    probability (within a fifth), where the tiny random model as built gives it about one
    in 260 (its byte vocabulary)."""
    import torch
    from transformers import AutoModelForCausalLM

    from cluster.bench.long_tail import build_long_tail_model
    from cluster.tiny.model import build_random_model

    ids = torch.randint(4, 260, (4, 48), generator=torch.Generator().manual_seed(3))

    def eos_probs(path):
        model = AutoModelForCausalLM.from_pretrained(str(path))
        with torch.no_grad():
            return torch.softmax(model(ids).logits, -1)[..., model.config.eos_token_id]

    plain = eos_probs(build_random_model(tmp_path / "plain", seed=0))
    assert 0.5 / 260 < float(plain.mean()) < 2 / 260
    tail = eos_probs(build_long_tail_model(tmp_path / "tail", 1 / 24, seed=0))
    assert 0.8 / 24 < float(tail.min()) and float(tail.max()) < 1.2 / 24, (tail.min(), tail.max())


def _with_lag2_in_flight(result: dict, **figures) -> dict:
    """`result` with its in-flight max_lag 2 run's `figures` replaced, summarised again."""
    changed = copy.deepcopy(result)
    head = changed["workloads"][changed["headline_workload"]]["pipeline"]
    for r in head["runs"]:
        if r["in_flight"] and r["max_lag"] == 2:
            r |= figures
    return summary(changed["workloads"], changed["headline_workload"],
                   changed.get("outside_engine")) | {
        k: v for k, v in changed.items() if not k.startswith("in_flight_")}


def _lag2_in_flight_row(result: dict) -> str:
    page = report.markdown(result)
    table = page[page.index("**In-flight weight updates**"):].splitlines()
    [row] = [line for line in table if line.startswith(f"| {result['headline_workload']} | 2 |")]
    return row


def test_an_in_flight_run_with_nothing_in_flight_says_so_and_fails_the_gpu_check():
    """An in-flight run whose samples never spanned two versions measured no in-flight update
    (every update found the engine idle, or only requests that had sampled nothing): its row
    says so, the summary keeps both figures per max_lag, and on a GPU, where that is what the
    in-flight run is for, the check names it, preemptions or not (a request preempted before
    its first token spans one version: preemptions alone do not show tokens sampled across
    an update)."""
    result = _result_with_in_flight()
    assert result["in_flight_multi_version_share_lag2"] == 0.4
    assert result["in_flight_preempted_lag2"] == 3.5
    assert "| 40% | 3.5 |" in _lag2_in_flight_row(result)
    idle = _with_lag2_in_flight(result, multi_version_share=0.0, preempted=0.0)
    assert idle["in_flight_multi_version_share_lag2"] == idle["in_flight_preempted_lag2"] == 0.0
    assert "| 0%: nothing was in flight | 0.0 |" in _lag2_in_flight_row(idle)
    assert check_result(idle) == []  # on CPU a figure like any other (docs/bench.md)
    gpu = idle | {"device": "cuda"}
    assert check_result(gpu) == ["in_flight_multi_version_share_lag2"]
    assert check_result(result | {"device": "cuda"}) == []
    preempted_only = _with_lag2_in_flight(result, multi_version_share=0.0, preempted=2.0)
    assert "| 0% | 2.0 |" in _lag2_in_flight_row(preempted_only)
    assert check_result(preempted_only | {"device": "cuda"}) == [
        "in_flight_multi_version_share_lag2"]


def test_without_a_reference_run_the_runs_are_reported_and_no_bound_is_asked_for():
    """`klrl bench --quick` runs no reference (pipeline.py): its runs' figures are kept, the
    bound, ideal and efficiency are None in the JSON, left out of the top-level keys, not
    required by the check, and printed as n/a."""
    with pytest.raises(ValueError, match="reference"):
        PipelineResult("w", _run(0, 2.0), cores=2, reference="none")
    with pytest.raises(ValueError, match="reference"):
        PipelineResult("w", None, cores=2)
    p = PipelineResult("w", None, cores=2, reference="none")
    p.runs.append(_run(2, 1.5))
    d = p.to_dict()
    assert d["reference"] == "none" and d["best_lag"] == 2
    assert d["bound_samples_per_s"] is d["t_gen_seconds"] is d["one_core_samples_per_s"] is None
    [r] = d["runs"]
    assert r["samples_per_s"] == pytest.approx(32 / 1.5) and r["token_lag_mean"] == 1.4
    assert r["ideal_samples_per_s"] is r["overlap_efficiency"] is r["of_bound"] is None
    result = _before_in_flight()
    result["workloads"][result["headline_workload"]]["pipeline"] = d
    result = {k: v for k, v in result.items() if not k.startswith(("of_bound", "overlap_eff"))}
    result |= summary(result["workloads"], result["headline_workload"],
                      result.get("outside_engine"))
    assert not any(k.startswith(("of_bound", "overlap_efficiency")) for k in result)
    assert check_result(result) == []
    page = report.markdown(result)
    assert f"| {result['headline_workload']} | 2 | **21.3** | n/a | n/a | n/a | n/a |" in page
    assert f"{result['headline_workload']}: none run (--quick)" in page
    # with the reference, the same result missing its efficiency fails the check
    d["reference"] = "one-core"
    assert check_result(result) == ["overlap_efficiency_lag2"]
