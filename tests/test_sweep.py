"""`klrl sweep`: grid expansion and run names, validation before anything starts, the
skip-finished / resume-partial decisions and failure handling of the run loop (with a launcher
that runs nothing), and one real 2-run sweep through the CLI that is rerun (both skipped) and
reported."""
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from test_report import coloured_share

from cluster.config.loader import ConfigError
from cluster.analysis.labels import value_token
from cluster.sweeps.sweep import (
    SweepConfig,
    changed_runs,
    expand,
    load_sweep,
    set_aside,
    sweep_dir,
    train_command,
    validate_runs,
)
from cluster.sweeps.sweep_run import run_sweep
from cluster.train.continuation import Action, RunState, continuation
from cluster.train.run_log import last_step

ROOT = Path(__file__).resolve().parents[1]
XDIST_GROUP = "own-processes"  # its real sweep runs `klrl train` subprocesses (conftest)
TINY = ROOT / "configs" / "tiny_cpu.yaml"


def _sweep(tmp_path, **fields) -> SweepConfig:
    data = {"name": "grid", "train_config": str(TINY), "output_dir": str(tmp_path), "poll_s": 0.01,
            "grid": {"kl.estimator": ["k1", "k3"], "kl.placement": ["reward", "loss"],
                     "max_lag": [0, 2], "seed": [0, 1]}} | fields
    return SweepConfig.model_validate(data)


def test_grid_expands_in_order_with_names_from_values(tmp_path):
    runs = expand(_sweep(tmp_path))
    assert len(runs) == 16 and [r.index for r in runs] == list(range(1, 17))
    assert [r.name for r in runs[:3]] == ["k1-reward-lag0-s0", "k1-reward-lag0-s1",
                                          "k1-reward-lag2-s0"]
    assert runs[-1].name == "k3-loss-lag2-s1"
    assert runs[-1].values == {"kl.estimator": "k3", "kl.placement": "loss", "max_lag": 2,
                               "seed": 1}
    assert len({r.name for r in runs}) == 16


def test_controls_vary_the_grid_and_join_its_runs(tmp_path):
    cfg = _sweep(tmp_path, grid={"kl.estimator": ["k1", "k3"], "max_lag": [0, 2], "seed": [0, 1]},
                 controls=[{"kl": {"beta": [0.0]}, "kl.estimator": ["k1"]},   # the no-KL control
                           {"kl.importance": ["prefix"], "max_lag": [2]},
                           {"max_lag": [2]}])                                # all in the grid
    runs = expand(cfg)
    names = [r.name for r in runs]
    assert len(runs) == 8 + 4 + 4 and len(set(names)) == 16
    assert [r.index for r in runs] == list(range(1, 17))
    assert names[8:12] == ["k1-lag0-s0-b0", "k1-lag0-s1-b0", "k1-lag2-s0-b0", "k1-lag2-s1-b0"]
    assert names[12:] == ["k1-lag2-s0-is_prefix", "k1-lag2-s1-is_prefix", "k3-lag2-s0-is_prefix",
                          "k3-lag2-s1-is_prefix"]
    configs = validate_runs(cfg, runs)
    assert configs["k1-lag2-s1-b0"].kl.beta == 0.0 and configs["k1-lag2-s1-b0"].seed == 1
    assert configs["k3-lag2-s0-is_prefix"].kl.importance == "prefix"
    # A seed list given on the command line reaches the controls too: they vary the grid.
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump() | {"train_config": str(TINY)}))
    assert len(expand(load_sweep(path, ["grid.seed=[0,1,2]"]))) == 12 + 6 + 6


def test_every_sweep_and_report_option_has_its_row_in_the_docs():
    """docs/sweeps.md's option table names every SweepConfig field and every `report.*` one
    (ReportConfig) with its default and its description: a new option is documented, and a
    changed one's row follows it, or this fails (backticks and Markdown's escaped `|` aside)."""
    from cluster.analysis.report import ReportConfig

    page = (Path(__file__).parents[1] / "docs" / "sweeps.md").read_text()
    fields = [(k, f) for k, f in SweepConfig.model_fields.items() if k != "report"] + [
        (f"report.{k}", f) for k, f in ReportConfig.model_fields.items()]

    def plain(text: str) -> str:
        return text.replace("`", "").replace("\\|", "|").strip()
    rows = {cells[0].strip("` "): plain(cells[2]) for line in page.splitlines()
            if line.startswith("| `") and len(cells := line.strip("|").split(" | ")) >= 3}
    for key, field in fields:
        default = ("required" if field.is_required()
                   else f"`{field.get_default(call_default_factory=True)}`")
        assert f"| `{key}` | {default}" in page, key
        assert rows[key] == plain(field.description), key


def test_value_tokens():
    assert value_token("kl.beta", 0.05) == "b0.05"
    assert value_token("kl.placement", "reward+loss") == "reward_loss"
    assert value_token("kl.importance", "prefix") == "is_prefix"
    assert value_token("kl.truncate", None) == "CNone"
    assert value_token("rollout.temperature", 0.7) == "temperature_0.7"
    assert value_token("learner.lr", 1e-4) == "lr0.0001"


def test_each_run_validates_with_its_values_group_and_tags(tmp_path):
    cfg = _sweep(tmp_path, overrides={"total_steps": 7, "eval": {"num_problems": 9}},
                 grid={"kl.beta": [0.05, 0.5], "kl.truncate": [None, 2.0],
                       "kl.importance": ["prefix"]})
    runs = expand(cfg)
    configs = validate_runs(cfg, runs)
    assert [r.name for r in runs] == ["b0.05-CNone-is_prefix", "b0.05-C2-is_prefix",
                                      "b0.5-CNone-is_prefix", "b0.5-C2-is_prefix"]
    train = configs["b0.05-C2-is_prefix"]
    assert (train.kl.beta, train.kl.truncate, train.kl.importance) == (0.05, 2.0, "prefix")
    assert train.total_steps == 7 and train.eval.num_problems == 9
    assert train.run_name == "b0.05-C2-is_prefix" and Path(train.output_dir) == tmp_path / "grid"
    assert train.logging.wandb_group == "grid"
    assert train.logging.tags == ["kl.beta=0.05", "kl.truncate=2.0", "kl.importance=prefix"]


def test_sweep_file_and_cli_overrides(tmp_path):
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "tiny.yaml").write_text(TINY.read_text())
    path = tmp_path / "sweeps" / "s.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump({"name": "s", "train_config": "../base/tiny.yaml",
                                    "grid": {"kl": {"estimator": ["k1", "k3"]}}}))
    cfg = load_sweep(path, ["grid.seed=[0,1,2]", "overrides.total_steps=5", "parallel=2"])
    assert Path(cfg.train_config) == (tmp_path / "base" / "tiny.yaml").resolve()
    assert cfg.grid == {"kl.estimator": ["k1", "k3"], "seed": [0, 1, 2]}
    assert cfg.overrides == {"total_steps": 5} and cfg.parallel == 2
    assert len(expand(cfg)) == 6
    (tmp_path / "rel.yaml").write_text("name: r\ntrain_config: missing.yaml\ngrid: {seed: [0]}\n")
    with pytest.raises(ConfigError, match="missing.yaml"):
        load_sweep(tmp_path / "rel.yaml")


@pytest.mark.parametrize("fields, match", [
    ({"grid": {"run_name": ["a", "b"]}}, "set by the sweep"),
    ({"overrides": {"output_dir": "x"}}, "set by the sweep"),
    ({"grid": {"seed": [0, 0]}}, "twice"),
    ({"grid": {"seed": []}}, "at least 1"),
    ({"grid": {}}, "at least 1"),
    ({"grid": {"bad key": [1]}}, "config key"),
    ({"parallel": 0}, "parallel"),
    ({"overrides": {"seed": 3}}, "both in grid"),
    ({"overrides": {"kl.beta": 0.1}, "controls": [{"kl.beta": [0.0]}]}, "both in grid"),
    ({"controls": [{"run_name": ["x"]}]}, "set by the sweep"),
    ({"controls": [{"seed": [1, 1]}]}, "twice"),
])
def test_bad_sweep_fields_are_rejected(tmp_path, fields, match):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=match):
        _sweep(tmp_path, **fields)


def test_bad_grid_points_fail_before_anything_runs(tmp_path):
    cfg = _sweep(tmp_path, grid={"kl.beta": [0.1, "0.1"]})
    with pytest.raises(ConfigError, match="both be named 'b0.1'"):
        expand(cfg)
    cfg = _sweep(tmp_path, grid={"kl.truncate": [None, 2.0]})  # truncate needs importance
    with pytest.raises(ConfigError, match="CNone|C2") as exc:
        validate_runs(cfg, expand(cfg))
    assert "C2" in str(exc.value) and "CNone:" not in str(exc.value)
    assert "(from the override kl.truncate=2.0)" in str(exc.value)  # the grid value, not the file
    cfg = _sweep(tmp_path, grid={"seed": [0, 1], "kl.betta": [0.1]})
    with pytest.raises(ConfigError) as exc:
        validate_runs(cfg, expand(cfg))
    lines = str(exc.value).splitlines()  # one message for the runs that fail alike
    assert lines[1].startswith("every grid point: ") and len(lines) == 3
    assert "kl.betta: unknown key (got 0.1); did you mean 'beta'?" in lines[2]


def test_run_state_and_resume_flag(tmp_path):
    cfg = _sweep(tmp_path)
    run = expand(cfg)[0]
    run_dir = sweep_dir(cfg) / run.name
    new = continuation(run_dir)
    assert new.state is RunState.ABSENT and "--resume" not in train_command(cfg, run, new)
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n{"step": 2, "x"')
    partial = continuation(run_dir)
    assert partial.state is RunState.STARTED and train_command(cfg, run, partial)[-1] == "--resume"
    assert last_step(run_dir) == 1  # the cut last line is ignored
    (run_dir / "final").mkdir()
    (run_dir / "final" / "config.json").write_text("{}")
    assert continuation(run_dir).action is Action.SKIP


class FakeLauncher:
    """Runs nothing: a started run records its config as a real run does (resolved, in
    config.yaml) and 'finishes' (writes final/config.json) at once, except those named in
    `fail`, which exit 1 without a final model."""

    def __init__(self, fail=()):
        self.fail, self.started = set(fail), []

    def start(self, request):
        """What a launcher is handed (cluster/launchers/base.py): the run's request, the
        state its directory was in (the continuation rule's) and its command."""
        given = dict(o.split("=", 1) for o in request.overrides)
        run_dir = Path(given["output_dir"]) / request.name
        self.started.append((request.name, continuation(run_dir).state.value, request.args()))
        run_dir.mkdir(parents=True, exist_ok=True)
        record(request.config, request.overrides, run_dir)
        run = request
        (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
        if run.name not in self.fail:
            (run_dir / "final").mkdir()
            (run_dir / "final" / "config.json").write_text("{}")
        return run.name

    def poll(self, handle):
        return 1 if handle in self.fail else 0

    def stop(self, handle, signum):
        raise AssertionError("no signal was sent")

    def where(self, handle):
        return f"fake {handle}"


def record(config, overrides, run_dir) -> None:
    """RUN_DIR/config.yaml as `klrl train` writes it for this run (paths resolved)."""
    from cluster.config.loader import dump_config
    from cluster.config.train_config import load_train_config
    from cluster.train.door.paths import resolve_paths

    dump_config(resolve_paths(load_train_config(config, list(overrides))),
                run_dir / "config.yaml")


def test_sweep_skips_finished_resumes_partial_and_survives_failures(tmp_path):
    from cluster.cli.cmd_sweep import _summarise

    cfg = _sweep(tmp_path, parallel=3, grid={"kl.estimator": ["k1", "k3"], "seed": [0, 1]})
    runs = expand(cfg)
    configs = validate_runs(cfg, runs)
    done, partial = sweep_dir(cfg) / "k1-s0", sweep_dir(cfg) / "k1-s1"
    (done / "final").mkdir(parents=True)
    (done / "final" / "config.json").write_text("{}")
    partial.mkdir()
    (partial / "metrics.jsonl").write_text('{"step": 0}\n')  # started: it holds a run
    launcher = FakeLauncher(fail={"k3-s0"})
    outcomes, signum = run_sweep(cfg, runs, configs, launcher)
    assert signum is None
    assert {o.run.name: o.status for o in outcomes} == {
        "k1-s0": "skipped", "k1-s1": "finished", "k3-s0": "failed", "k3-s1": "finished"}
    assert [(name, state) for name, state, _ in launcher.started] == [
        ("k1-s1", "started"), ("k3-s0", "absent"), ("k3-s1", "absent")]
    assert launcher.started[0][2][-1] == "--resume" and "--resume" not in launcher.started[1][2]
    failed = next(o for o in outcomes if o.status == "failed")
    assert "exit 1" in failed.detail and "fake k3-s0" in failed.detail
    assert _summarise(cfg, runs, outcomes, None, write=False) == 1
    assert yaml.safe_load((sweep_dir(cfg) / "sweep.yaml").read_text())["name"] == "grid"

    # Again: the finished runs are skipped; the failed one (its directory exists) is resumed.
    again = FakeLauncher()
    outcomes, _ = run_sweep(cfg, runs, configs, again)
    assert [(name, state) for name, state, _ in again.started] == [("k3-s0", "started")]
    assert _summarise(cfg, runs, outcomes, None, write=False) == 0


def test_a_finished_run_says_how_long_the_rest_will_take():
    """The line each finished run prints ends with the runs left and the time they take at
    the mean of those finished so far, parallel ones at once; nothing before the first
    finishes or after the last."""
    from cluster.sweeps.sweep_run import time_left

    assert time_left([120.0, 180.0], 10, 1) == "; 10 to go, about 25m00s at 2m30s a run"
    assert time_left([600.0], 5, 2) == "; 5 to go, about 30m00s at 10m00s a run"
    assert time_left([], 3, 1) == "" and time_left([60.0], 0, 1) == ""


def test_a_resumed_run_gives_no_time_for_the_rest(tmp_path, capsys):
    """A resumed run's time is that of its last part: the time left is read off the runs
    started and finished in this sweep only, and the resumed one's line says so."""
    cfg = _sweep(tmp_path, parallel=1, grid={"seed": [0, 1, 2]})
    runs = expand(cfg)
    (sweep_dir(cfg) / runs[0].name).mkdir(parents=True)  # started: resumed first
    (sweep_dir(cfg) / runs[0].name / "metrics.jsonl").write_text('{"step": 0}\n')
    run_sweep(cfg, runs, validate_runs(cfg, runs), FakeLauncher())
    lines = [line for line in capsys.readouterr().out.splitlines() if ": finished after" in line]
    assert len(lines) == 3 and "since it resumed" in lines[0] and "to go" not in lines[0]
    assert "; 1 to go, about " in lines[1] and "since it resumed" not in lines[1]
    assert "to go" not in lines[2]


def test_a_restarted_sweep_estimates_the_rest_from_the_runs_that_went_in_one_go(
        tmp_path, capsys):
    """A sweep started again says at once how long the rest will take, at the mean wall time
    (start to final model) of the runs that finished before in one go; a run that was resumed
    counts for nothing (its span includes the pause). Then each run finished here joins."""
    import os
    from datetime import datetime, timezone

    ten_twenty = datetime(2026, 1, 1, 10, 20, tzinfo=timezone.utc).timestamp()
    cfg = _sweep(tmp_path, parallel=1, grid={"seed": [0, 1, 2, 3]})
    runs = expand(cfg)
    for run, starts in ((runs[0], [False]), (runs[1], [False, True])):
        run_dir = sweep_dir(cfg) / run.name
        (run_dir / "final").mkdir(parents=True)
        (run_dir / "final" / "config.json").write_text("{}")
        (run_dir / "provenance.jsonl").write_text("".join(json.dumps(
            {"started_at": "2026-01-01T10:00:00+0000", "resumed": r}) + "\n" for r in starts))
        os.utime(run_dir / "final" / "config.json", (ten_twenty, ten_twenty))
    run_sweep(cfg, runs, validate_runs(cfg, runs), FakeLauncher())
    out = capsys.readouterr().out
    assert "1 run(s) finished before in one go; 2 to go, about 40m00s at 20m00s a run" in out
    # the next estimate averages the run that finished here (about 0 s) in: about 10m a run
    line = next(line for line in out.splitlines() if line.startswith("[3/4] s2: finished"))
    assert "; 1 to go, about 10m00s at 10m00s a run" in line


def test_dry_run_lists_runs_and_states(tmp_path, capsys):
    from cluster.cli.main import main

    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"name": "dry", "train_config": str(TINY),
                                    "output_dir": str(tmp_path), "grid": {"max_lag": [0, 4]}}))
    assert main(["sweep", str(path), "--dry-run", "overrides.total_steps=3"]) == 0
    out = capsys.readouterr().out
    assert "[1/2] lag0 (absent): klrl train" in out and "[2/2] lag4 (absent)" in out
    assert "total_steps=3" in out
    # each command pastes into a shell: the tags' quotes and spaces survive
    runs = expand(load_sweep(path, ["overrides.total_steps=3"]))
    for line, run in zip(out.strip().splitlines(), runs, strict=True):
        assert shlex.split(line.split(": ", 1)[1]) == ["klrl", *train_command(
            load_sweep(path, ["overrides.total_steps=3"]), run, continuation(tmp_path / "none"))]
    assert "'logging.tags=[\"max_lag=0\"]'" in out
    assert main(["sweep", str(path), "--dry-run", "grid.max_lag=[-1]"]) == 2
    assert main(["sweep", str(path), "--address", "http://x:8265", "output_dir=rel"]) == 2


@pytest.mark.slow
def test_real_sweep_runs_resumes_and_reports(ray_cluster, tmp_path, tiny_model_dir, capsys):
    """Two real 3-step runs through `klrl sweep`, side by side (`parallel: 2`; subprocesses,
    vLLM + DeepSpeed each, joining the session's Ray cluster through `ray.address` as runs on
    a cluster do); the rerun skips both; `klrl report` tabulates both configurations. The
    first sweep is the command line in a process of its own; the rerun and the report, which
    start nothing, are the same commands in this process (an interpreter start and klrl's
    imports less each)."""
    import ray

    from cluster.cli.main import main

    path = tmp_path / "tiny_sweep.yaml"
    path.write_text(yaml.safe_dump({
        "name": "e2e", "train_config": str(TINY), "output_dir": str(tmp_path / "runs"),
        "poll_s": 0.5, "parallel": 2,
        "overrides": {"model.path": str(tiny_model_dir), "total_steps": 3, "eval_every": 0,
                      "ray.address": ray.get_runtime_context().gcs_address,
                      "max_lag": 1, "eval.num_problems": 8, "eval.samples": 0,
                      "rollout.prompts_per_step": 4, "rollout.samples_per_prompt": 4,
                      "logging.wandb_mode": "disabled"},
        "grid": {"kl.estimator": ["k1", "k3"], "kl.placement": ["loss"]}}))
    def klrl(*args, timeout):
        return subprocess.run([sys.executable, "-m", "cluster.cli", *args], cwd=ROOT, check=False,
                              capture_output=True, text=True, timeout=timeout)

    t0 = time.monotonic()
    first = klrl("sweep", str(path), timeout=400)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "2 finished, 0 skipped" in first.stdout
    assert "; 1 to go, about " in first.stdout  # after the first run, the time the other takes
    root = tmp_path / "runs" / "e2e"
    for name in ("k1-loss", "k3-loss"):
        assert continuation(root / name).state is RunState.FINISHED
        lines = (root / name / "metrics.jsonl").read_text().splitlines()
        rows = [json.loads(line) for line in lines]
        assert rows[-1]["step"] == 3
        assert (root / "logs" / f"{name}.log").is_file()
    assert (root / "report" / "report.md").is_file()  # the sweep reports when it ends
    print(f"first sweep: {time.monotonic() - t0:.0f}s")

    capsys.readouterr()
    rc = main(["sweep", str(path), "--no-report"])  # the report: the first sweep's, and below
    again = capsys.readouterr()
    assert rc == 0, again.err[-3000:]
    assert "0 finished, 2 skipped" in again.out and ": started" not in again.out
    # ... because what the real runs recorded means what the sweep runs (no path or default
    # differs); a changed setting is not skipped under it (issue 48)
    cfg = load_sweep(path, ["overrides.kl.beta=0.5"])
    changed = changed_runs(cfg, expand(cfg), validate_runs(cfg, expand(cfg)))
    assert [(r.name, r.state, list(map(str, r.changes))) for r in changed] == [
        (name, "finished", ["kl.beta: 0.05 -> 0.5"]) for name in ("k1-loss", "k3-loss")]

    rc = main(["report", str(root)])
    assert rc == 0, capsys.readouterr().err[-3000:]
    md = (root / "report" / "report.md").read_text()
    assert "| `k1-loss` | 1 | 3 |" in md and "| `k3-loss` | 1 | 3 |" in md
    for png in ("reward.png", "accuracy.png", "kl.png", "importance_ratio.png", "grad_norm.png"):
        assert coloured_share(root / "report" / png) > 0.001, png  # empty axes: 0

    # make results --keep (keep.py) on these real runs: kept, put back on a "fresh machine"
    # (another output_dir), skipped there by the sweep and reported as here. Their final
    # evaluation is a record written here (the real one: tests/test_results.py).
    from cluster.sweeps.keep import keep_run, restore_runs

    store, fresh = tmp_path / "kept", tmp_path / "fresh"
    for name in ("k1-loss", "k3-loss"):
        (root / name / "final_eval.json").write_text('{"sets": {}}')
        keep_run(root / name, store)
    assert sum(f.stat().st_size for f in store.rglob("*")) < 100_000  # no weights
    assert restore_runs(store, fresh / "e2e") == ["k1-loss", "k3-loss"]
    rc = main(["sweep", str(path), f"output_dir={fresh}", "--no-report"])
    assert rc == 0 and "0 finished, 2 skipped" in capsys.readouterr().out
    assert main(["report", str(fresh / "e2e"), "figures=false", "--no-wandb"]) == 0
    table = [line for line in md.splitlines() if line.startswith("| `k")]
    back = (fresh / "e2e" / "report" / "report.md").read_text()
    assert table and all(line in back for line in table)


def test_runs_recorded_with_other_settings_never_count_as_the_sweeps(tmp_path, capsys):
    """Issue 48: a rerun with changed overrides used to skip the old runs as 'finished' and
    rewrite sweep.yaml with settings they never trained with. Now each run directory's
    config.yaml is compared, key by key of what it means, with what the sweep would run; a
    difference is refused (exit 2, naming the runs and keys) unless --rerun moves those runs
    aside; keys that change nothing a run means (logging, cadence, resources) pass."""
    from cluster.cli.main import main

    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"name": "b", "train_config": str(TINY),
                                    "output_dir": str(tmp_path), "poll_s": 0.01,
                                    "overrides": {"kl.beta": 0.05, "total_steps": 4},
                                    "grid": {"seed": [0, 1]}}))

    def sweep(*overrides):
        cfg = load_sweep(path, list(overrides))
        runs = expand(cfg)
        return cfg, runs, validate_runs(cfg, runs)

    cfg, runs, configs = sweep()
    run_sweep(cfg, runs, configs, FakeLauncher(fail={"s1"}))  # s0 finished, s1 partial
    root = sweep_dir(cfg)
    written = (root / "sweep.yaml").read_text()
    # Free keys: logging, cadence and resources change nothing a run means.
    cfg, runs, configs = sweep("overrides.checkpoint_every=2", "overrides.logging.samples_every=1",
                               "overrides.rollout.num_cpus_per_worker=0.5")
    assert changed_runs(cfg, runs, configs) == []

    cfg, runs, configs = sweep("overrides.kl.beta=0.5", "overrides.eval.num_problems=7")
    changed = changed_runs(cfg, runs, configs)
    assert [(r.name, r.state) for r in changed] == [("s0", "finished"), ("s1", "started")]
    assert [str(c) for c in changed[0].changes] == ["kl.beta: 0.05 -> 0.5",
                                                    "eval.num_problems: 200 -> 7"]
    with pytest.raises(ConfigError, match="s0 \\(finished\\), s1 \\(started\\): kl.beta"):
        run_sweep(cfg, runs, configs, FakeLauncher())  # the invariant holds whoever calls
    assert main(["sweep", str(path), "overrides.kl.beta=0.5"]) == 2
    err = capsys.readouterr().err
    assert "s0 (finished), s1 (started): kl.beta: 0.05 -> 0.5" in err
    assert "add --rerun" in err and "add name=b-b0.5" in err
    assert (root / "sweep.yaml").read_text() == written  # nothing claimed, nothing moved
    assert main(["sweep", str(path), "overrides.kl.beta=0.5", "--rerun", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"s0 (finished; kl.beta: 0.05 -> 0.5): would move to {root / 'replaced'}/" in out
    assert "[1/2] s0 (absent): klrl train" in out and (root / "s0" / "final").is_dir()

    # --rerun (as the CLI does it): the old runs kept under replaced/, both run again, and the
    # sweep.yaml written now is true of every run in the directory.
    cfg, runs, configs = sweep("overrides.kl.beta=0.5")
    moved = set_aside(cfg, changed_runs(cfg, runs, configs))
    assert [p.parent for p in moved] == [root / "replaced"] * 2
    assert (moved[0] / "final" / "config.json").is_file()
    again = FakeLauncher()
    outcomes, _ = run_sweep(cfg, runs, configs, again)
    assert [(name, state) for name, state, _ in again.started] == [("s0", "absent"),
                                                                    ("s1", "absent")]
    assert yaml.safe_load((root / "sweep.yaml").read_text())["overrides"]["kl.beta"] == 0.5
    assert {yaml.safe_load((root / n / "config.yaml").read_text())["kl"]["beta"]
            for n in ("s0", "s1")} == {0.5}

    # A run no grid point names now joins the report all the same: it is judged by what the
    # sweep would run for its recorded grid values (here its seed), and refused if that differs.
    cfg2, runs2, configs2 = sweep("grid.seed=[0]", "overrides.kl.beta=0.5")
    assert changed_runs(cfg2, runs2, configs2) == []  # s1 matches at its seed
    cfg2, runs2, configs2 = sweep("grid.seed=[0]", "overrides.kl.beta=0.5",
                                  "overrides.total_steps=8")
    assert [(r.name, r.state, [c.key for c in r.changes])
            for r in changed_runs(cfg2, runs2, configs2)] == [
        ("s0", "finished", ["total_steps"]), ("s1", "not in the grid", ["total_steps"])]


def test_a_grid_that_lists_seed_first_runs_seed_by_seed_across_its_controls(tmp_path):
    """A paired design stopped partway must have every configuration at the seeds it reached:
    with `seed` first, seed 0's runs of the grid and of each control come before any seed 1
    run; a control's own seeds go last. Otherwise the grid, then each control."""
    cfg = _sweep(tmp_path, grid={"seed": [0, 1], "max_lag": [0, 8]},
                 controls=[{"kl.beta": [0.0], "max_lag": [8]},
                           {"kl.estimator": ["k3"], "seed": [1, 7]}])
    names = [r.name for r in expand(cfg)]
    assert names == ["s0-lag0", "s0-lag8", "s0-lag8-b0",
                     "s1-lag0", "s1-lag8", "s1-lag8-b0", "s1-lag0-k3", "s1-lag8-k3",
                     "s7-lag0-k3", "s7-lag8-k3"]
    assert [r.index for r in expand(cfg)] == list(range(1, 11))
    later = _sweep(tmp_path, grid={"max_lag": [0, 8], "seed": [0, 1]},
                   controls=[{"kl.beta": [0.0], "max_lag": [8]}])
    assert [r.name for r in expand(later)] == ["lag0-s0", "lag0-s1", "lag8-s0", "lag8-s1",
                                               "lag8-s0-b0", "lag8-s1-b0"]
