"""The final checkpoint's evaluation: a finished run's final/ model on `problems` problems per
evaluation set (a set that holds fewer, whole: the retained split's 800 facts), greedy, the
same problems in every run (`seed` fixes them), written to RUN/final_eval.json, whose
accuracies the findings compare (measures.final_accuracy).

The sets, their tasks, the prompts and the completion budget are the run's own (its
config.yaml), and the evaluation is the trainer's (`actors.evaluate.evaluate_sets`) on an
engine built as the run's rollout workers build theirs, so it measures what the run's last
evaluation measured, on more problems. One run per process (`python -m
cluster.experiments.final_eval RUN_DIR ...`, as results.py calls it): an engine's crash or
leftover threads end with the process.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from cluster.experiments.runs import FINAL_EVAL_FILE
from cluster.train.run_log import config_path, final_dir, is_finished
from rewards.config import EVAL_SETS

OPTIONAL_SETS = tuple(s for s in EVAL_SETS if s != "in_domain")  # every set but in_domain


def needs_evaluation(run_dir: Path, problems: int, seed: int, sets: Sequence[str]) -> bool:
    """A finished run without a final evaluation of these problems and sets."""
    path = run_dir / FINAL_EVAL_FILE
    if not is_finished(run_dir):
        return False
    if not path.is_file():
        return True
    done = json.loads(path.read_text())
    return (done.get("problems"), done.get("seed"), done.get("asked")) \
        != (problems, seed, sorted(sets))


def evaluate_final(run_dir: Path, problems: int, seed: int, sets: Sequence[str]) -> Path:
    """Evaluate run_dir's final/ model on `sets` (those of them the run evaluates) and write
    final_eval.json; returns its path."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from actors.engine import make_llm, shutdown_llm
    from actors.evaluate import evaluate_sets
    from actors.prompting import PromptRenderer
    from actors.rollout_worker import engine_options
    from cluster.config.train_config import load_train_config

    cfg = load_train_config(config_path(run_dir))
    options = engine_options(cfg.worker_rollout, cfg.sync, cfg.seed,
                             trust_remote_code=cfg.model.trust_remote_code)
    options.pop("weight_transfer_config", None)  # nothing is transferred into this engine
    llm = make_llm(str(final_dir(run_dir)), **options)
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
              "max_tokens": report.max_tokens,
              "sets": {name: {"accuracy": r.greedy_accuracy, "problems": r.problems,
                              "truncated": r.truncated,
                              # the same digest in every run: the same problems, paired
                              "problem_ids_sha256": hashlib.sha256(
                                  "\n".join(r.problem_ids).encode()).hexdigest()}
                       for name, r in report.sets.items()}}
    path = run_dir / FINAL_EVAL_FILE
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(record, indent=1) + "\n")
    partial.replace(path)  # a half-written record is never read as a result
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cluster.experiments.final_eval",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--problems", type=int, required=True, help="problems per evaluation set")
    p.add_argument("--seed", type=int, required=True, help="seed of the problems")
    p.add_argument("--sets", default="in_domain,out_of_domain",
                   help="comma-separated evaluation sets (default in_domain,out_of_domain)")
    args = p.parse_args(argv)
    sets = [s for s in args.sets.split(",") if s]
    for run_dir in map(Path, args.run_dirs):
        if needs_evaluation(run_dir, args.problems, args.seed, sets):
            print(f"{run_dir.name}: {evaluate_final(run_dir, args.problems, args.seed, sets)}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
