"""A relative path means the same in every process of a run (issue #35, 3): a Ray actor's
working directory is the one its cluster started in, not the driver's, so `model.path:
models/my-model` (docs/own-model.md) would not be found by a learner rank on a cluster
started elsewhere, and would be taken for a hub name. The driver makes the config's paths
absolute once (cluster/train/door/paths.py) before anything is sent to Ray.

Here the session's Ray cluster starts in one directory and the run in another, with its
model, datasets and output_dir given relative to the latter; an actor shows that its working
directory differs (and that the relative path does not reach the model from it), and the run
trains to the end. Starts Ray, vLLM and DeepSpeed: slow."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from cluster.config.loader import DEMO_CONFIG
from cluster.config.train_config import load_train_config

pytestmark = pytest.mark.slow

MATH_FIXTURE = Path(__file__).resolve().parents[1] / "rewards" / "data" / "math_fixture.jsonl"


@pytest.fixture
def elsewhere(ray_cluster, tiny_model_dir, tmp_path, monkeypatch):
    """A user's directory, current, with models/my-model and data/*.jsonl in it; the session's
    Ray cluster is up already (started from where pytest runs, not here)."""
    shutil.copytree(tiny_model_dir, tmp_path / "models" / "my-model")
    (tmp_path / "data").mkdir()
    shutil.copy(MATH_FIXTURE, tmp_path / "data" / "train.jsonl")
    shutil.copy(MATH_FIXTURE, tmp_path / "data" / "test.jsonl")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_a_run_with_relative_paths_trains_when_its_actors_work_elsewhere(elsewhere):
    import ray

    from cluster.train.run import train
    from cluster.train.run_log import is_finished, read_metrics

    @ray.remote(num_cpus=0)
    class Probe:
        def cwd(self) -> str:
            return os.getcwd()

        def exists(self, path: str) -> bool:
            return Path(path).exists()

    probe = Probe.remote()
    assert ray.get(probe.cwd.remote()) != os.getcwd()  # the actors work elsewhere
    assert not ray.get(probe.exists.remote("models/my-model"))  # where the relative path misses
    assert ray.get(probe.exists.remote(str(elsewhere / "models" / "my-model")))
    ray.kill(probe)

    cfg = load_train_config(DEMO_CONFIG, [
        "model.path=models/my-model", "task.name=math", "task.options.train=data/train.jsonl",
        "task.options.in_domain=data/test.jsonl", "eval.out_of_domain=null",
        "task.reward=scorers:short_answers", "output_dir=runs", "run_name=relative",
        "total_steps=2", "eval_every=0", "eval.num_problems=2", "eval.samples=0",
        "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
        "rollout.max_new_tokens=8", "logging.wandb_mode=disabled"])
    run_dir, _ = train(cfg)
    assert run_dir == Path("runs") / "relative"  # as the config names it, from here
    assert is_finished(run_dir)
    assert [m["step"] for m in read_metrics(run_dir) if "reward/mean" in m] == [1, 2]
    saved = load_train_config(run_dir / "config.yaml")  # what every process was given
    assert saved.model.path == str(elsewhere / "models" / "my-model")
    assert saved.task.options["train"] == str(elsewhere / "data" / "train.jsonl")
    assert saved.output_dir == str(elsewhere / "runs")
