"""Mistakes fail before anything starts: exit code 2, a message of one or two lines naming the
field and the fix, no run directory, no process (docs/training.md, "Fail fast").

Every `klrl train` here runs in-process through the CLI's `main` with Ray start-up and the model
build replaced by a guard that fails the test: a mistake that got past pre-flight would reach
it. One case runs as a real subprocess to check the exit code and the time end to end."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from cluster.cli.main import main
from cluster.config.loader import DEMO_CONFIG, dump_config
from cluster.config.train_config import load_train_config
from cluster.train import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[1]
# Only a hang fails on time: that nothing heavy starts is what the refusing stand-ins of Ray
# and the model (refuse, below) enforce, not a clock.
HANG_S = 120


class GotPastPreflight(AssertionError):
    """Raised where Ray would start or the model would be built."""


@pytest.fixture
def guarded(monkeypatch, tmp_path):
    """`klrl train` in-process that cannot start anything; no wandb key in sight. The
    session's Ray cluster, if this process runs one, is stopped first, so that the checks
    below see whether the command started Ray (the next test that needs it starts it again)."""
    import ray

    from cluster.train import run

    if ray.is_initialized():
        ray.shutdown()

    def refuse(*_args, **_kw):
        raise GotPastPreflight("the run got past pre-flight")

    monkeypatch.setattr(run, "resolve_model", refuse)
    monkeypatch.setattr(run, "start_ray", refuse)
    for var in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))


def _klrl(capsys, *argv) -> tuple[int, str, float]:
    t0 = time.monotonic()
    code = main(list(argv))
    return code, capsys.readouterr().err, time.monotonic() - t0


def _assert_refused(code, err, seconds, out_dir: Path, *names):
    import ray

    assert code == 2, err
    assert 1 <= len(err.strip().splitlines()) <= 2, err
    for name in names:
        assert name in err, (name, err)
    assert not out_dir.exists(), "a run directory was left behind"
    assert not ray.is_initialized()
    assert seconds < HANG_S, f"took {seconds:.1f} s"


@pytest.mark.parametrize("overrides, names", [
    (["model.path=/nonexistent/klrl-model"], ["model.path", "no such directory"]),
    (["task.reward=no_such_module:score"],
     ["task.reward", "cannot import module 'no_such_module'"]),
    (["task.options.foo=1"], ["task.options", "no option 'foo'"]),
    (["task.train_split=trian"], ["task.train_split", "did you mean 'train'"]),
    (["eval.in_domain.split=test"], ["eval.in_domain.split", "its splits are train, in_domain"]),
    (["logging.wandb_mode=online"], ["logging.wandb_mode=online", "WANDB_API_KEY",
                                     "logging.wandb_mode=offline"]),
], ids=lambda v: v[0] if isinstance(v, list) and "=" in v[0] else None)
def test_a_typo_fails_before_anything_starts(guarded, capsys, tmp_path, overrides, names):
    out = tmp_path / "runs"
    code, err, seconds = _klrl(capsys, "train", str(DEMO_CONFIG), f"output_dir={out}",
                               "run_name=r", *overrides)
    _assert_refused(code, err, seconds, out, *names)


def test_a_directory_that_is_not_a_model_and_a_wandb_mode_from_the_environment(
        guarded, capsys, tmp_path, monkeypatch):
    out = tmp_path / "runs"
    code, err, seconds = _klrl(capsys, "train", str(DEMO_CONFIG), f"output_dir={out}",
                               f"model.path={tmp_path}")
    _assert_refused(code, err, seconds, out, "model.path", "no config.json")
    monkeypatch.setenv("WANDB_MODE", "online")
    code, err, seconds = _klrl(capsys, "train", str(DEMO_CONFIG), f"output_dir={out}")
    _assert_refused(code, err, seconds, out, "WANDB_MODE=online", "WANDB_API_KEY")


def test_a_wandb_key_from_the_environment_or_netrc_is_enough(guarded, monkeypatch, tmp_path):
    from cluster.train.door.wandb import check_wandb

    cfg = load_train_config(DEMO_CONFIG, ["logging.wandb_mode=online"])
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    check_wandb(cfg)
    monkeypatch.delenv("WANDB_API_KEY")
    (tmp_path / "no-netrc").write_text(
        "machine api.wandb.ai login user password " + "x" * 40 + "\n")
    check_wandb(cfg)
    with pytest.raises(GotPastPreflight):  # and the run goes on to start
        main(["train", str(DEMO_CONFIG), f"output_dir={tmp_path / 'runs'}",
              "logging.wandb_mode=online"])


def test_a_hub_name_passes_and_a_local_looking_path_does_not(tmp_path, monkeypatch):
    from cluster.config.loader import ConfigError
    from cluster.train.door.models import check_model_path

    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    for hub in ("Qwen/Qwen2.5-7B", "gpt2", None):
        check_model_path(hub)
    for local in ("models/qwen", "./qwen", "runs/r1/final", "/abs/model", "~/model"):
        with pytest.raises(ConfigError, match="no such directory"):
            check_model_path(local)


def _math_on(path: Path) -> list[str]:
    """Overrides training the math task on one local file (evaluated on it as well)."""
    return ["task.name=math", f"task.options.train={path}", f"task.options.in_domain={path}",
            "eval.out_of_domain=null"]


@pytest.mark.parametrize("content, names", [
    (None, ["task.options (split train)", "does not exist", "give an existing .jsonl"]),
    ("", ["task.options (split train)", "holds no rows"]),
    ('{"question": "1+1?", "final": "2"}\n', ["task.options (split train)", "no usable rows",
                                             "KeyError", "columns"]),
], ids=["missing", "empty", "other-columns"])
def test_a_local_dataset_that_cannot_be_read_fails_before_anything_starts(
        guarded, capsys, tmp_path, content, names):
    data = tmp_path / "train.jsonl"
    if content is not None:
        data.write_text(content)
    out = tmp_path / "runs"
    code, err, seconds = _klrl(capsys, "train", str(DEMO_CONFIG), f"output_dir={out}",
                               *_math_on(data))
    _assert_refused(code, err, seconds, out, *names)


def test_a_local_dataset_in_another_schema_passes_with_columns(guarded, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"question": "1+1?", "final": "2"}\n')
    with pytest.raises(GotPastPreflight):
        main(["train", str(DEMO_CONFIG), f"output_dir={tmp_path / 'runs'}", *_math_on(data),
              "task.options.columns={question: problem, final: answer}"])


def test_a_model_directory_without_a_tokenizer_fails_before_anything_starts(
        guarded, capsys, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    out = tmp_path / "runs"
    code, err, seconds = _klrl(capsys, "train", str(DEMO_CONFIG), f"output_dir={out}",
                               f"model.path={model}")
    _assert_refused(code, err, seconds, out, "model.path", "no tokenizer", "save_pretrained")
    (model / "tokenizer.json").write_text("{}")
    save_file({"w": torch.zeros(2)}, model / "model.safetensors")  # weights: tests/test_door.py
    with pytest.raises(GotPastPreflight):
        main(["train", str(DEMO_CONFIG), f"output_dir={out}", f"model.path={model}"])


@pytest.mark.parametrize("output_dir", ["/proc/klrl-x", "{tmp}/a-file/runs"])
def test_an_output_dir_where_nothing_can_be_written_fails_before_anything_starts(
        guarded, capsys, tmp_path, output_dir):
    (tmp_path / "a-file").write_text("")
    output_dir = output_dir.format(tmp=tmp_path)
    code, err, seconds = _klrl(capsys, "train", str(DEMO_CONFIG), f"output_dir={output_dir}")
    _assert_refused(code, err, seconds, Path(output_dir), "output_dir=", "writable output_dir")


def test_a_ray_address_nothing_answers_on_fails_before_the_model_is_built(
        guarded, capsys, tmp_path, monkeypatch):
    import socket

    with socket.socket() as free:  # a port nothing listens on once closed
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    out = tmp_path / "runs"
    code, err, seconds = _klrl(capsys, "train", str(DEMO_CONFIG), f"output_dir={out}",
                               f"ray.address=127.0.0.1:{port}")
    _assert_refused(code, err, seconds, out, "ray.address=", "nothing answers there")
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    code, err, seconds = _klrl(capsys, "train", str(DEMO_CONFIG), f"output_dir={out}")
    _assert_refused(code, err, seconds, out, "nothing answers there")


def test_one_case_end_to_end_in_a_fresh_process(tmp_path):
    out = tmp_path / "runs"
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "train", str(DEMO_CONFIG),
                           f"output_dir={out}", "task.train_split=trian"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: {DEMO_CONFIG} with overrides: invalid configuration",
        ("  task.train_split: task 'arithmetic' has no split 'trian' (did you mean 'train'?); its "
         "splits are train, in_domain, zero_padded, out_of_domain, retained "
         "(from the override task.train_split=trian)")]
    assert not out.exists()


# ---- resume -----------------------------------------------------------------------------------


def _learner_state(directory: Path, tag: str) -> None:
    """A stand-in for the learner's DeepSpeed state: one torch archive, as its files are."""
    (directory / tag).mkdir()
    torch.save({"version": 0}, directory / tag / "mp_rank_00_model_states.pt")


def _fake_run(tmp_path: Path, steps: int = 2, finished: bool = True,
              checkpoint: bool = False) -> Path:
    """A run directory as a run of `steps` steps leaves it (no weights: nothing loads them)."""
    cfg = load_train_config(DEMO_CONFIG, [f"output_dir={tmp_path}", "run_name=r",
                                          f"total_steps={steps}"])
    run = tmp_path / "r"
    run.mkdir()
    dump_config(cfg, run / "config.yaml")
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": i}) + "\n" for i in range(steps + 1)))
    if checkpoint:
        state = ckpt.ControllerState(step=steps, prompt_position=64 * steps,
                                     config=cfg.model_dump(mode="json"))
        ckpt.write_checkpoint(run, state, _learner_state, keep=2)
    if finished:
        (run / "final").mkdir()
        (run / "final" / "config.json").write_text("{}")
    return run


def test_resume_may_stand_anywhere_and_a_finished_run_without_checkpoint_is_refused(
        guarded, capsys, tmp_path):
    run = _fake_run(tmp_path)
    rest = [f"output_dir={tmp_path}", "run_name=r"]
    for argv in (["--resume", str(run)], [str(run), "--resume"],
                 ["--resume", str(run), "total_steps=5"], ["total_steps=5", "--resume", str(run)],
                 [str(run), "--resume", "total_steps=5"],
                 [str(DEMO_CONFIG), *rest, "--resume"], ["--resume", str(DEMO_CONFIG), *rest],
                 [str(DEMO_CONFIG), "--resume", *rest]):
        code, err, _ = _klrl(capsys, "train", *argv)
        assert code == 2 and "finished and kept no checkpoint" in err, (argv, err)
        assert "model.path=" in err and "checkpoint_every > 0" in err
        assert len(err.strip().splitlines()) == 1
    assert (run / "metrics.jsonl").is_file()  # not moved aside: nothing was retrained
    assert not list(run.glob("metrics.jsonl.abandoned-*"))
    code, err, _ = _klrl(capsys, "train", str(run))
    assert code == 2 and "is a directory: to continue the run in it, add --resume" in err
    code, err, _ = _klrl(capsys, "train", str(run), str(DEMO_CONFIG), "--resume")
    assert code == 2 and "give one config file" in err


def test_a_resume_refused_for_a_changed_config_says_what_changed(guarded, capsys, tmp_path):
    run = _fake_run(tmp_path, finished=False, checkpoint=True)
    code, err, _ = _klrl(capsys, "train", "--resume", str(run), "kl.beta=0.5", "learner.lr=0.001",
                         "eval_every=5")
    assert code == 2
    assert "kl.beta: 0.05 -> 0.5; learner.lr: 0.0001 -> 0.001." in err, err
    assert "eval_every" not in err  # may change: not part of the objective
    with pytest.raises(GotPastPreflight):  # unchanged objective: on it goes
        main(["train", "--resume", str(run), "eval_every=5"])


def test_resuming_a_finished_run_asks_for_more_steps(guarded, capsys, tmp_path):
    run = _fake_run(tmp_path, steps=2, finished=True, checkpoint=True)
    code, err, _ = _klrl(capsys, "train", "--resume", str(run))
    assert code == 2 and "it finished at step 2" in err and "total_steps=4" in err
    with pytest.raises(GotPastPreflight):
        main(["train", "--resume", str(run), "total_steps=4"])


# ---- sweeps, reports, eval ------------------------------------------------------------------


def test_a_local_sweep_runs_every_pre_flight_before_the_first_run(guarded, capsys, tmp_path):
    import yaml

    path = tmp_path / "s.yaml"

    def sweep(overrides, grid, *extra):
        path.write_text(yaml.safe_dump({"name": "s", "train_config": str(DEMO_CONFIG),
                                        "output_dir": str(tmp_path / "runs"),
                                        "overrides": overrides, "grid": grid}))
        code, err, seconds = _klrl(capsys, "sweep", str(path), *extra)
        assert code == 2 and "runs that would fail before they start" in err, err
        assert not (tmp_path / "runs").exists() and seconds < HANG_S
        return err

    for extra in ([], ["--dry-run"]):
        err = sweep({"task.reward": "no_such_module:score"}, {"seed": [0, 1]}, *extra)
        assert "  every run: task.reward: scorer 'no_such_module:score'" in err
    err = sweep({}, {"model.path": [None, "/nonexistent/klrl-model"], "seed": [0, 1]})
    assert "  path__nonexistent_klrl-model-s0, path__nonexistent_klrl-model-s1: model.path=" in err
    assert err.count("no such directory") == 1


@pytest.fixture
def eval_guarded(monkeypatch):
    """`klrl eval` in-process that cannot build a model, load a tokenizer or start vLLM."""
    import actors.evaluate
    from actors.prompting import PromptRenderer
    from cluster.cli import cmd_model

    def refuse(*_args, **_kw):
        raise GotPastPreflight("klrl eval got past its checks")

    monkeypatch.setattr(actors.evaluate, "evaluate", refuse)
    monkeypatch.setattr(PromptRenderer, "from_pretrained", refuse)
    monkeypatch.setattr(cmd_model, "init_default_model", refuse)


@pytest.mark.parametrize("argv, message", [
    (["--task", "nosuch"], "error: --task: unknown task 'nosuch'; known tasks: arithmetic"),
    (["--task", "countdown", "--splits", "in_domian,train"],
     "error: --splits: task 'countdown' has no split 'in_domian' (did you mean 'in_domain'?)"),
    (["--task", "mmlu"],
     "error: --splits: task 'mmlu' has no split 'in_domain'; its splits are out_of_domain"),
    (["--splits", " , "], "error: --splits: no split given"),
    (["--task", "math", "--option", "pth=fixture"],
     "error: --option: task 'math' has no option 'pth' (did you mean 'path'?)"),
    (["--option", "path"], "error: override 'path' is not of the form key.sub=value"),
    (["--task", "mth", "--option", "path=fixture"], "error: --task: unknown task 'mth'"),
    (["--task", "math", "--option", "path=fixture", "--splits", "out_of_domain"],
     "error: --splits: task 'math' has no split 'out_of_domain'"),
])
def test_klrl_eval_checks_task_and_splits_before_vllm(eval_guarded, capsys, argv, message):
    for model in ("default", "/nonexistent/model"):
        code, err, seconds = _klrl(capsys, "eval", model, *argv)
        assert code == 2 and len(err.strip().splitlines()) == 1 and seconds < HANG_S
        assert err.startswith(message), err


def test_klrl_eval_takes_a_lora_adapter_and_names_the_model_of_a_checkpoint(
        eval_guarded, capsys, tmp_path):
    """Issue 48: a LoRA run's final/ (an adapter) goes on to its base model (the embedded one
    when the run's config says null); a checkpoint is refused naming the run's exports that
    are models; --reward must import, as task.reward must."""
    run = tmp_path / "r"
    step = run / "checkpoints" / "step_000000004"
    step.mkdir(parents=True)
    (step / "COMPLETE").write_text("")
    export = run / "hf" / "step_000000004"
    export.mkdir(parents=True)
    code, err, seconds = _klrl(capsys, "eval", str(step))
    assert code == 2 and seconds < HANG_S
    assert err.startswith(f"error: MODEL_DIR {step} is a training checkpoint")
    assert str(export) in err
    code, err, _ = _klrl(capsys, "eval", "default", "--reward", "no_such_module:score")
    assert code == 2 and err.startswith("error: --reward: ") and "no_such_module" in err
    final = run / "final"
    final.mkdir()
    (final / "adapter_config.json").write_text('{"r": 4, "base_model_name_or_path": "/gone"}')
    code, err, _ = _klrl(capsys, "eval", str(final))
    assert code == 2 and "is a LoRA adapter whose base model '/gone' is not here" in err
    (run / "config.yaml").write_text("model: {path: null}\n")
    with pytest.raises(GotPastPreflight):  # the embedded model is built: the door let it in
        main(["eval", str(final)])


@pytest.mark.parametrize("argv", [["--n", "0"], ["--n", "-3"], ["--samples", "-1"]])
def test_klrl_eval_refuses_no_problems(eval_guarded, capsys, argv):
    with pytest.raises(SystemExit) as exc:
        main(["eval", "default", *argv])
    assert exc.value.code == 2
    assert f"argument {argv[0]}: must be at least" in capsys.readouterr().err
    with pytest.raises(GotPastPreflight):  # the smallest valid values go on
        main(["eval", "default", "--n", "1", "--samples", "0"])
    with pytest.raises(GotPastPreflight):  # and so does a task built from its options
        main(["eval", "default", "--task", "math", "--option", "path=fixture",
              "--splits", "in_domain"])


def test_a_ray_address_where_nothing_listens_fails_in_seconds(monkeypatch, capsys, tmp_path):
    """ray.init waits minutes on an address where no GCS listens; klrl probes it first. The
    model is stubbed out (its build is not what this checks): only start_ray runs for real."""
    import socket

    from cluster.train import run

    monkeypatch.setattr(run, "resolve_model", lambda cfg: tmp_path / "model")
    with socket.socket() as s:  # a port nothing listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        out = tmp_path / "runs"
        code, err, seconds = _klrl(capsys, "train", str(DEMO_CONFIG), f"output_dir={out}",
                                   "run_name=r", f"ray.address=127.0.0.1:{port}")
    _assert_refused(code, err, seconds, out, f"ray.address=127.0.0.1:{port}",
                    "nothing answers there", "ray start --head")
