"""Finished runs kept outside their sweep directory, and put back: `make results ... --keep
DIR` (results.py).

A sweep that outlives the machine it runs on (a preemptible node, a lease or a job that ends)
loses every run whose directory goes with it. With `--keep DIR`, each run, once finished and
given its final evaluation, leaves in DIR/<run>/ what the report reads of it: config.yaml,
provenance.jsonl, final_eval.json, metrics.jsonl (gzipped) and the final model's config.json
(final/, without the weights), about 0.5 MB for 2000 steps, small enough to commit; and the
sweep's base_eval.json. Not the weights, and not the logs. On the next machine, `--keep DIR`
puts the kept runs back into the sweep directory before the sweep starts: the sweep skips
them as finished, make results finds their evaluation done, and the report reads them as if
they had run there.

Invariants, enforced here:
- a run is kept only when finished and evaluated on the problems the report asks for (the
  caller's `needs_evaluation` is False), so that a restored run never needs its weights;
- a kept run is put back only where the sweep directory has no finished run of that name
  (the continuation rule's FINISHED, cluster/train/continuation.py); an unfinished run of that
  name is moved to SWEEP_DIR/replaced/ first (nothing deleted);
- a restored run's final/ holds config.json and no weights (kept.json in the run directory
  says so), and final/config.json keeps the time the run finished, which the sweep's
  estimate of the time left reads.
The sweep's own invariant still holds over restored runs: it refuses a run recorded with other
settings than the sweep's now (sweep.changed_runs), wherever the run directory came from.
"""
from __future__ import annotations

import gzip
import json
import math
import os
import shutil
import time
from pathlib import Path

from cluster.config.loader import ConfigError
from cluster.analysis.runs import BASE_EVAL_FILE, FINAL_EVAL_FILE
from cluster.sweeps.sweep import SET_ASIDE_DIR
from cluster.train.continuation import RunState, continuation
from cluster.train.run_log import (
    CONFIG_FILE,
    METRICS_FILE,
    PROVENANCE_FILE,
    final_dir,
    finished_at,
)
from cluster.train.door.paths import check_creatable

# What `klrl report` reads of a run's metrics, kept at every step: the failure rule and the
# measures (analysis/: runs.py, measures.py: eval/, kl/pi_ref, grad/norm, reward/mean, nonfinite,
# lag/mean), the plots' panels (report_plots.py), the KL metric check (report.py: every kl/
# key) and the x axis (rollout/policy_version), and faults/ (what a report says of restarts).
# Values to 6 significant digits (a threshold of the failure rule sits far from that
# precision), but those runs.csv averages (_EXACT_KEYS) as logged, so that a report from kept
# records prints the same .6g figures as one from the run's own. Any other key is kept only
# at a step where it is not finite, which runs.nonfinite_steps reads. tests/test_keep.py
# checks that a report from compacted records equals the report from the run's own.
_REPORT_KEYS = frozenset({
    "step", "policy_version", "rollout/policy_version", "reward/mean", "grad/norm", "nonfinite",
    "lag/mean", "is/ratio_min", "is/ratio_max", "is/tis_clipped_frac",
    "is/ppo_clip_clipped_frac", "is/masked_token_frac", "is/masked_sample_frac",
    "is/truncated_frac"})
_REPORT_PREFIXES = ("eval/", "kl/", "faults/")
_EXACT_KEYS = frozenset({"kl/pi_ref", "lag/mean"})  # measures.py: kl_end, lag_mean
KEPT_FILE = "kept.json"  # in a kept run, and in a run put back: when, from where, what is left out
_PLAIN = (CONFIG_FILE, PROVENANCE_FILE, FINAL_EVAL_FILE)  # copied as they are
_METRICS_GZ = METRICS_FILE + ".gz"
# the file that marks a run finished (run_log.finished_at), kept in final/ without the weights
_FINAL_MARKERS = ("config.json", "adapter_config.json")


def check_store(store: Path, sweep_root: Path) -> None:
    """The door of --keep (ConfigError): a directory outside the sweep directory (whose
    subdirectories the report reads as runs), not a file, that can be written or made."""
    if store.is_file():
        raise ConfigError(f"--keep {store}: is a file; give a directory")
    if store.resolve().is_relative_to(sweep_root.resolve()):
        raise ConfigError(f"--keep {store}: is inside the sweep directory {sweep_root}, whose "
                          "directories are its runs; give a directory outside it")
    check_creatable(store, "--keep")


def kept_runs(store: Path) -> list[str]:
    """Names of the runs kept in `store` (complete ones only: kept.json is written last)."""
    if not store.is_dir():
        return []
    return sorted(d.name for d in store.iterdir() if (d / KEPT_FILE).is_file())


def is_kept(run_dir: Path, store: Path) -> bool:
    """Whether `store` holds this finished run as it is now (the same finish time and final
    evaluation): keeping it again would change nothing."""
    record = store / run_dir.name / KEPT_FILE
    if not record.is_file():
        return False
    kept, end = json.loads(record.read_text()), finished_at(run_dir)
    # within a millisecond: a time put back through os.utime may come back rounded
    return (end is not None and abs(kept.get("finished_at", -1.0) - end) < 1e-3
            and (store / run_dir.name / FINAL_EVAL_FILE).read_bytes()
            == (run_dir / FINAL_EVAL_FILE).read_bytes())


def keep_run(run_dir: Path, store: Path) -> Path:
    """Copy what the report reads of finished, evaluated `run_dir` into store/<run>/ (replacing
    an older copy); returns that directory. An interrupted keep leaves the previous copy or
    none, never half of one (_write_staged)."""
    end = finished_at(run_dir)
    if end is None or not (run_dir / FINAL_EVAL_FILE).is_file():
        raise ValueError(f"{run_dir} is not finished and evaluated: nothing to keep yet")
    store.mkdir(parents=True, exist_ok=True)
    dest = store / run_dir.name

    def fill(staging: Path) -> None:
        _copy_records(run_dir, staging)
        # mtime=0: the same run gives the same bytes, so a commit of the store changes only
        # where a run did
        write_compact(run_dir / METRICS_FILE, staging / _METRICS_GZ)
        (staging / KEPT_FILE).write_text(json.dumps({
            "finished_at": end, "kept_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "from": str(run_dir.resolve()), "weights": "not kept"}, indent=1) + "\n")

    _write_staged(dest, dest.with_name(f".{dest.name}.partial"), fill)
    return dest


def compact_row(row: dict) -> dict:
    """A metrics row as kept: the report's keys (rounded), and any other non-finite value."""
    out = {}
    for key, value in row.items():
        wanted = key in _REPORT_KEYS or key.startswith(_REPORT_PREFIXES)
        finite = not isinstance(value, float) or math.isfinite(value)
        if wanted:
            rounded = isinstance(value, float) and finite and key not in _EXACT_KEYS
            out[key] = float(f"{value:.6g}") if rounded else value
        elif not finite:
            out[key] = value
    return out


def write_compact(metrics: Path, dest: Path) -> None:
    """metrics.jsonl (plain or gzipped) -> `dest`, gzipped, each row compact_row's. mtime=0:
    the same run gives the same bytes, so a commit of the store changes only where a run
    did."""
    opener = gzip.open if metrics.suffix == ".gz" else open
    with opener(metrics, "rt") as src:
        rows = [json.loads(line) for line in src if line.strip()]
    with open(dest, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as out:
        for row in rows:
            out.write((json.dumps(compact_row(row), separators=(",", ":")) + "\n").encode())


def compact_store(store: Path) -> int:
    """Rewrite every kept run's metrics in `store` as write_compact does (records kept before
    compaction existed); returns how many. Idempotent."""
    runs = kept_runs(store)
    for name in runs:
        gz = store / name / _METRICS_GZ
        staged = gz.with_name(gz.name + ".partial")
        write_compact(gz, staged)
        staged.replace(gz)
    return len(runs)


def keep_base_eval(sweep_root: Path, store: Path) -> bool:
    """Copy the sweep's base_eval.json into `store` when it is there and differs; whether it
    did."""
    src, dest = sweep_root / BASE_EVAL_FILE, store / BASE_EVAL_FILE
    if not src.is_file() or (dest.is_file() and dest.read_bytes() == src.read_bytes()):
        return False
    store.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src, dest)
    return True


def restore_runs(store: Path, sweep_root: Path) -> list[str]:
    """Put every run kept in `store` that `sweep_root` lacks (or holds unfinished) back into
    `sweep_root`, and the base model's evaluation where the sweep has none; returns the names
    of the runs put back."""
    restored = []
    for name in kept_runs(store):
        run_dir = sweep_root / name
        if continuation(run_dir).state is RunState.FINISHED:  # the one rule: done there
            continue
        if run_dir.exists():  # superseded by the finished copy; kept, out of the report
            aside = sweep_root / SET_ASIDE_DIR
            aside.mkdir(parents=True, exist_ok=True)
            run_dir.rename(aside / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
        _restore(store / name, run_dir)
        restored.append(name)
    if (store / BASE_EVAL_FILE).is_file() and not (sweep_root / BASE_EVAL_FILE).is_file():
        sweep_root.mkdir(parents=True, exist_ok=True)
        shutil.copy2(store / BASE_EVAL_FILE, sweep_root / BASE_EVAL_FILE)
    return restored


def _restore(kept: Path, run_dir: Path) -> None:
    """One kept run back into `run_dir` (_write_staged); final/'s marker dated when the run
    finished, which the sweep's time-left estimate reads."""
    record = json.loads((kept / KEPT_FILE).read_text())

    def fill(staging: Path) -> None:
        with gzip.open(kept / _METRICS_GZ, "rb") as src, \
                open(staging / METRICS_FILE, "wb") as out:
            shutil.copyfileobj(src, out)
        (staging / KEPT_FILE).write_text(json.dumps(
            {**record, "restored_from": str(kept.resolve()),
             "restored_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, indent=1) + "\n")
        for marker in _copy_records(kept, staging):
            os.utime(marker, (record["finished_at"], record["finished_at"]))

    _write_staged(run_dir, run_dir.with_name(f".{run_dir.name}.restoring"), fill)


def _copy_records(src: Path, dest: Path) -> list[Path]:
    """The files a run and its kept copy share, as they are: config, provenance, final
    evaluation, and final/'s marker of a finished run (run_log.finished_at) without the
    weights. Returns the markers written."""
    for name in _PLAIN:
        if (src / name).is_file():
            shutil.copy2(src / name, dest / name)
    final_dir(dest).mkdir()
    markers = [final_dir(dest) / n for n in _FINAL_MARKERS if (final_dir(src) / n).is_file()]
    for marker in markers:
        shutil.copy2(final_dir(src) / marker.name, marker)
    return markers


def _write_staged(dest: Path, staging: Path, fill) -> None:
    """`fill` a fresh `staging` directory beside `dest`, then rename it into place (replacing
    `dest`): whoever reads `dest` sees the whole of one copy or none, never half of one."""
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    fill(staging)
    if dest.exists():
        shutil.rmtree(dest)
    staging.rename(dest)
