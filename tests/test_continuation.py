"""The one "continue this run?" rule (cluster/train/continuation.py) against every state a run
directory can be in, and the launchers that ask it. Pure: files only, no Ray, vLLM or
DeepSpeed."""
from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from cluster.config.loader import DEMO_CONFIG, dump_config
from cluster.config.train_config import load_train_config
from cluster.train import checkpoint as ckpt
from cluster.train.continuation import Action, RunState, continuation, continuation_of
from cluster.train.door.paths import resolve_paths


def config(tmp_path: Path, *overrides: str):
    """The demo config as run `r` under tmp_path, resolved as a start resolves it."""
    return resolve_paths(load_train_config(DEMO_CONFIG, [f"output_dir={tmp_path}", "run_name=r",
                                                         "total_steps=4", *overrides]))


def started(tmp_path: Path, *overrides: str) -> Path:
    """A run directory as a start leaves it: config.yaml and a metrics log."""
    run = tmp_path / "r"
    run.mkdir()
    dump_config(config(tmp_path, *overrides), run / "config.yaml")
    (run / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    return run


def checkpoint(run: Path, step: int, complete: bool = True) -> Path:
    """A checkpoint's files as checkpoint.write_checkpoint leaves them (a learner state that
    is a zip archive, as torch writes it); without the COMPLETE marker when not `complete`."""
    path = ckpt.checkpoint_root(run) / f"step_{step:09d}"
    (path / ckpt.LEARNER_TAG).mkdir(parents=True)
    with zipfile.ZipFile(path / ckpt.LEARNER_TAG / "mp_rank_00_model_states.pt", "w") as z:
        z.writestr("data.pkl", b"x")
    (path / "controller.json").write_text(json.dumps({"step": step, "prompt_position": 0}))
    if complete:
        (path / ckpt.MARKER).write_text(f"{step}\n")
    return path


def finish(run: Path) -> None:
    (run / "final").mkdir()
    (run / "final" / "config.json").write_text("{}")


def asked(tmp_path: Path, *overrides: str) -> dict:
    return config(tmp_path, *overrides).model_dump(mode="json")


def test_absent_runs_start(tmp_path):
    for run in (tmp_path / "r", tmp_path / "empty"):
        verdict = continuation(run, asked(tmp_path))
        assert (verdict.state, verdict.action, verdict.train_flags) == (
            RunState.ABSENT, Action.START, [])
        (tmp_path / "empty").mkdir(exist_ok=True)  # a directory that holds nothing of a run


def test_a_started_run_without_a_checkpoint_resumes_afresh(tmp_path):
    run = started(tmp_path)
    verdict = continuation(run, asked(tmp_path))
    assert (verdict.state, verdict.action, verdict.checkpoint) == (
        RunState.STARTED, Action.RESUME, None)
    assert verdict.train_flags == ["--resume"] and "afresh" in verdict.reason


def test_a_checkpointed_run_resumes_from_its_newest_complete_checkpoint(tmp_path):
    run = started(tmp_path)
    checkpoint(run, 2)
    newest = checkpoint(run, 3)
    verdict = continuation(run, asked(tmp_path))
    assert (verdict.state, verdict.action, verdict.checkpoint) == (
        RunState.CHECKPOINTED, Action.RESUME, newest)
    assert verdict.ignored == ()


def test_a_finished_run_is_skipped_and_extended_only_when_asked_to_end_later(tmp_path):
    run = started(tmp_path)
    checkpoint(run, 4)
    finish(run)
    for given in (asked(tmp_path), None):
        verdict = continuation(run, given)
        assert (verdict.state, verdict.action) == (RunState.FINISHED, Action.SKIP)
    longer = continuation(run, asked(tmp_path, "total_steps=8"))
    assert (longer.state, longer.action, longer.checkpoint.name) == (
        RunState.FINISHED, Action.RESUME, "step_000000004")
    assert "extending it to total_steps=8" in longer.reason


def test_a_finished_run_without_a_checkpoint_is_not_retrained_from_step_0(tmp_path):
    run = started(tmp_path, "checkpoint_every=0")
    finish(run)
    assert continuation(run, asked(tmp_path, "checkpoint_every=0")).action is Action.SKIP
    verdict = continuation(run, asked(tmp_path, "checkpoint_every=0", "total_steps=8"))
    assert (verdict.state, verdict.action) == (RunState.FINISHED, Action.REFUSE)
    assert "kept no checkpoint" in verdict.reason and "model.path=" in verdict.reason


@pytest.mark.parametrize("done", [True, False], ids=["finished", "unfinished"])
def test_a_run_recorded_under_other_settings_is_refused_with_the_keys(tmp_path, done):
    run = started(tmp_path, "kl.beta=0.05")
    checkpoint(run, 4)
    if done:
        finish(run)
    verdict = continuation(run, asked(tmp_path, "kl.beta=0.5"))
    assert (verdict.state, verdict.action) == (RunState.CHANGED, Action.REFUSE)
    assert "kl.beta: 0.05 -> 0.5" in verdict.reason
    # settings a continuation may change (where it ends, where it logs) are no change
    assert continuation(run, asked(tmp_path, "kl.beta=0.05", "logging.samples_every=1")
                        ).state is not RunState.CHANGED


def test_half_written_leftovers_are_passed_over_and_named(tmp_path):
    run = started(tmp_path)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "reward/m')  # cut by a crash
    older = checkpoint(run, 2)
    checkpoint(run, 3, complete=False)  # killed before its marker
    (ckpt.checkpoint_root(run) / ".partial-step_000000004").mkdir()
    (run / "final").mkdir()  # the final export began, its marker not yet written
    verdict = continuation(run, asked(tmp_path))
    assert (verdict.state, verdict.action, verdict.checkpoint) == (
        RunState.CHECKPOINTED, Action.RESUME, older)
    assert verdict.ignored == ("metrics.jsonl: its last line is cut",
                               "checkpoints/.partial-step_000000004: no COMPLETE marker",
                               "checkpoints/step_000000003: no COMPLETE marker",
                               "final/: written in part (no config.json)")
    # with no complete checkpoint left, the run starts afresh
    ckpt.remove_tree(older, run)
    assert continuation(run, asked(tmp_path)).state is RunState.STARTED


def test_a_damaged_record_is_refused_with_the_fix(tmp_path):
    run = started(tmp_path)
    checkpoint(run, 2)
    newest = checkpoint(run, 3)
    (newest / ckpt.LEARNER_TAG / "mp_rank_00_model_states.pt").write_bytes(b"cut")
    verdict = continuation(run, asked(tmp_path))
    assert (verdict.state, verdict.action) == (RunState.DAMAGED, Action.REFUSE)
    assert "not a torch archive" in verdict.reason and "step_000000002" in verdict.reason
    (run / "config.yaml").write_text("kl: {beta: [")  # cut short
    verdict = continuation(run, asked(tmp_path))
    assert (verdict.state, verdict.action) == (RunState.DAMAGED, Action.REFUSE)
    assert "config.yaml is not a config" in verdict.reason


def test_every_launcher_asks_the_same_rule(tmp_path, capsys):
    """`klrl train --resume-if-started` (a resubmitted Ray job), a SLURM job's attempt and a
    sweep's run each turn the one verdict into their own command."""
    from cluster.cli.main import main
    from cluster.slurm.job import driver_command

    args = [f"output_dir={tmp_path}", "run_name=r", "total_steps=4"]
    assert driver_command("py", "train", str(DEMO_CONFIG), args)[-1] == "total_steps=4"
    run = started(tmp_path)
    assert continuation_of(config(tmp_path)).action is Action.RESUME
    assert driver_command("py", "train", str(DEMO_CONFIG), args)[-1] == "--resume"
    checkpoint(run, 4)
    finish(run)
    assert driver_command("py", "train", str(DEMO_CONFIG), args) is None
    assert main(["train", str(DEMO_CONFIG), *args, "--resume-if-started"]) == 0
    assert "has finished already" in capsys.readouterr().out
    assert main(["train", str(DEMO_CONFIG), *args, "kl.beta=0.5", "--resume-if-started"]) == 2
    assert "kl.beta" in capsys.readouterr().err


def test_a_sweep_says_a_refused_run_and_counts_it_failed_without_starting_it(tmp_path):
    from test_sweep import FakeLauncher, _sweep

    from cluster.sweeps.sweep import expand, sweep_dir, validate_runs
    from cluster.sweeps.sweep_run import run_sweep

    cfg = _sweep(tmp_path, grid={"seed": [0, 1]})
    runs = expand(cfg)
    damaged = checkpoint(sweep_dir(cfg) / runs[0].name, 2)
    (damaged / "controller.json").write_text("{")  # cut short
    launcher = FakeLauncher()
    outcomes, _ = run_sweep(cfg, runs, validate_runs(cfg, runs), launcher)
    assert [(o.run.name, o.status) for o in outcomes] == [(runs[0].name, "failed"),
                                                           (runs[1].name, "finished")]
    assert "refused: checkpoint" in outcomes[0].detail and "is damaged" in outcomes[0].detail
    assert [name for name, _, _ in launcher.started] == [runs[1].name]
