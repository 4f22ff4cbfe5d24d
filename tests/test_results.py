"""`make results`'s parts: the final checkpoint's evaluation and the base model's (a real vLLM
engine on the tiny model, in a process of its own, as results.py runs it) pair the runs and
the model they started from on the same problems, are skipped once done, and are the
accuracies the findings then compare; their output goes to a log."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from cluster.config.loader import DEMO_CONFIG, dump_config
from cluster.sweeps.final_eval import needs_evaluation
from cluster.analysis.runs import FINAL_EVAL_FILE

XDIST_GROUP = "own-processes"  # its engines run in subprocesses of their own (conftest)


def finished_run(run_dir, model_dir, seed):
    """A finished run directory as the controller leaves it, its final/ model the tiny one."""
    from cluster.config.train_config import load_train_config

    run_dir.mkdir(parents=True)
    cfg = load_train_config(DEMO_CONFIG, [
        f"model.path={model_dir}", f"seed={seed}", "eval.out_of_domain={split: zero_padded}",
        "eval.far_out_of_domain={split: out_of_domain}", "eval.num_problems=5"])
    dump_config(cfg, run_dir / "config.yaml")
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 0}) + "\n")
    shutil.copytree(model_dir, run_dir / "final")
    return run_dir


@pytest.mark.slow
def test_final_checkpoints_and_the_base_model_are_evaluated_on_the_same_problems(
        tiny_model_dir, tmp_path, capsys):
    """Both runs' final checkpoints, then (--base) the model s0 started from, by real engines
    in a process of their own: the same problems whatever the run's training seed, so every
    run and the base model are paired; an evaluation done is skipped."""
    from cluster.sweeps.final_eval import needs_base_evaluation
    from cluster.analysis.runs import BASE_EVAL_FILE

    runs = [finished_run(tmp_path / f"s{seed}", tiny_model_dir, seed) for seed in (0, 1)]
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    sets = ["in_domain", "out_of_domain"]
    assert [needs_evaluation(r, 40, 1, sets) for r in (*runs, unfinished)] == [True, True, False]
    assert needs_base_evaluation(tmp_path, 40, 1, sets)
    cmd = [sys.executable, "-m", "cluster.cli.final_eval", *map(str, runs), "--base",
           "--problems", "40", "--seed", "1", "--sets", "in_domain,out_of_domain"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    records = [json.loads((r / FINAL_EVAL_FILE).read_text()) for r in runs]
    base = json.loads((tmp_path / BASE_EVAL_FILE).read_text())
    assert [r["model"] for r in (*records, base)] == [
        str(runs[0] / "final"), str(runs[1] / "final"), str(tiny_model_dir)]
    for record in (*records, base):
        assert (record["problems"], record["seed"]) == (40, 1)
        assert set(record["sets"]) == {"in_domain", "out_of_domain"}  # not the far one
        assert all(s["problems"] == 40 and 0 <= s["accuracy"] <= 1 for s in record["sets"].values())
    # paired: the same problems in both runs, whatever their training seed, and in the base
    for name in sets:
        assert len({r["sets"][name]["problem_ids_sha256"] for r in (*records, base)}) == 1
    assert not needs_evaluation(runs[0], 40, 1, sets) and needs_evaluation(runs[0], 1000, 1, sets)
    assert needs_evaluation(runs[0], 40, 1, ["in_domain"])  # other sets: evaluated again
    assert not needs_base_evaluation(tmp_path, 40, 1, sets)
    from cluster.cli import final_eval

    capsys.readouterr()  # nothing left to evaluate: in this process, since no engine starts
    assert final_eval.main(cmd[3:]) == 0 and capsys.readouterr().out == ""


def test_a_set_smaller_than_asked_is_evaluated_whole_in_the_final_evaluation():
    """The final evaluation (final_eval.py: whole_when_smaller) takes a split holding fewer
    distinct problems than asked whole (the retained split's 800 facts against the
    pre-registration's 1000), the others on as many as asked; a training run's evaluation
    keeps asking exactly (its config refuses more than a split holds)."""
    import inspect

    from actors.evaluate import problems_of
    from cluster.sweeps import final_eval
    from rewards import get_task

    task = get_task("arithmetic")
    assert problems_of(task, "retained", 1000, True) == 800
    assert problems_of(task, "in_domain", 1000, True) == 1000
    assert problems_of(task, "retained", 1000, False) == 1000  # refused later, by the task
    assert len(task.problems("retained", problems_of(task, "retained", 1000, True), 1)) == 800
    assert "whole_when_smaller=True" in inspect.getsource(final_eval._evaluate)


def test_a_childs_output_goes_to_its_log_and_not_to_the_console(tmp_path, capfd):
    """results.py runs each final evaluation with its output (vLLM's warnings, progress bars)
    in the sweep's logs/RUN.final_eval.log, so the console keeps one line per run."""
    import signal

    from cluster.sweeps.results import _Child, _tail

    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        child = _Child()
        out_log, err_log = tmp_path / "out.log", tmp_path / "err.log"
        assert child.run("cluster.cli.final_eval", "--help", log=out_log) == 0
        assert child.run("json.tool", str(tmp_path / "missing.json"), log=err_log) != 0
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
    assert "--problems" in out_log.read_text()  # stdout
    assert "missing.json" in _tail(err_log)       # stderr, and what a failure prints
    console = capfd.readouterr()
    assert "--problems" not in console.out + console.err
    assert "missing.json" not in console.out + console.err


def test_each_evaluation_says_how_long_the_rest_will_take(tmp_path, capsys):
    """make results prints, after each final evaluation's accuracies, the evaluations left
    and their time at the mean of those done (sweep_run.time_left); the last says nothing more."""
    from cluster.analysis.prereg import Rules
    from cluster.sweeps.results import _final_eval

    class Done:  # a child that has written its record: what a finished final_eval.py leaves
        signalled = None

        def run(self, *args, log=None):
            record.write_text(json.dumps({"sets": {"in_domain": {"accuracy": 0.5,
                                                                 "problems": 40}}}))
            return 0

    record, took = tmp_path / FINAL_EVAL_FILE, []
    for left in (2, 1, 0):
        assert _final_eval(Done(), "run", tmp_path, record, tmp_path / "logs" / "r.log",
                           Rules(), took=took, left=left) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    assert len(took) == 3 and "; 2 to go, about " in lines[0] and "; 1 to go" in lines[1]
    assert lines[2] == "  in_domain 0.500 (40 problems)"
