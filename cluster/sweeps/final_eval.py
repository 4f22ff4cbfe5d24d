"""The final checkpoint's evaluation: a finished run's final/ model on `problems` problems per
evaluation set (a set that holds fewer, whole: the retained split's 800 facts), greedy, the
same problems in every run (`seed` fixes them), written to RUN/final_eval.json, whose
accuracies the findings compare (measures.final_accuracy); and (`--base`) the model the runs
started from, on the same problems, into the sweep directory's base_eval.json, the row every
final accuracy is read against (how much a run gained in-domain, and forgot on `retained`).

The sets, their tasks, the prompts and the completion budget are the run's own (its
config.yaml), and the evaluation is the trainer's (`actors.evaluate.evaluate_sets`) on an
engine built as the run's rollout workers build theirs, so it measures what the run's last
evaluation measured, on more problems. One run per process (`python -m
cluster.cli.final_eval RUN_DIR ...`, as results.py calls it): an engine's crash or
leftover threads end with the process.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

from cluster.analysis.runs import BASE_EVAL_FILE, FINAL_EVAL_FILE
from cluster.train.run_log import config_path, final_dir, is_finished
from rewards.config import EVAL_SETS

OPTIONAL_SETS = tuple(s for s in EVAL_SETS if s != "in_domain")  # every set but in_domain


def _done(path: Path, problems: int, seed: int, sets: Sequence[str]) -> bool:
    """Whether `path` holds an evaluation of these problems and sets."""
    if not path.is_file():
        return False
    done = json.loads(path.read_text())
    return (done.get("problems"), done.get("seed"), done.get("asked")) \
        == (problems, seed, sorted(sets))


def needs_evaluation(run_dir: Path, problems: int, seed: int, sets: Sequence[str]) -> bool:
    """A finished run without a final evaluation of these problems and sets."""
    return is_finished(run_dir) and not _done(run_dir / FINAL_EVAL_FILE, problems, seed, sets)


def needs_base_evaluation(sweep_dir: Path, problems: int, seed: int,
                          sets: Sequence[str]) -> bool:
    """A sweep without its base model's evaluation on these problems and sets."""
    return not _done(sweep_dir / BASE_EVAL_FILE, problems, seed, sets)


def _evaluate(run_dir: Path, model_dir: Path | None, problems: int, seed: int,
              sets: Sequence[str], path: Path) -> Path:
    """Evaluate `model_dir` (None: the run's starting model) with run_dir's config on `sets`
    (those of them the run evaluates) and write the record to `path`."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from actors.engine import make_llm, shutdown_llm
    from actors.evaluate import evaluate_sets
    from actors.prompting import PromptRenderer
    from actors.rollout_worker import engine_options
    from cluster.config.train_config import load_train_config
    from cluster.train.launch import resolve_model

    cfg = load_train_config(config_path(run_dir))
    model_dir = model_dir or resolve_model(cfg)
    options = engine_options(cfg.worker_rollout, cfg.sync, cfg.seed,
                             trust_remote_code=cfg.model.trust_remote_code)
    options.pop("weight_transfer_config", None)  # nothing is transferred into this engine
    llm = make_llm(str(model_dir), **options)
    try:
        report = evaluate_sets(
            llm, cfg.eval.model_copy(update={"num_problems": problems, "samples": 0,
                                             "seed": seed} | {name: None for name in
                                                              OPTIONAL_SETS if name not in sets}),
            cfg.task, default_max_tokens=cfg.rollout.max_new_tokens,
            renderer=PromptRenderer.for_task(llm.get_tokenizer(), cfg.task),
            whole_when_smaller=True)  # retained: its 800 facts, all of them
    finally:
        shutdown_llm(llm)
    record = {"problems": problems, "seed": seed, "asked": sorted(sets), "seconds": report.seconds,
              "max_tokens": report.max_tokens, "model": str(model_dir),
              "sets": {name: {"accuracy": r.greedy_accuracy, "problems": r.problems,
                              "truncated": r.truncated,
                              # the same digest in every run: the same problems, paired
                              "problem_ids_sha256": hashlib.sha256(
                                  "\n".join(r.problem_ids).encode()).hexdigest()}
                       for name, r in report.sets.items()}}
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(record, indent=1) + "\n")
    partial.replace(path)  # a half-written record is never read as a result
    return path


def evaluate_final(run_dir: Path, problems: int, seed: int, sets: Sequence[str]) -> Path:
    """Evaluate run_dir's final/ model; returns the path of its final_eval.json."""
    return _evaluate(run_dir, final_dir(run_dir), problems, seed, sets,
                     run_dir / FINAL_EVAL_FILE)


def evaluate_base(run_dir: Path, problems: int, seed: int, sets: Sequence[str]) -> Path:
    """Evaluate the model run_dir started from, on the same problems, into the sweep
    directory's base_eval.json (what every run's final accuracy is measured against)."""
    return _evaluate(run_dir, None, problems, seed, sets, run_dir.parent / BASE_EVAL_FILE)


def evaluate_runs(run_dirs: Sequence[Path], problems: int, seed: int, sets: Sequence[str],
                  base: bool = False) -> None:
    """Evaluate each run's final/ model not yet evaluated on these problems and sets, printing
    one line a run; with `base`, then the model the first run started from (into its sweep
    directory's base_eval.json) unless it was evaluated on them. The command line is
    cluster/cli/final_eval.py's."""
    for run_dir in run_dirs:
        if needs_evaluation(run_dir, problems, seed, sets):
            print(f"{run_dir.name}: {evaluate_final(run_dir, problems, seed, sets)}", flush=True)
    first = run_dirs[0]
    if base and needs_base_evaluation(first.parent, problems, seed, sets):
        print(f"base: {evaluate_base(first, problems, seed, sets)}", flush=True)
