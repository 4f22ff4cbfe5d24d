"""Running a sweep's runs (`run_sweep`), `cfg.parallel` at a time, with progress and the time
left.

Runs are separate processes (`python -m cluster.cli train ...`, each with its own local Ray
cluster, so one run's crash or leftover actors cannot touch another's), or one Ray job each on a
cluster (`--address`); a launcher of cluster/launchers/ starts them (its protocol: start, poll,
stop, where). A failed run does not stop the sweep: it is
recorded, the sweep goes on, and the exit status says which runs failed. The sweep refuses to
run while a run directory was trained with other settings (sweep.py's invariant), whoever
calls it.
"""
from __future__ import annotations

import math
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from cluster.config.loader import ConfigError, dump_config
from cluster.sweeps.sweep import (
    RunSpec,
    SweepConfig,
    changed_runs,
    describe_changed,
    run_request,
    sweep_dir,
    unfinished_runs,
)
from cluster.train.continuation import Action
from cluster.train.progress import format_duration
from cluster.train.run_log import (
    finished_at,
    is_finished,
    last_step,
    read_provenance,
    started_at,
)


@dataclass
class Outcome:
    """How one run of the sweep ended: skipped (finished before), finished, failed, stopped."""

    run: RunSpec
    status: Literal["skipped", "finished", "failed", "stopped"]
    seconds: float = 0.0
    detail: str = ""  # why it failed and where its output is


@dataclass(frozen=True)
class _Active:
    """A run the sweep started and is waiting for."""

    run: RunSpec
    handle: Any        # the launcher's
    started: float     # time.monotonic()
    task: Any          # its progress bar
    resumed: bool      # its time is that of its last part only


class _ForwardedSignals:
    """SIGINT/SIGTERM while the sweep runs: start no more runs and pass the signal on to the
    running ones (klrl train checkpoints on the first and stops at once on the second)."""

    def __enter__(self):
        self.received: list[int] = []
        self.unforwarded: list[int] = []
        self._previous = {s: signal.signal(s, self._handle)
                          for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def _handle(self, signum, _frame) -> None:
        self.received.append(signum)
        self.unforwarded.append(signum)

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def run_sweep(cfg: SweepConfig, runs: list[RunSpec], configs: dict, launcher,
              max_runs: int | None = None,
              leave_out: frozenset[str] = frozenset()) -> tuple[list[Outcome], int | None]:
    """Run every unfinished run (with `max_runs`, the first that many of them; never those
    named in `leave_out`, which stay as they are), `cfg.parallel` at a time, showing progress.
    Returns the outcomes (in the order runs ended) and the signal that stopped the sweep, if
    one did."""
    root = sweep_dir(cfg)
    if changed := changed_runs(cfg, runs, configs):  # the invariant, whoever calls
        raise ConfigError(describe_changed(cfg, changed))
    root.mkdir(parents=True, exist_ok=True)
    dump_config(cfg, root / "sweep.yaml")
    console, n = Console(), len(runs)
    outcomes: list[Outcome] = []
    # Seconds of each run that went in one go, before (`one_go_seconds`) or here: the time
    # left is read off them. A resumed run's time is that of its last part only (or, before,
    # includes the pause), which would make the rest look short (or long).
    took: list[float] = []
    unfinished = unfinished_runs(root, runs)  # each run's state read once
    waiting = {run.name for run, _ in unfinished}
    for run in runs:
        if run.name not in waiting:
            outcomes.append(Outcome(run, "skipped"))
            if (seconds := one_go_seconds(root / run.name)) is not None:
                took.append(seconds)
    todo = [(run, verdict) for run, verdict in unfinished if run.name not in leave_out]
    outcomes += _refused(console, todo, n)
    if left := [run.name for run, _ in unfinished if run.name in leave_out]:
        _say(console, f"left out (--leave-out), unfinished: {', '.join(left)}")
    if skipped := [o.run.name for o in outcomes if o.status == "skipped"]:
        # one line, however many: make results --keep starts the sweep once a run
        _say(console, f"{len(skipped)} of {n} run(s) finished before, skipped: "
             + ", ".join(skipped))
    # a restarted sweep's estimate: of every unfinished run, those --max-runs leaves included
    if ahead := time_left(took, len(todo), cfg.parallel):
        _say(console, f"{len(took)} run(s) finished before in one go{ahead}")
    if max_runs is not None and len(todo) > max_runs:
        _say(console, f"starting {max_runs} of the {len(todo)} unfinished run(s) (--max-runs)")
        todo = todo[:max_runs]
    active: dict[str, _Active] = {}
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=console) as progress, _ForwardedSignals() as signals:
        overall = progress.add_task(f"sweep {cfg.name} (runs)", total=n, completed=len(outcomes))
        while active or (todo and not signals.received):
            while todo and len(active) < cfg.parallel and not signals.received:
                run, verdict = todo.pop(0)
                handle = launcher.start(run_request(cfg, run, verdict))
                resumed = verdict.action is Action.RESUME
                verb = "resuming" if resumed else "started"
                _say(progress.console,
                     f"[{run.index}/{n}] {run.name}: {verb} ({launcher.where(handle)})")
                task = progress.add_task(f"  [{run.index}/{n}] {run.name} (steps)",
                                         total=configs[run.name].total_steps)
                active[run.name] = _Active(run, handle, time.monotonic(), task, resumed)
            while signals.unforwarded:
                signum = signals.unforwarded.pop(0)
                for a in active.values():
                    launcher.stop(a.handle, signum)
            time.sleep(cfg.poll_s)
            for name, a in list(active.items()):
                run = a.run
                progress.update(a.task, completed=last_step(root / name))
                code = launcher.poll(a.handle)
                if code is None:
                    continue
                del active[name]
                progress.remove_task(a.task)
                progress.advance(overall)
                outcome = _outcome(run, code, time.monotonic() - a.started, root,
                                   signals.received, launcher.where(a.handle))
                outcomes.append(outcome)
                if outcome.status == "finished" and not a.resumed:
                    took.append(outcome.seconds)
                since = " since it resumed" if a.resumed else ""
                _say(progress.console, f"[{run.index}/{n}] {run.name}: {outcome.status} after "
                     f"{format_duration(outcome.seconds)}{since}"
                     + (f" ({outcome.detail})" if outcome.detail else "")
                     + ("" if signals.received else time_left(took, len(todo) + len(active),
                                                               cfg.parallel)))
    return outcomes, (signals.received[0] if signals.received else None)


def _refused(console, todo: list, n: int) -> list[Outcome]:
    """The runs of `todo` the continuation rule refuses (a damaged checkpoint, say), taken
    out of it: each said, and counted as failed."""
    refused = [(run, verdict) for run, verdict in todo if verdict.action is Action.REFUSE]
    for run, verdict in refused:
        todo.remove((run, verdict))
        _say(console, f"[{run.index}/{n}] {run.name}: refused: {verdict.reason}")
    return [Outcome(run, "failed", detail=f"refused: {verdict.reason}") for run, verdict in refused]


def time_left(took: list[float], left: int, parallel: int) -> str:
    """"; N to go, about T at M a run": the runs not yet done at the mean time of those
    started and finished so far, `parallel` at once; "" when none is left or none has
    finished yet."""
    if not left or not took:
        return ""
    mean = sum(took) / len(took)
    return (f"; {left} to go, about {format_duration(mean * math.ceil(left / parallel))} at "
            f"{format_duration(mean)} a run")


def one_go_seconds(run_dir: Path) -> float | None:
    """A finished run's wall time, from its start to its final model, when it started once
    (provenance.jsonl); None otherwise: a resumed run's span includes its pause."""
    starts = read_provenance(run_dir)
    end = finished_at(run_dir)
    start = started_at(starts[0]) if len(starts) == 1 else None
    if end is None or start is None or end < start.timestamp():
        return None
    return end - start.timestamp()


def _say(console, text: str) -> None:
    console.print(text, markup=False, highlight=False, soft_wrap=True)  # paths stay one line


def _outcome(run: RunSpec, code: int, seconds: float, root: Path, signalled: list,
             where: str) -> Outcome:
    if code == 0 and is_finished(root / run.name):
        return Outcome(run, "finished", seconds)
    if signalled:
        return Outcome(run, "stopped", seconds, f"exit {code}; {where}")
    why = f"exit {code}" if code else "exited 0 but wrote no final model"
    return Outcome(run, "failed", seconds, f"{why}; {where}")
