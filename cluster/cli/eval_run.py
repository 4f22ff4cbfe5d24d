"""Running `klrl eval` once its door has passed (cmd_model.py): the engine (a LoRA adapter is
served on its base model, `eval_target`), other programs' output sent to a log as `klrl
train` sends it (cluster/train/run_output.py), the table (its full width when piped: rich
would squeeze it to 80 columns) and the JSON, with every completion."""
from __future__ import annotations

import atexit
import os
import sys
import tempfile
import traceback
from contextlib import nullcontext
from pathlib import Path

from cluster.cli.eval_target import EvalTarget
from cluster.train.error_line import error_line

PIPED_WIDTH = 200  # columns of the table when stdout is no terminal (a file, a pipe, a test)


def run_eval(args, task, splits, target: EvalTarget, model: str) -> int:
    """Evaluate `model` (target.model, 'default' already built) with target's adapter, print
    the table, write --json; returns the exit code."""
    from cluster.train.run_output import quiet_output

    if args.log:
        log = Path(args.log)
    else:
        fd, name = tempfile.mkstemp(prefix="klrl-eval-", suffix=".log")
        os.close(fd)
        log = Path(name)
    if not args.verbose:
        print(f"other programs' output (vLLM, Triton, warnings) goes to {log} (--verbose shows "
              "it here)", flush=True)
    error: Exception | None = None
    with nullcontext() if args.verbose else quiet_output(log):
        try:
            result = _evaluate(args, task, splits, target, model)
        except AssertionError:  # a broken invariant is a bug in klrl: its whole traceback
            raise
        except Exception as exc:  # noqa: BLE001 - any failure after the start: one line
            traceback.print_exc()  # the whole story, into the log
            error = exc
    if error is not None:
        print(f"error: the evaluation failed: {error_line(error)}"
              + ("" if args.verbose else f" (full output: {log})"), file=sys.stderr, flush=True)
        if not args.verbose:
            atexit.register(_exit_output_to, log)
        return 1
    if not args.log:
        log.unlink(missing_ok=True)
    _print_table(args, result, target)
    if args.json:
        with open(args.json, "w") as f:
            f.write(result.model_dump_json(indent=2) + "\n")
    return 0


def _exit_output_to(log: Path) -> None:
    """fd 2 to `log` while the interpreter exits (atexit runs before the modules are torn
    down): an engine that failed was never shut down, and Triton's bindings then report the
    objects it leaked, some thirty lines that belong in the log, not after the error line."""
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 2)
    os.close(fd)


def _evaluate(args, task, splits, target: EvalTarget, model: str):
    from actors.engine import make_llm, shutdown_llm
    from actors.evaluate import evaluate  # vLLM: only once the door has let the model in
    from actors.prompting import PromptRenderer

    renderer = PromptRenderer.from_pretrained(
        model, chat_template=args.chat_template, system_prompt=args.system_prompt, stop=args.stop)
    common = {"n": args.n, "samples": args.samples, "seed": args.seed,
              "max_tokens": args.max_tokens, "temperature": args.temperature,
              "top_p": args.top_p, "top_k": args.top_k, "renderer": renderer,
              "reward": args.reward, "keep_completions": bool(args.json)}
    if target.adapter is None:
        return evaluate(str(model), task, splits, dtype=target.dtype, **common)
    from actors import lora_serving

    llm = make_llm(str(model), seed=args.seed, dtype=target.dtype,
                   **lora_serving.engine_options(target.rank))
    try:
        result = evaluate(lora_serving.serving(llm, target.adapter), task, splits, **common)
    finally:
        shutdown_llm(llm)
    return result.model_copy(update={"model": str(target.adapter)})


def _print_table(args, result, target: EvalTarget) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:  # rich's default off a terminal (or TERM=dumb) is 80 columns
        console = Console(width=int(os.environ.get("COLUMNS") or PIPED_WIDTH), height=25)
    title = f"{result.task} - {result.model}" + (
        f" (LoRA adapter on {target.model})" if target.adapter else "")
    table = Table(title=title)
    sampled = args.samples > 0  # --samples 0: greedy only, no sampled columns to fill
    reward_cols = ("greedy reward", *(("sampled reward",) if sampled else ())) \
        if args.reward else ()
    sample_cols = (f"sampled acc (K={args.samples}, T={args.temperature:g})",
                   f"pass@{args.samples}") if sampled else ()
    for col in ("split", "problems", "greedy pass@1", *sample_cols, *reward_cols, "failures",
                "truncated"):
        if col == "split":  # never truncate the split name, whatever the terminal width
            table.add_column(col, justify="left", no_wrap=True, min_width=13)
        else:
            table.add_column(col, justify="right")
    for r in result.splits.values():
        table.add_row(
            r.split, str(r.problems), f"{100 * r.greedy_accuracy:.1f}%",
            *(("-" if r.sampled_accuracy is None else f"{100 * r.sampled_accuracy:.1f}%",
               "-" if r.pass_at_k is None else f"{100 * r.pass_at_k:.1f}%") if sampled else ()),
            *([_mean_reward(r.greedy_reward)] if args.reward else []),
            *([_mean_reward(r.sampled_reward)] if args.reward and sampled else []),
            str(r.failures), str(r.truncated),
        )
    console.print(table)
    console.print(f"{result.seconds:.1f} s")


def _mean_reward(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
