"""A rich progress bar for training: step, reward, KL, lag and eval accuracy at a glance."""
from __future__ import annotations

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class TrainProgress:
    def __init__(self, total_steps: int, start_step: int = 0):
        self._progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[status]}"))
        self._task = self._progress.add_task("train", total=total_steps, completed=start_step, status="")
        self._acc = ""

    def update(self, step: int, metrics: dict) -> None:
        if "eval/in_domain/accuracy" in metrics:
            self._acc = f" acc {metrics['eval/in_domain/accuracy']:.3f}"
        status = (f"reward {metrics.get('reward/mean', float('nan')):.3f} "
                  f"kl {metrics.get('kl/pi_ref', float('nan')):.4f} lag {metrics.get('lag/max', 0)}{self._acc}")
        self._progress.update(self._task, completed=step, status=status)

    def __enter__(self):
        self._progress.__enter__()
        return self

    def __exit__(self, *exc):
        return self._progress.__exit__(*exc)
