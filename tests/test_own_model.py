"""docs/own-model.md, run as written: a Hugging Face model directory, a local jsonl dataset with
its own column names and a reward function from the user's own package; the page's config
passes every pre-flight check, its reward scores the rows, `klrl submit` takes the page's GPU
command (dry run), and one real run trains it on CPU, which the page's `klrl eval` then
evaluates (slow). The GPU run is `gpu`-marked."""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from cluster.cli.main import main
from cluster.config.train_config import load_train_config

# Its run starts a Ray cluster of its own (the workers need the user's PYTHONPATH), so it
# runs in the lane of the runs with their own processes (tests/conftest.py).
XDIST_GROUP = "own-processes"
ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "own-model.md"


def page_example(name: str) -> str:
    found = re.search(rf"<!-- example: {re.escape(name)} -->\n```\w*\n(.*?)\n```",
                      PAGE.read_text(), re.DOTALL)
    assert found, f"docs/own-model.md has no example block {name!r}"
    return found.group(1) + "\n"


def page_command(name: str) -> list[str]:
    """The block's command as argv, without its environment assignments."""
    argv = shlex.split(page_example(name).replace("\\\n", " "))
    return [a for a in argv if not re.match(r"^[A-Z_]+=", a)]


@pytest.fixture
def user_dir(tmp_path, tiny_model_dir, monkeypatch):
    """The user's working directory as the page describes it, current and on sys.path."""
    (tmp_path / "myrewards").mkdir()
    (tmp_path / "myrewards" / "__init__.py").write_text("")
    (tmp_path / "myrewards" / "scoring.py").write_text(page_example("own-reward"))
    (tmp_path / "data").mkdir()
    rows = page_example("own-data")
    (tmp_path / "data" / "train.jsonl").write_text(rows * 4)
    (tmp_path / "data" / "test.jsonl").write_text(rows)
    (tmp_path / "my_run.yaml").write_text(page_example("own-config"))
    shutil.copytree(tiny_model_dir, tmp_path / "models" / "my-model")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for var in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(var, raising=False)
    yield tmp_path
    for name in ("myrewards", "myrewards.scoring"):
        sys.modules.pop(name, None)


def test_the_page_config_passes_preflight_and_its_reward_scores_the_rows(user_dir, monkeypatch):
    from cluster.train import run
    from rewards import ScoringPool, get_task, load_scorer

    class Started(AssertionError):
        pass

    def refuse(*_args, **_kw):
        raise Started

    monkeypatch.setattr(run, "resolve_model", refuse)
    monkeypatch.setattr(run, "start_ray", refuse)
    argv = page_command("own-train")
    assert argv[:2] == ["klrl", "train"]
    with pytest.raises(Started):  # every check passed: the run would start now
        main(argv[1:])
    cfg = load_train_config(user_dir / "my_run.yaml")
    task = get_task(cfg.task.name, **cfg.task.options)
    problems = task.rows("train")
    assert len(problems) == 12 and problems[0].answer == "42"
    completions = ["so it is 42", "41", "", "42 or 43"]
    with ScoringPool(workers=1, timeout_s=30.0) as pool:
        results = pool.score(load_scorer(cfg.task.reward), problems[:4], completions)
    assert [r.reward for r in results] == [1.0, 0.0, 0.0, 0.0]


def test_the_page_gpu_command_is_a_valid_submission(user_dir, capsys, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    argv = page_command("own-submit")
    assert argv[:2] == ["klrl", "submit"]
    assert main([*argv[1:], "--dry-run"]) == 0, capsys.readouterr().err
    assert "klrl" in capsys.readouterr().out


def _user_path(monkeypatch, user_dir) -> None:
    """Ray's workers import myrewards through PYTHONPATH: the user's folder goes first, and
    what the process inherited stays after it (on a lent GPU machine Ray, vLLM and DeepSpeed
    may be found only through it, so a run without it cannot start a worker); monkeypatch
    puts the variable back after the test."""
    monkeypatch.setenv("PYTHONPATH", str(user_dir), prepend=os.pathsep)


def test_the_runs_keep_the_inherited_pythonpath(user_dir, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/the/inherited/site")
    _user_path(monkeypatch, user_dir)
    assert os.environ["PYTHONPATH"] == f"{user_dir}{os.pathsep}/the/inherited/site"
    monkeypatch.delenv("PYTHONPATH")
    _user_path(monkeypatch, user_dir)
    assert os.environ["PYTHONPATH"] == str(user_dir)


def _train(user_dir, monkeypatch, *extra):
    from cluster.train.run import train
    from cluster.train.run_log import read_metrics

    _user_path(monkeypatch, user_dir)
    cfg = load_train_config(user_dir / "my_run.yaml", [
        "total_steps=2", "eval.num_problems=3", "eval.samples=0", "rollout.prompts_per_step=2",
        "rollout.max_new_tokens=8", "logging.wandb_mode=disabled", *extra])
    run_dir, _ = train(cfg)
    return run_dir, read_metrics(run_dir)


@pytest.mark.slow
def test_the_page_config_trains_on_cpu(user_dir, monkeypatch):
    import ray

    if ray.is_initialized():  # the workers must inherit PYTHONPATH from a cluster started here
        ray.shutdown()
    ray_tmp = Path(tempfile.mkdtemp(prefix="klrl-ray-", dir="/tmp"))  # short: socket paths
    monkeypatch.setenv("RAY_TMPDIR", str(ray_tmp))
    run_dir, metrics = _train(user_dir, monkeypatch)
    # the run's own local Ray cluster took its session directory (logs, sockets) away with it:
    # finished runs do not pile them up (issue 48; a stopped one: tests/test_faults.py)
    assert (ray_tmp / "ray").is_dir(), "the run's Ray cluster was not started under RAY_TMPDIR"
    assert not list((ray_tmp / "ray").glob("session_*")), "the finished run left Ray's session"
    shutil.rmtree(ray_tmp, ignore_errors=True)
    assert run_dir == Path("runs") / "my-first-run"
    assert [m["step"] for m in metrics if "reward/mean" in m] == [1, 2]
    assert (run_dir / "final" / "config.json").is_file()
    assert (run_dir / "final" / "tokenizer.json").is_file()
    # The page's `klrl eval` of the trained model, as written but shortened like the run (8
    # tokens, greedy only), in a process of its own (vLLM keeps an in-process engine's state
    # in globals); issue 48: it failed on the columns.
    argv = page_command("own-eval")
    assert argv[:3] == ["klrl", "eval", str(run_dir / "final")]
    done = subprocess.run([sys.executable, "-m", "cluster.cli", *argv[1:], "--max-tokens", "8",
                           "--samples", "0"], cwd=user_dir,
                          env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{user_dir}"},
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    row = [line for line in done.stdout.splitlines() if "in_domain" in line][-1]  # the table's
    assert re.search(r"in_domain\W+3\W", row), done.stdout  # the page's three problems


@pytest.mark.slow
def test_klrl_eval_that_fails_after_its_door_says_why_in_one_line_and_keeps_the_log(user_dir):
    """A config.json edited past what the door compares with the weights (intermediate_size;
    the door checks the embedding and the layer count: cluster/train/door/models.py) passes
    the door, and the engine fails loading the weights. `klrl eval` then prints one error line,
    the failure and where the whole output is, exits 1 and writes no JSON; the log it names
    holds the traceback. In a process of its own (vLLM keeps an in-process engine's state)."""
    model = user_dir / "models" / "my-model"
    config = json.loads((model / "config.json").read_text())
    config["intermediate_size"] *= 2
    (model / "config.json").write_text(json.dumps(config))
    log, out = user_dir / "eval.log", user_dir / "eval.json"
    done = subprocess.run([sys.executable, "-m", "cluster.cli", "eval", str(model), "--n", "4",
                           "--samples", "0", "--log", str(log), "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    shown = done.stdout[-2000:] + done.stderr[-2000:]
    assert done.returncode == 1, shown
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(errors) == 1, shown  # the exit's noise (Triton's leak report) went to the log
    found = re.fullmatch(rf"error: the evaluation failed: (\w+Error: .+) \(full output: "
                         rf"{re.escape(str(log))}\)", errors[0])
    assert found, errors[0]
    assert "Traceback" in log.read_text() and found.group(1)[:60] in log.read_text()
    assert not out.exists()


# On fewer GPUs than the page's command asks for (a GPU each for the worker and the learner
# rank), the learner rank and the worker share one GPU, as docs/gpu.md runs them.
ONE_GPU = ("rollout.num_gpus_per_worker=0.5", "learner.num_gpus_per_rank=0.5")


def gpu_overrides(user_dir: Path, gpus: int) -> list[str]:
    """The page's GPU command's overrides (its output_dir aside) of the page's config, on
    `gpus` local GPUs: as written where the machine has the GPUs they request (the door
    refuses more), else with the worker and the learner rank on one GPU (`ONE_GPU`); none
    without a GPU."""
    from cluster.train.door.resources import requests

    overrides = [a for a in page_command("own-submit") if "=" in a and not a.startswith("--")
                 and not a.startswith("output_dir=")]
    cfg = load_train_config(user_dir / "my_run.yaml", overrides)
    asked = sum(n * each for _, n, each in requests(cfg)["GPU"])
    if asked <= gpus:
        return overrides
    return [*overrides, *ONE_GPU] if gpus >= 1 else []


def test_the_gpu_test_fits_the_machines_gpus(user_dir):
    """What the GPU test below trains with: the page's two GPUs where there are two, one GPU
    shared where there is one (the door refuses a request above the machine's GPUs)."""
    two = gpu_overrides(user_dir, 2)
    assert "rollout.num_gpus_per_worker=1" in two and "learner.num_gpus_per_rank=1" in two
    assert not set(ONE_GPU) & set(two)
    assert gpu_overrides(user_dir, 1) == [*two, *ONE_GPU]
    assert gpu_overrides(user_dir, 0) == []


@pytest.mark.gpu
@pytest.mark.slow
def test_the_page_config_trains_on_a_gpu(user_dir, monkeypatch):
    import ray
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if ray.is_initialized():  # the workers must inherit PYTHONPATH from a cluster started here
        ray.shutdown()
    overrides = gpu_overrides(user_dir, torch.cuda.device_count())
    run_dir, metrics = _train(user_dir, monkeypatch, *overrides,
                              "rollout.gpu_memory_utilization=0.3")
    assert [m["step"] for m in metrics if "reward/mean" in m] == [1, 2]
    assert (run_dir / "final" / "config.json").is_file()
