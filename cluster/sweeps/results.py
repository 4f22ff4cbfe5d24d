"""`make results SWEEP=FILE [ARGS="key=value ..."]`: a sweep's results, from scratch or from
where they stopped. Three steps, each skipping what is done:

1. `klrl sweep FILE ARGS --no-report`: the runs that are missing (finished runs are skipped,
   interrupted ones resume from their last checkpoint);
2. every finished run's final checkpoint evaluated on the pre-registered number of problems
   and sets (without a pre-registration: every set the runs evaluated; final_eval.py, one
   process per run, its output in the sweep's logs/RUN.final_eval.log; runs evaluated
   before are skipped), and the model they started from on the same problems (the sweep's
   base_eval.json, the row the report reads every final accuracy against);
3. the report rewritten into docs/sweeps/<sweep name>/ (or --out), where it is committed.

With `--keep DIR` (keep.py) the runs kept in DIR are first put back into the sweep directory,
and the sweep runs one run at a time, each kept in DIR once evaluated: a sweep that outlives
its machine goes on from its kept runs on the next one. A run that fails is then left out
(`klrl sweep --leave-out`) and the loop goes on with the others, as a sweep without `--keep`
goes on past a failed run; the same command again retries it (from its last checkpoint).

Each step runs as a child process in a session of its own; a signal to this one (Ctrl-C,
SIGTERM) is passed on once, so the sweep checkpoints its runs and stops, and nothing after it
starts. Exit status: the sweep's when it failed or was stopped, 1 when a run or an evaluation
failed, else 0.
"""
from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from cluster.config.loader import REPO_ROOT, ConfigError
from cluster.sweeps.final_eval import needs_base_evaluation, needs_evaluation
from cluster.sweeps.keep import (
    KEPT_FILE,
    check_store,
    is_kept,
    keep_base_eval,
    keep_run,
    restore_runs,
)
from cluster.analysis.prereg import Rules, load_preregistration, rules_of
from cluster.analysis.report import find_runs, write_report
from cluster.analysis.runs import BASE_EVAL_FILE, FINAL_EVAL_FILE, RunData
from cluster.sweeps.sweep import expand, load_sweep, sweep_dir, unfinished_runs
from cluster.sweeps.sweep_run import time_left


class _Child:
    """Run one child process at a time, passing this process's SIGINT/SIGTERM on to it."""

    def __init__(self):
        self.signalled: int | None = None
        self._proc: subprocess.Popen | None = None
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, self._forward)

    def _forward(self, signum, _frame) -> None:
        self.signalled = signum
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signum)

    def run(self, *args: str, log: Path | None = None) -> int:
        """Run `python -m ARGS`; its output goes to `log` when given, else here."""
        with open(log, "w") if log else contextlib.nullcontext() as out:
            self._proc = subprocess.Popen([sys.executable, "-m", *args], start_new_session=True,
                                          stdout=out, stderr=subprocess.STDOUT if out else None)
            return self._proc.wait()  # a signal runs _forward and the wait goes on (PEP 475)


def _tail(path: Path, lines: int = 20) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _evaluate_base(child: _Child, root: Path, runs: list[RunData], rules: Rules) -> int:
    """The model the runs started from, on the final evaluation's problems (base_eval.json in
    the sweep directory): 1 when that failed. Skipped when done, when no run finished, or when
    the runs start from different models (a grid over model.*): no one row to read them
    against."""
    finished = [r for r in runs if r.finished]
    starts = {(r.config.get("model.path"), r.config.get("model.embedded")) for r in finished}
    if len(starts) != 1:
        if len(starts) > 1:
            print("base model: not evaluated, the runs start from different models")
        return 0
    if not needs_base_evaluation(root, rules.final_problems, rules.final_eval_seed,
                                 rules.final_sets):
        return 0
    return _final_eval(child, "base model (before training)", finished[0].dir,
                       root / BASE_EVAL_FILE, root / "logs" / "base.final_eval.log", rules,
                       "--base")


def _final_eval(child: _Child, what: str, run_dir: Path, record: Path, log: Path, rules: Rules,
                *extra: str, took: list[float] | None = None, left: int = 0) -> int:
    """One `final_eval.py` process on run_dir (with `extra`: --base) on the rules' problems,
    seed and sets, its output in `log`: prints what it evaluates, then the accuracies it wrote
    to `record` (and, given `took`, the seconds of those done before, which it extends: how
    long the `left` after it take) or the end of its log. 1 when it failed (not when a signal
    stopped it: the caller checks `child.signalled`), else 0."""
    t0 = time.monotonic()
    log.parent.mkdir(exist_ok=True)
    print(f"{what}: {rules.final_problems} problems per set on {', '.join(rules.final_sets)} "
          f"(log: {log})", flush=True)
    code = child.run("cluster.cli.final_eval", str(run_dir), *extra, "--problems",
                     str(rules.final_problems), "--seed", str(rules.final_eval_seed),
                     "--sets", ",".join(rules.final_sets), log=log)
    if child.signalled:
        return 0
    if code:
        print(f"FAILED: {what} (exit {code}); the end of {log}:\n{_tail(log)}", file=sys.stderr)
        return 1
    if took is not None:
        took.append(time.monotonic() - t0)
    _print_sets(record, time_left(took or [], left, 1))
    return 0


def _evaluate_finished(child: _Child, root: Path, rules: Rules, took: list[float]) -> int:
    """Step 2 for every finished run not yet evaluated on the rules' problems and sets: 1
    when an evaluation failed, else 0 (a signal stops it: the caller checks)."""
    todo = [d for d in sorted(root.iterdir()) if d.is_dir()
            and needs_evaluation(d, rules.final_problems, rules.final_eval_seed, rules.final_sets)]
    status = 0
    for run_dir in [d for d in todo if (d / KEPT_FILE).is_file()]:  # put back, no weights
        print(f"FAILED: {run_dir.name} was put back by --keep without its weights "
              f"({run_dir / KEPT_FILE}), and its evaluation was on other problems or sets than "
              f"these ({rules.final_problems} per set on {', '.join(rules.final_sets)}): "
              "evaluate it where its run directory, weights and all, still is", file=sys.stderr)
        todo.remove(run_dir)
        status = 1
    for i, run_dir in enumerate(todo, 1):
        status = max(status, _final_eval(
            child, f"[{i}/{len(todo)}] final checkpoint of {run_dir.name}", run_dir,
            run_dir / FINAL_EVAL_FILE, root / "logs" / f"{run_dir.name}.final_eval.log", rules,
            took=took, left=len(todo) - i))
        if child.signalled:
            break
    return status


def _put_back(store: Path, root: Path) -> None:
    """--keep: the runs kept in `store` back into the sweep directory `root` (ConfigError for a
    `store` that cannot be one)."""
    check_store(store, root)
    if restored := restore_runs(store, root):
        print(f"put back from {store}: {len(restored)} finished run(s), {', '.join(restored)}",
              flush=True)


def _keep_done(root: Path, runs: list[RunData], store: Path, rules: Rules) -> None:
    """--keep: every finished run of `runs` (the sweep directory's, as main read them)
    evaluated on the rules' problems, and the base model's evaluation, copied into `store`
    where it is not there as it is now (keep.py)."""
    for run in runs:
        if run.finished and not needs_evaluation(run.dir, rules.final_problems,
                                                 rules.final_eval_seed, rules.final_sets) \
                and not is_kept(run.dir, store):
            print(f"kept: {run.name} -> {keep_run(run.dir, store)}", flush=True)
    if keep_base_eval(root, store):
        print(f"kept: the base model's evaluation -> {store / BASE_EVAL_FILE}", flush=True)


def _print_sets(path: Path, then: str = "") -> None:
    done = json.loads(path.read_text())["sets"]
    print("  " + ", ".join(f"{name} {s['accuracy']:.3f} ({s['problems']} problems)"
                           for name, s in done.items()) + then, flush=True)


def make_results(sweep_file: str, overrides: list[str], keep: Path | None = None,
                 out: Path | None = None) -> int:
    """The three steps of the module docstring for the sweep in sweep_file (with its
    key=value overrides), the runs kept in `keep` when given, the report written to `out`
    (default docs/sweeps/<sweep name>); returns the exit status the docstring gives.
    `make results` parses its arguments in cluster/cli/results.py."""
    try:
        cfg = load_sweep(sweep_file, overrides)
        prereg = load_preregistration(cfg.report.preregistration) \
            if cfg.report.preregistration else None
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    root = sweep_dir(cfg)
    store = keep
    if store is not None:
        try:
            _put_back(store, root)
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    child = _Child()
    status, took, failed = 0, [], []
    planned = expand(cfg)
    while True:  # once; with --keep, once a run, so that each is kept as soon as it is done
        # with --keep, the run this sweep call starts: the first unfinished one not failed here
        starts = next((run.name for run, _ in unfinished_runs(root, planned, failed)), None)
        ran = child.run("cluster.cli", "sweep", sweep_file, *overrides, "--no-report",
                        *(["--max-runs", "1"] if store else []),
                        *(f"--leave-out={name}" for name in failed))
        if ran not in (0, 1) or child.signalled:
            return ran or 128 + child.signalled
        status = max(status, ran)
        if ran and store is not None and starts is not None:
            failed.append(starts)
        runs = find_runs(root)
        rules = rules_of(prereg, runs)
        status = max(status, _evaluate_finished(child, root, rules, took))
        if child.signalled:
            return 128 + child.signalled
        if store is None or not unfinished_runs(root, planned, failed):
            break
        _keep_done(root, runs, store, rules)
    if failed:
        print(f"failed, left out after: {', '.join(failed)}; the same command again retries "
              "them, each from its last checkpoint (logs: "
              f"{root / 'logs'}/)", file=sys.stderr)
    status = max(status, _evaluate_base(child, root, runs, rules))
    if child.signalled:
        return 128 + child.signalled
    if store is not None:
        _keep_done(root, runs, store, rules)
    out = out if out is not None else REPO_ROOT / "docs" / "sweeps" / cfg.name
    try:
        print(f"report: {write_report(root, cfg.report, out=out)}")
    except (ConfigError, FileNotFoundError) as exc:
        print(f"report not written: {exc}", file=sys.stderr)
        return 2
    return status

