"""The order a run starts its parts in (cluster/train/launch.py, `start_engines_and_learner`):
where a learner rank may share a GPU with a rollout worker's engine, the learner starts only
once every engine has reported ready (vLLM profiles the GPU's memory device-wide while its
engine starts: a learner loading in that window shrinks the KV cache or fails the start);
elsewhere side by side. Checked on the controller's start and on `klrl bench`'s actors, with
stand-ins for the parts that record when they start and when the engines report ready (no
GPU here: the configs only request GPUs, nothing starts)."""
from __future__ import annotations

import pytest

from cluster.bench import run as bench_run
from cluster.config.loader import DEMO_CONFIG
from cluster.config.train_config import load_train_config
from cluster.train import controller as controller_module
from cluster.train.controller import Controller

SHARED = ("learner.num_gpus_per_rank=0.5", "rollout.num_gpus_per_worker=0.5")
ENGINES_FIRST = ["engine 0 started", "engine 1 started", "engines ready", "learner started"]
SIDE_BY_SIDE = ["engine 0 started", "engine 1 started", "learner started", "engines ready"]


def _cfg(*overrides: str):
    return load_train_config(DEMO_CONFIG, ["logging.wandb_mode=disabled", *overrides])


@pytest.mark.parametrize(("overrides", "shared"), [
    ((), False),                                                    # CPU
    (SHARED, True),                                                 # one GPU, 0.5 each
    (("learner.num_gpus_per_rank=0.3", "rollout.num_gpus_per_worker=0.6"), True),
    (("learner.num_gpus_per_rank=0.5", "rollout.num_gpus_per_worker=0.6"), False),  # > 1
    (("learner.num_gpus_per_rank=1", "rollout.num_gpus_per_worker=1",
      "sync.transport=object_store"), False),                       # a GPU each
    (("learner.num_gpus_per_rank=1",), True),  # a worker without a GPU sees the learner's
])
def test_which_gpu_requests_may_put_the_learner_beside_an_engine(overrides, shared):
    assert _cfg(*overrides).learner_may_share_a_gpu is shared


class _Pool:
    """The controller's WorkerPool: records its engines' starts and their readiness."""

    def __init__(self, cfg, model_dir, recovery, *, events):
        self.events = events
        events += [f"engine {i} started" for i in range(cfg.rollout.num_workers)]

    def wait_started(self):
        self.events.append("engines ready")


class _Connected(Exception):
    """The start reached the weight transport's connect: both parts are up."""


@pytest.mark.parametrize(("overrides", "order"), [(SHARED, ENGINES_FIRST), ((), SIDE_BY_SIDE)])
def test_the_controller_starts_the_learner_after_the_engines_on_a_shared_gpu(
        tmp_path, monkeypatch, overrides, order):
    events: list[str] = []
    cfg = _cfg("rollout.num_workers=2", "rollout.prompts_per_step=4", *overrides)
    monkeypatch.setattr(controller_module, "WorkerPool",
                        lambda *a, **kw: _Pool(*a, **kw, events=events))
    monkeypatch.setattr(controller_module, "start_learner",
                        lambda *a, **kw: events.append("learner started") or "learner")
    c = Controller(cfg, tmp_path / "run", tmp_path / "model")

    def connect(learner, pool):
        assert (learner, pool) == ("learner", c.pool)
        raise _Connected

    monkeypatch.setattr(c.weights, "connect", connect)
    with pytest.raises(_Connected):
        c._start()
    c.log.close()
    assert events == order


class _Worker:
    """A rollout worker actor as the bench's start uses it: `version.remote()`'s answer is
    the engine reporting ready."""

    def __init__(self, events, index):
        self.events, self.index = events, index
        self.version = self
        events.append(f"engine {index} started")

    def remote(self):
        return "ready"


@pytest.mark.parametrize(("overrides", "order"), [(SHARED, ENGINES_FIRST[:1] + ENGINES_FIRST[2:]),
                                                  ((), SIDE_BY_SIDE[:1] + SIDE_BY_SIDE[2:])])
def test_the_bench_starts_its_learner_after_the_engine_on_a_shared_gpu(
        tmp_path, monkeypatch, overrides, order):
    events: list[str] = []
    cfg = _cfg(f"model.path={tmp_path}", f"sync.shm_dir={tmp_path}", *overrides)

    class Learner:
        @property
        def rank_info(self):
            raise _Connected  # both parts are up: the measurements would start here

        def shutdown(self):
            events.append("learner stopped")

    def get(ref, **_):
        assert ref == "ready"
        events.append("engines ready")

    monkeypatch.setattr(bench_run, "start_worker",
                        lambda cfg, model_dir, i: _Worker(events, i))
    monkeypatch.setattr(bench_run, "start_learner",
                        lambda *a, **kw: events.append("learner started") or Learner())
    monkeypatch.setattr(bench_run.ray, "get", get)
    monkeypatch.setattr(bench_run, "stop_worker", lambda w: events.append("engine stopped"))
    result = bench_run.WorkloadResult("w", 0)
    with pytest.raises(_Connected):
        bench_run._measure_actors(bench_run.Workload("w", "tiny"), cfg, bench_run.QUICK,
                                  engines=False, bound=None, result=result)
    assert events == [*order, "engine stopped", "learner stopped"]
