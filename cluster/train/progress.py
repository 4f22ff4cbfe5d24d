"""Training progress people can read anywhere.

On a terminal: a rich progress bar with step, reward, KL, lag and eval accuracy, and a line
above it for each evaluation (also in the run's train.log). Anywhere else
(`ray job submit` logs, `klrl submit`, a sweep's log files, CI) a live display would only appear
once, at the end, so plain lines are printed instead: one every `every` steps (step, reward,
KL, lag, s/step, ETA) and one per evaluation.
"""
from __future__ import annotations

import math
import time

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from cluster.train.run_log import final_dir, read_config, read_metrics
from rewards.config import EVAL_SETS


# What an evaluation line and the summary show of each set: the task scorer's accuracies,
# then (a run with task.reward) the plug-in's mean rewards on the same completions.
ACCURACY_KINDS = (("greedy", "accuracy"), ("sampled", "sampled_accuracy"),
                  ("reward", "reward"), ("sampled reward", "sampled_reward"))


def default_every(total_steps: int) -> int:
    """About 20 plain lines per run, and at least one every 50 steps."""
    return max(1, min(50, math.ceil(total_steps / 20)))


class TrainProgress:
    def __init__(self, total_steps: int, start_step: int = 0, every: int | None = None,
                 live: bool | None = None):
        self.total, self.start = total_steps, start_step
        self.every = every or default_every(total_steps)
        self.live = Console().is_terminal if live is None else live
        self._t0 = time.monotonic()
        self._acc = ""
        if self.live:
            self._progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[status]}"))
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step,
                                                 status="")

    def show_evaluation(self, step: int, metrics: dict) -> None:
        """An evaluation logged outside a training step (the step-0 one): its line, and its
        accuracy in the status that follows."""
        self._remember_accuracy(metrics)
        self._print_evaluation(step, metrics)

    def _print_evaluation(self, step: int, metrics: dict) -> None:
        """Its own line, on a terminal above the live bar: the rich console writes to
        sys.stdout, which `klrl train` copies into train.log (run_output.py)."""
        if line := eval_line(step, metrics):
            if self.live:
                self._progress.console.print(line, markup=False, highlight=False)
            else:
                print(line, flush=True)

    def _remember_accuracy(self, metrics: dict) -> None:
        if "eval/in_domain/accuracy" in metrics:
            self._acc = f" acc {metrics['eval/in_domain/accuracy']:.3f}"

    def update(self, step: int, metrics: dict) -> None:
        self._remember_accuracy(metrics)
        status = (f"reward {metrics.get('reward/mean', math.nan):.3f} "
                  f"kl {metrics.get('kl/pi_ref', math.nan):.4f} lag {metrics.get('lag/max', 0)}"
                  f"{self._acc}{episode_status(metrics)}")
        if self.live:
            self._progress.update(self._task, completed=step, status=status)
        elif step % self.every == 0 or step == self.total:
            done = step - self.start
            per_step = (time.monotonic() - self._t0) / done if done else math.nan
            eta = per_step * (self.total - step)
            print(f"step {step}/{self.total} {status} | {per_step:.2f} s/step "
                  f"eta {format_duration(eta)}", flush=True)
        self._print_evaluation(step, metrics)  # live or not: every evaluation has its line

    def __enter__(self):
        if self.live:
            self._progress.__enter__()
        return self

    def __exit__(self, *exc):
        return self._progress.__exit__(*exc) if self.live else False


def episode_status(metrics: dict) -> str:
    """A multi-turn run's turns per sample, tool-call rate and the run's environment failures
    (cluster/train/episodes.py); '' for a single-turn run."""
    if "env/turns_mean" not in metrics:
        return ""
    failures = metrics.get("env/failures_total", 0)
    return (f" turns {metrics['env/turns_mean']:.2f} tools {metrics['env/tool_call_rate']:.2f}"
            + (f" env-failures {failures:.0f}" if failures else ""))


def eval_line(step: int, metrics: dict) -> str | None:
    """One line with a step's evaluation, or None when the step had none."""
    parts = []
    for name in EVAL_SETS:
        keys = [(kind, f"eval/{name}/{key}") for kind, key in
                (*ACCURACY_KINDS, ("truncated", "truncated"))]
        shown = [f"{kind} {metrics[key]:.3f}" for kind, key in keys if key in metrics]
        if shown:
            parts.append(f"{name} " + " ".join(shown))
    return f"eval step {step}: " + " | ".join(parts) if parts else None


def format_duration(seconds: float) -> str:
    """4m41s, 1h05m, 45s: the one way klrl prints a duration (progress, sweeps, figures)."""
    if not math.isfinite(seconds):
        return "?"
    m, s = divmod(round(seconds), 60)
    return f"{m // 60}h{m % 60:02d}m" if m >= 60 else f"{m}m{s:02d}s" if m else f"{s}s"


def print_summary(run_dir, title: str = "run finished", file=None) -> None:
    """The before/after table of a finished run: first and last evaluation of each set, and
    what the data options did (data_lines)."""
    metrics = read_metrics(run_dir)
    evals = [m for m in metrics if "eval/in_domain/accuracy" in m]
    if not evals:
        return
    first, last = evals[0], evals[-1]
    rows = [(f"{name} {kind}", f"eval/{name}/{key}") for name in EVAL_SETS
            for kind, key in ACCURACY_KINDS]
    lines = [f"  {label:<26} {first[key]:.3f} -> {last[key]:.3f}"
             for label, key in rows if key in first and key in last]
    config = read_config(run_dir)
    lines += data_lines(metrics, config.get("data") or {}, config.get("total_steps"))
    Console(file=file).print(f"[bold]{title}[/bold] in {run_dir} (step {first['step']} -> "
                             f"{last['step']})\n" + "\n".join(lines)
                             + f"\n  trained policy             {final_dir(run_dir)}",
                             soft_wrap=True)


def data_lines(metrics: list[dict], data: dict, total_steps: int | None) -> list[str]:
    """Summary lines of a finished run's data options: the prompts dropped as too long, and
    with data.epochs whether the epochs or total_steps ended the run."""
    lines, last = [], metrics[-1] if metrics else {}
    if "data/prompts_filtered" in last:
        lines.append(f"  {'prompts filtered':<26} {last['data/prompts_filtered']} longer than "
                     f"data.max_prompt_length={data.get('max_prompt_length')} (not trained on)")
    epochs = data.get("epochs")
    if epochs is not None and "data/epoch" in last:
        step, done = last["step"], f"{last['data/epoch']:.2f} epochs"
        why = (f"data.epochs={epochs} used up at step {step}, before total_steps={total_steps}"
               if total_steps is None or step < total_steps
               else f"total_steps={total_steps} reached after {done} of data.epochs={epochs}")
        lines.append(f"  {'ended':<26} {why}")
    return lines
