"""`klrl init-model` and `klrl eval`: build the embedded default model, evaluate a model."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from cluster.cli.arg_types import number_in, whole_in
from cluster.tiny.model import (
    BUILD_TIME,
    RECIPES,
    TARGET_ACCURACY,
    check_out_dir,
    init_default_model,
    read_metadata,
)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "init-model",
        help="build (or reuse) the warm-started tiny default model",
        description="Build the tiny Qwen2 + character tokenizer, warm-started by a "
        "supervised run on the arithmetic task that stops when the greedy accuracy on a "
        f"validation set reaches a target ({BUILD_TIME}). Cached with its "
        "figures: a second call prints them without rebuilding, unless --force.",
    )
    p.add_argument("--out", default=None, help="output directory "
                   "(default: $KLRL_HOME/models/tiny-arith-v<recipe>-seed<N>)")
    p.add_argument("--seed", type=int, default=0, help="seed of the build (default 0)")
    p.add_argument("--target", type=number_in(0, 1, low_open=True, high_open=True),
                   default=None, metavar="FRACTION",
                   help="greedy validation accuracy at which the warm start stops (default "
                   f"{TARGET_ACCURACY}; another target is cached under its own name)")
    p.add_argument("--force", action="store_true", help="rebuild even if the model exists")
    p.add_argument("--embedded", choices=sorted(RECIPES), default="arith",
                   help="which embedded model, as model.embedded: arith (default) or "
                   "arith-retain, also taught the multiplication facts of the arithmetic "
                   "task's retained split (docs/model.md)")
    p.set_defaults(func=_init_model)

    p = subparsers.add_parser(
        "eval",
        help="greedy pass@1 and sampled accuracy of a model, through vLLM",
        description="Evaluate MODEL_DIR on the given splits of a task: greedy pass@1 and the "
        "mean reward of K samples per problem (temperature 1 unless --temperature). Prompts "
        "are rendered as training renders them (chat template, system prompt, stop strings).",
    )
    p.add_argument("model_dir", metavar="MODEL_DIR",
                   help="model directory, a LoRA run's adapter (RUN_DIR/final, RUN_DIR/hf/"
                   "step_N: served on its base model), or 'default' for the default model "
                   "(built if missing)")
    p.add_argument("--task", default="arithmetic",
                   help="a task of rewards/ (rewards.TASKS) or a plug-in "
                   "'package.module:TaskClass', as in task.name (default arithmetic)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a task option, as in task.options (repeatable; YAML values, dotted "
                   "keys for mappings), e.g. --option path=fixture for math on klrl's "
                   "small set, --option columns.question=problem")
    p.add_argument("--splits", default="in_domain,out_of_domain",
                   help="comma-separated splits (default in_domain,out_of_domain)")
    p.add_argument("--n", type=whole_in(1), default=200, help="problems per split (default 200)")
    p.add_argument("--samples", type=whole_in(0), default=4,
                   help="samples per problem at temperature 1; 0 for greedy only (default 4)")
    p.add_argument("--seed", type=int, default=0, help="seed of problems and sampling")
    p.add_argument("--max-tokens", type=whole_in(1), default=None,
                   help="completion budget (default: the task's)")
    p.add_argument("--temperature", type=number_in(0), default=1.0,
                   help="temperature of the sampled completions (default 1.0)")
    p.add_argument("--top-p", type=number_in(0, 1, low_open=True), default=1.0,
                   help="top-p of the sampled completions, in (0, 1]")
    p.add_argument("--top-k", type=whole_in(0), default=0,
                   help="top-k of the sampled completions (0: off, else at least 1)")
    p.add_argument("--chat-template", choices=("auto", "none"), default="auto",
                   help="auto: apply the tokenizer's chat template when it has one (default); "
                   "none: raw text prompts")
    p.add_argument("--system-prompt", default=None, help="system message (needs a chat template)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop string (repeatable)")
    p.add_argument("--max-malformed-fraction", type=number_in(0, 1), default=0.0, metavar="SHARE",
                   help="share of a local dataset file's rows that may be malformed (skipped, "
                   "and said) before the evaluation is refused, as task.max_malformed_fraction "
                   "(default 0)")
    p.add_argument("--reward", default=None, metavar="MODULE:FUNCTION",
                   help="a plug-in scorer, as task.reward: every completion is scored by it "
                   "too, and the table adds its greedy and sampled mean reward (accuracy stays "
                   "the task scorer's)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the result as "
                   "JSON, with every problem's completions and their rewards (records)")
    p.add_argument("--log", default=None, metavar="PATH", help="where other programs' output "
                   "(vLLM, Triton, warnings) goes, kept (default: a temporary file, removed "
                   "unless the evaluation fails)")
    p.add_argument("--verbose", action="store_true", help="show other programs' output here "
                   "instead")
    p.set_defaults(func=_eval)


def _check_task(args: argparse.Namespace):
    """(the task built with its --option values, the splits `klrl eval` asks for), after
    checking the task takes those options and has those splits, each holding --n problems
    (the task registry's rules; a plug-in task is imported here, as a training run's
    pre-flight imports it): a typo fails here, in one line, not after vLLM has started."""
    from cluster.config.loader import parse_overrides
    from rewards.config import build_named

    splits = [s.strip() for s in args.splits.split(",") if s.strip()]
    options = parse_overrides(args.option)  # ConfigError (a ValueError) names a bad one
    task = build_named("--task", args.task, "--option", options)  # the flag at fault named
    if not splits:
        raise ValueError(f"--splits: no split given; task {args.task!r} has "
                         f"{', '.join(task.splits)}")
    for split in splits:
        try:
            task.check_split(split)
        except ValueError as exc:
            raise ValueError(f"--splits: {exc}") from None
        try:
            task.check_count(split, args.n)
        except ValueError as exc:
            raise ValueError(f"--n: {exc}") from None
    return task, splits


def _init_model(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console()
    target = TARGET_ACCURACY if args.target is None else args.target
    if args.out is not None:  # before the build: a wrong --out is refused, never replaced
        from cluster.train.door.paths import check_creatable

        try:
            check_out_dir(Path(args.out))
        except ValueError as exc:
            print(f"error: --out: {exc}", file=sys.stderr)
            return 2
        try:
            check_creatable(Path(args.out), "--out")
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    path = init_default_model(args.out, seed=args.seed, force=args.force, target=target,
                              recipe=args.embedded)
    meta = read_metadata(path)
    console.print(f"[bold]embedded model {args.embedded}:[/bold] {path}")
    _print_metadata(console, path, meta)
    return 0


def _print_metadata(console, path, meta: dict) -> None:
    from rich.table import Table

    size_mb = sum(f.stat().st_size for f in path.iterdir() if f.is_file()) / 1e6
    table = Table(show_header=False)
    table.add_row("parameters", f"{meta.get('parameters', 0):,}")
    table.add_row("size on disk", f"{size_mb:.1f} MB")
    table.add_row("build time", f"{meta.get('build_seconds', float('nan'))} s "
                  f"({meta.get('torch_threads')} torch threads)")
    target = meta.get("target_accuracy")
    goal = "fixed budget" if target is None else (
        f"stopped at {100 * meta.get('validation_accuracy', 0):.1f}% greedy validation "
        f"({meta.get('validation_problems')} problems; target {100 * target:.0f}%"
        + ("" if meta.get("reached_target", True) else ", NOT reached: step bound") + ")")
    table.add_row("warm-start",
                  f"{meta.get('sft_steps')} SFT steps x {meta.get('sft_batch_size')}, " + goal)
    if "retained_accuracy" in meta:
        table.add_row("retained facts", f"{100 * meta['retained_share']:.0f}% of each batch; "
                      f"stopped at {100 * meta['retained_accuracy']:.1f}% greedy (target "
                      f"{100 * meta['retained_target']:.0f}%)")
    for split, acc in meta.get("greedy_accuracy_hf", {}).items():
        table.add_row(f"greedy {split}", f"{100 * acc:.1f}% (HF, "
                      f"{meta.get('eval_problems_per_split')} problems)")
    console.print(table)


def _eval_door(args: argparse.Namespace):
    """`klrl eval`'s door (cluster/train/door/), before vLLM or the model: the task takes its
    options and has the splits, --reward imports as a scorer, MODEL_DIR is a model or a LoRA
    adapter on one here (not a run directory or a checkpoint: the refusal names the model to
    give; cluster/cli/eval_target.py), and the local dataset files of those splits read
    within --max-malformed-fraction. Returns (task, splits, target); ValueError (ConfigError)
    otherwise."""
    from cluster.cli.eval_target import eval_target
    from rewards.config import check_task_datasets

    task, splits = _check_task(args)
    if args.reward:
        from rewards import load_scorer

        try:
            load_scorer(args.reward)  # imported and checked here, as the pre-flight does
        except ValueError as exc:
            raise ValueError(f"--reward: {exc}") from None
    from cluster.train.door.paths import check_writable_file

    target = eval_target(args.model_dir)
    for flag, path in (("--json", args.json), ("--log", args.log)):
        if path is not None:
            check_writable_file(Path(path), flag)
    for note in check_task_datasets("--option", task, splits, args.max_malformed_fraction,
                                    "--max-malformed-fraction"):
        print(f"warning: {note}", file=sys.stderr, flush=True)
    return task, splits, target


def _eval(args: argparse.Namespace) -> int:
    # vLLM logs at INFO by default; keep the table readable unless asked otherwise.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        task, splits, target = _eval_door(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from cluster.cli.eval_run import run_eval

    model = init_default_model() if target.model == "default" else target.model
    return run_eval(args, task, splits, target, str(model))
