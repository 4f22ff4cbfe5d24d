"""`make results --keep DIR` (cluster/sweeps/keep.py, results.py): a finished, evaluated
run's records are kept outside the sweep directory and put back on a fresh machine, where the
sweep skips it, the report reads it as the original and the time it finished survives; a
partial run of that name is set aside, never deleted; make results starts the sweep once per
run, keeping each as soon as it is evaluated, leaving a failed run out until the next call.
The real runs' round trip is in tests/test_sweep.py's real sweep."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from test_sweep import TINY, FakeLauncher, _sweep, record

from cluster.config.loader import ConfigError
from cluster.sweeps.keep import (
    KEPT_FILE,
    check_store,
    compact_row,
    compact_store,
    is_kept,
    keep_base_eval,
    keep_run,
    kept_runs,
    restore_runs,
)
from cluster.analysis.runs import BASE_EVAL_FILE, FINAL_EVAL_FILE, load_run
from cluster.sweeps.sweep import changed_runs, expand, sweep_dir, validate_runs
from cluster.sweeps.sweep_run import run_sweep
from cluster.train.continuation import RunState, continuation
from cluster.train.run_log import finished_at, is_finished

FINISHED_AT = 1_780_000_000.0  # a fixed past time, so that a lost mtime shows


def finished_run(cfg, run, accuracy=0.5):
    """A run directory as a finished, evaluated run leaves it: its resolved config, 3 steps of
    metrics (a NaN among them), provenance, final/ with weights, final_eval.json."""
    run_dir = sweep_dir(cfg) / run.name
    (run_dir / "final").mkdir(parents=True)
    record(cfg.train_config, run.overrides, run_dir)
    rows = [{"step": s, "reward/mean": 0.1 * s, "kl/pi_ref": float("nan") if s == 2 else 0.01 * s}
            for s in (1, 2, 3)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "provenance.jsonl").write_text(json.dumps(
        {"started_at": "2026-05-28T10:00:00+0000", "resumed": False, "commit": "abc"}) + "\n")
    (run_dir / "final" / "model.safetensors").write_bytes(b"weights" * 100)
    (run_dir / "final" / "config.json").write_text('{"model_type": "qwen2"}')
    os.utime(run_dir / "final" / "config.json", (FINISHED_AT, FINISHED_AT))
    (run_dir / FINAL_EVAL_FILE).write_text(json.dumps(
        {"problems": 10, "seed": 1, "asked": ["in_domain"],
         "sets": {"in_domain": {"accuracy": accuracy, "problems": 10}}}))
    return run_dir


def test_a_kept_run_comes_back_as_the_report_and_the_sweep_read_it(tmp_path):
    cfg = _sweep(tmp_path / "lost", grid={"seed": [0, 1]})
    runs = expand(cfg)
    original = finished_run(cfg, runs[0])
    (sweep_dir(cfg) / BASE_EVAL_FILE).write_text('{"sets": {}}')
    store = tmp_path / "kept"
    kept = keep_run(original, store)
    assert keep_base_eval(sweep_dir(cfg), store) and not keep_base_eval(sweep_dir(cfg), store)
    assert kept_runs(store) == [runs[0].name] and is_kept(original, store)
    assert not (kept / "final" / "model.safetensors").exists()  # the weights stay behind
    assert json.loads((kept / KEPT_FILE).read_text())["weights"] == "not kept"
    # gzip without a time stamp: keeping the same run again writes the same bytes
    first = (kept / "metrics.jsonl.gz").read_bytes()
    assert keep_run(original, store) and (kept / "metrics.jsonl.gz").read_bytes() == first

    for path in kept.rglob("*"):  # a clone of the store: its files dated at the checkout
        os.utime(path, None)
    fresh = _sweep(tmp_path / "fresh", grid={"seed": [0, 1]})  # the next machine
    assert restore_runs(store, sweep_dir(fresh)) == [runs[0].name]
    back = sweep_dir(fresh) / runs[0].name
    assert is_finished(back) and continuation(back).state is RunState.FINISHED
    assert finished_at(back) == FINISHED_AT  # the sweep's time-left estimate reads it
    assert (sweep_dir(fresh) / BASE_EVAL_FILE).read_text() == '{"sets": {}}'
    a, b = load_run(original), load_run(back)
    assert set(a.rows) == set(b.rows) == {1, 2, 3}
    assert b.rows[3] == compact_row(a.rows[3])  # the report's keys, as keep.py compacts them
    assert b.rows[2]["kl/pi_ref"] != b.rows[2]["kl/pi_ref"]  # NaN kept
    assert (a.config, a.finished, a.final_eval) == (b.config, b.finished, b.final_eval)
    assert (back / "provenance.jsonl").read_text() == (original / "provenance.jsonl").read_text()
    assert "restored_from" in json.loads((back / KEPT_FILE).read_text())
    # the sweep's invariant holds over it (the same settings): skipped, the other one run
    assert changed_runs(fresh, runs, validate_runs(fresh, runs)) == []
    launcher, runs = FakeLauncher(), expand(fresh)  # the same names, written under fresh
    outcomes, _ = run_sweep(fresh, runs, validate_runs(fresh, runs), launcher)
    assert [o.status for o in outcomes] == ["skipped", "finished"]
    assert [name for name, _, _ in launcher.started] == [runs[1].name]
    assert restore_runs(store, sweep_dir(fresh)) == []  # there now: put back once
    assert is_kept(back, store)  # as kept: make results does not keep it again


def test_a_partial_run_is_set_aside_for_the_kept_one_and_a_finished_one_stays(tmp_path):
    cfg = _sweep(tmp_path / "a", grid={"seed": [0, 1]})
    runs = expand(cfg)
    store = tmp_path / "kept"
    for run in runs:
        keep_run(finished_run(cfg, run), store)
    there = _sweep(tmp_path / "b", grid={"seed": [0, 1]})
    partial = sweep_dir(there) / runs[0].name
    partial.mkdir(parents=True)
    (partial / "metrics.jsonl").write_text('{"step": 1}\n')
    done = finished_run(there, runs[1], accuracy=0.9)
    assert restore_runs(store, sweep_dir(there)) == [runs[0].name]
    aside = list((sweep_dir(there) / "replaced").iterdir())
    assert len(aside) == 1 and aside[0].name.startswith(runs[0].name)
    assert (aside[0] / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert continuation(partial).state is RunState.FINISHED
    assert json.loads((done / FINAL_EVAL_FILE).read_text())["sets"]["in_domain"]["accuracy"] == 0.9
    assert (done / "final" / "model.safetensors").is_file()  # untouched, weights and all
    # its evaluation differs from the kept one's: keeping it would change the store
    assert not is_kept(done, store)


def test_only_a_finished_evaluated_run_is_kept_and_a_half_keep_is_never_read(tmp_path):
    cfg = _sweep(tmp_path / "a", grid={"seed": [0]})
    run = expand(cfg)[0]
    run_dir = finished_run(cfg, run)
    (run_dir / FINAL_EVAL_FILE).unlink()
    with pytest.raises(ValueError, match="not finished and evaluated"):
        keep_run(run_dir, tmp_path / "kept")
    # a keep cut short leaves its staging directory, which is not a kept run
    (tmp_path / "kept" / f".{run.name}.partial").mkdir(parents=True)
    assert kept_runs(tmp_path / "kept") == []
    assert restore_runs(tmp_path / "kept", tmp_path / "fresh") == []


def test_the_keep_directory_is_refused_inside_the_sweep_or_as_a_file(tmp_path):
    root = tmp_path / "runs" / "sweep"
    root.mkdir(parents=True)
    with pytest.raises(ConfigError, match="inside the sweep directory"):
        check_store(root / "kept", root)
    with pytest.raises(ConfigError, match="inside the sweep directory"):
        check_store(root, root)
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="is a file"):
        check_store(tmp_path / "file", root)
    with pytest.raises(ConfigError, match="cannot create it"):
        check_store(tmp_path / "file" / "kept", root)
    check_store(tmp_path / "kept", root)  # new, beside the sweep: fine


def test_max_runs_starts_that_many_unfinished_runs_and_says_so(tmp_path, capsys):
    from cluster.cli.cmd_sweep import _summarise
    from cluster.cli.main import main

    cfg = _sweep(tmp_path, grid={"seed": [0, 1, 2]})
    runs = expand(cfg)
    launcher = FakeLauncher()
    outcomes, _ = run_sweep(cfg, runs, validate_runs(cfg, runs), launcher, max_runs=1)
    assert [name for name, _, _ in launcher.started] == [runs[0].name]
    assert "starting 1 of the 3 unfinished run(s) (--max-runs)" in capsys.readouterr().out
    assert _summarise(cfg, runs, outcomes, None, write=False) == 0
    assert "1 finished, 0 skipped (finished before), 0 failed, 0 stopped, 2 not started" \
        in capsys.readouterr().out
    # s0 took 20 minutes in one go: the estimate counts both runs left, not the one started
    (sweep_dir(cfg) / "s0" / "provenance.jsonl").write_text(json.dumps(
        {"started_at": "2026-01-01T10:00:00+0000", "resumed": False}) + "\n")
    ten_twenty = 1767262800.0  # 2026-01-01 10:20 UTC
    os.utime(sweep_dir(cfg) / "s0" / "final" / "config.json", (ten_twenty, ten_twenty))
    again = FakeLauncher()
    run_sweep(cfg, runs, validate_runs(cfg, runs), again, max_runs=1)
    out = capsys.readouterr().out
    assert f"1 of 3 run(s) finished before, skipped: {runs[0].name}" in out
    assert "1 run(s) finished before in one go; 2 to go, about 40m00s at 20m00s a run" in out
    assert [name for name, _, _ in again.started] == ["s1"]
    last = FakeLauncher()
    run_sweep(cfg, runs, validate_runs(cfg, runs), last, max_runs=5)  # more than are left
    assert [name for name, _, _ in last.started] == ["s2"]
    assert "--max-runs" not in capsys.readouterr().out
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"name": "m", "train_config": str(TINY),
                                    "output_dir": str(tmp_path)}))
    with pytest.raises(SystemExit) as exit_:
        main(["sweep", str(path), "--max-runs", "0"])
    assert exit_.value.code == 2 and "must be at least 1" in capsys.readouterr().err


class MetricsLauncher(FakeLauncher):
    """FakeLauncher whose runs log the KL metric the report reads."""

    def start(self, request):
        handle = super().start(request)
        given = dict(o.split("=", 1) for o in request.overrides)
        (Path(given["output_dir"]) / request.name / "metrics.jsonl").write_text(
            json.dumps({"step": 1, "kl/pi_ref": 0.01}) + "\n")
        return handle


class SweepChild:
    """results.py's child, with the sweep's real run loop (`run_sweep`, --max-runs honoured)
    over a launcher that trains nothing (MetricsLauncher), and final evaluations that write
    their record: what make results does, less the training and the engines."""

    signalled = None

    def __init__(self, cfg, fail=()):
        self.cfg, self.fail, self.sweeps, self.evaluated = cfg, set(fail), [], []

    def run(self, module, *args, log=None):
        from cluster.cli.cmd_sweep import _summarise

        if module == "cluster.cli":
            max_runs = int(args[args.index("--max-runs") + 1]) if "--max-runs" in args else None
            leave_out = frozenset(a.split("=", 1)[1] for a in args
                                  if a.startswith("--leave-out="))
            runs = expand(self.cfg)
            launcher = MetricsLauncher(fail=self.fail)
            outcomes, _ = run_sweep(self.cfg, runs, validate_runs(self.cfg, runs), launcher,
                                    max_runs, leave_out)
            self.sweeps.append([name for name, _, _ in launcher.started])
            return _summarise(self.cfg, runs, outcomes, None, write=False)
        run_dir, problems = args[0], int(args[args.index("--problems") + 1])
        if "--base" not in args:
            self.evaluated.append(os.path.basename(run_dir))
        target = (sweep_dir(self.cfg) / BASE_EVAL_FILE if "--base" in args
                  else sweep_dir(self.cfg) / os.path.basename(run_dir) / FINAL_EVAL_FILE)
        target.write_text(json.dumps({
            "problems": problems, "seed": int(args[args.index("--seed") + 1]),
            "asked": sorted(args[args.index("--sets") + 1].split(",")),
            "sets": {"in_domain": {"accuracy": 0.5, "problems": problems}}}))
        return 0


def _results(tmp_path, monkeypatch, child, *extra):
    from cluster.cli.results import main
    from cluster.sweeps import results

    monkeypatch.setattr(results, "_Child", lambda: child)
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(child.cfg.model_dump(mode="json")))
    return main([str(path), "--out", str(tmp_path / "report"), *extra])


def test_make_results_keeps_each_run_as_soon_as_it_is_evaluated(tmp_path, monkeypatch, capsys):
    cfg = _sweep(tmp_path / "runs", grid={"seed": [0, 1, 2]})
    child = SweepChild(cfg)
    store = tmp_path / "kept"
    assert _results(tmp_path, monkeypatch, child, "--keep", str(store)) == 0
    assert child.sweeps == [["s0"], ["s1"], ["s2"]]  # one run a sweep
    assert child.evaluated == ["s0", "s1", "s2"]
    out = capsys.readouterr().out
    # each run kept before the next started: its "kept" line comes before the next "started"
    assert out.index("kept: s0") < out.index("[2/3] s1: started") < out.index("kept: s1")
    assert kept_runs(store) == ["s0", "s1", "s2"] and (store / BASE_EVAL_FILE).is_file()
    assert (tmp_path / "report" / "report.md").is_file()

    # the machine is lost: a fresh sweep directory, the same store; nothing runs again
    fresh = _sweep(tmp_path / "fresh", grid={"seed": [0, 1, 2]})
    child = SweepChild(fresh)
    assert _results(tmp_path, monkeypatch, child, "--keep", str(store)) == 0
    assert child.sweeps == [[]] and child.evaluated == []  # their evaluations were kept
    out = capsys.readouterr().out
    assert "put back from" in out and "kept: s" not in out  # nor kept again


def test_with_keep_a_failed_run_is_left_out_the_others_go_on_and_the_next_call_retries_it(
        tmp_path, monkeypatch, capsys):
    cfg = _sweep(tmp_path / "runs", grid={"seed": [0, 1, 2]})
    child = SweepChild(cfg, fail={"s1"})
    store = tmp_path / "kept"
    assert _results(tmp_path, monkeypatch, child, "--keep", str(store)) == 1
    assert child.sweeps == [["s0"], ["s1"], ["s2"]]  # past the failure, s1 started once
    assert kept_runs(store) == ["s0", "s2"] and child.evaluated == ["s0", "s2"]
    err = capsys.readouterr().err
    assert "FAILED s1" in err and "failed, left out after: s1; the same command again" in err
    # the same command again (the failure mended): only s1 runs, and is kept with the others
    again = SweepChild(cfg)
    assert _results(tmp_path, monkeypatch, again, "--keep", str(store)) == 0
    assert again.sweeps == [["s1"]] and again.evaluated == ["s1"]
    assert kept_runs(store) == ["s0", "s1", "s2"]
    # without --keep the sweep runs them all in one go, past the failure, as before
    plain = SweepChild(_sweep(tmp_path / "plain", grid={"seed": [0, 1, 2]}), fail={"s1"})
    assert _results(tmp_path, monkeypatch, plain) == 1
    assert plain.sweeps == [["s0", "s1", "s2"]]


def test_a_left_out_run_is_neither_started_nor_resumed_and_an_unknown_one_is_refused(
        tmp_path, capsys):
    cfg = _sweep(tmp_path, grid={"seed": [0, 1, 2]})
    runs = expand(cfg)
    (sweep_dir(cfg) / "s0").mkdir(parents=True)  # partial: would resume first
    launcher = FakeLauncher()
    run_sweep(cfg, runs, validate_runs(cfg, runs), launcher, 1, frozenset({"s0"}))
    assert [name for name, _, _ in launcher.started] == ["s1"]
    assert "left out (--leave-out), unfinished: s0" in capsys.readouterr().out
    from cluster.cli.main import main

    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    assert main(["sweep", str(path), "--leave-out", "s9", "--dry-run"]) == 2
    assert "--leave-out s9: no run of sweep" in capsys.readouterr().err


def test_a_put_back_run_asked_for_another_evaluation_fails_saying_why(
        tmp_path, monkeypatch, capsys):
    """A run put back without its weights cannot be evaluated again (other problems or sets
    than its kept evaluation): make results says so and exits 1, and starts no evaluation of
    it (one would fail inside the engine, on a model without weights)."""
    cfg = _sweep(tmp_path / "runs", grid={"seed": [0]})
    store = tmp_path / "kept"
    keep_run(finished_run(cfg, expand(cfg)[0]), store)  # evaluated on 10 problems
    fresh = _sweep(tmp_path / "fresh", grid={"seed": [0]})
    child = SweepChild(fresh)
    assert _results(tmp_path, monkeypatch, child, "--keep", str(store)) == 1
    assert child.evaluated == []  # asked for 1000 problems: none started
    err = capsys.readouterr().err
    assert "FAILED: s0 was put back by --keep without its weights" in err


def test_kept_records_are_compact_and_give_the_same_report(tmp_path):
    """What a kept run loses (every metric the report does not read; digits past the sixth of
    those it reads but does not average into runs.csv) changes nothing in the report: its
    findings, runs.csv and flags are the same from the kept copy as from the run itself. A
    non-finite value of an unread key is kept (the report's non-finite check reads every key),
    and compacting a store twice changes nothing."""
    import math

    from test_report import write_run

    from cluster.analysis.report import ReportConfig, write_report

    extra = {s: {"time/step": 0.123456789 * s, "policy/entropy": 1 / 3} for s in range(1, 31)}
    extra[17] = extra[17] | {"loss/kl": float("inf")}
    originals = tmp_path / "own" / "sweep"  # the same name: the report is titled by it
    for est, place, seed in (("k1", "reward", 0), ("k1", "reward", 1), ("k3", "loss", 0),
                             ("k3", "loss", 1)):
        write_run(originals / f"{est}-{place}-s{seed}", est, place, 4, seed, steps=30,
                  kl=lambda s: 0.0123456789 * s, extra=extra)
    store = tmp_path / "kept"
    restored = tmp_path / "back" / "sweep"
    for run in originals.iterdir():
        (run / FINAL_EVAL_FILE).write_text(json.dumps(
            {"problems": 10, "seed": 1, "sets": {"in_domain": {"accuracy": 0.4}}}))
        (run / "provenance.jsonl").write_text("")
        keep_run(run, store)
    assert compact_store(store) == 4  # idempotent: compacting compact records again
    restore_runs(store, restored)
    row = load_run(restored / "k1-reward-s0").rows[17]
    assert "time/step" not in row and math.isinf(row["loss/kl"])
    assert row["kl/pi_ref"] == 0.0123456789 * 17  # averaged into runs.csv: kept as logged
    assert row["grad/norm"] == float(f"{2.0 + math.sin(17):.6g}")
    cfg = ReportConfig(figures=False)

    def text(root):
        md = write_report(root, cfg).read_text().splitlines()
        return [line for line in md if "Written " not in line], \
            (root / "report" / "runs.csv").read_text()

    assert text(originals) == text(restored)
    kept_bytes = sum(p.stat().st_size for p in store.rglob("metrics.jsonl.gz"))
    own_bytes = sum(p.stat().st_size for p in originals.rglob("metrics.jsonl"))
    assert kept_bytes < own_bytes / 4
