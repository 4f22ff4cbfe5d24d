"""`klrl bench`'s weight-sync sequence (cluster/bench/sync.py) on CPU transports, with the real
learner rank and rollout worker the bench starts: every sync follows an optimizer step and
sends that new version, which the worker then holds; the learner's version cannot be moved
by hand (the mistake that stopped the sync part on a GPU: the bench renumbered the group's
copy of the version, and rank 0 refused to export under a number it did not hold). So the
GPU, whose cuda_ipc transport needs a new version per sync, is never the first to run it."""
from __future__ import annotations

import os

import pytest

from actors.weight_sync import transport
from cluster.bench.run import QUICK, _problems, _train_batch, workload_config
from cluster.bench.sync import CPU_TRANSPORTS, measure_sync

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def actors(ray_cluster, tiny_model_dir, tmp_path_factory):
    """QUICK's tiny workload as the bench starts it: one learner rank, one rollout worker, and
    one prompt's samples to step on."""
    from cluster.bench.outside import stop_worker
    from cluster.train.launch import start_learner
    from cluster.train.worker_pool import start_worker
    from learner.group import get_all

    shm = tmp_path_factory.mktemp("shm")
    cfg = workload_config(QUICK.workloads[0], tiny_model_dir, QUICK)
    cfg = cfg.model_copy(update={"sync": cfg.sync.model_copy(update={"shm_dir": str(shm)})})
    run_id = f"bench-sync-test-{os.getpid()}"
    worker = start_worker(cfg, tiny_model_dir, 0)
    group = start_learner(cfg, tiny_model_dir, run_id=run_id)
    try:
        transport(cfg.sync.transport).connect(group, [worker], get_all)
        problems = _problems(cfg)
        rollouts = ray.get(worker.generate.remote(problems, list(range(len(problems))), 0)).rollouts
        yield cfg, group, worker, _train_batch(cfg, rollouts[:cfg.rollout.samples_per_prompt])
    finally:
        try:
            stop_worker(worker)
        finally:
            group.shutdown()
            for name in CPU_TRANSPORTS:
                transport(name).for_run(run_id, cfg.sync).cleanup()


def test_each_sync_follows_a_step_and_the_worker_holds_its_version(actors):
    cfg, group, worker, batch = actors
    start = group.version
    steps, exported = [], []

    def step():
        steps.append(group.train_step(batch))
        exported.append(group.version)

    reps = 2
    syncs = measure_sync(group, worker, "tiny-random", reps, lambda num_bytes: num_bytes / 1e9,
                         step)
    per_transport = reps + 1  # one warm-up sync each
    assert [s.transport for s in syncs] == list(CPU_TRANSPORTS)
    assert exported == list(range(start + 1, start + 1 + per_transport * len(CPU_TRANSPORTS)))
    assert ray.get(worker.version.remote()) == group.version == exported[-1]
    for s in syncs:
        d = s.to_dict()
        assert s.num_bytes > 0 and s.reps == reps
        assert d["publish_seconds_per_gb"] == pytest.approx(s.publish_seconds / (s.num_bytes / 1e9))
        assert d["load_seconds_per_gb"] == pytest.approx(s.load_seconds / (s.num_bytes / 1e9))
        assert s.total_seconds >= s.load_seconds > 0 and s.publish_seconds > 0


def test_the_learners_version_moves_only_with_its_ranks(actors):
    cfg, group, worker, batch = actors
    with pytest.raises(AttributeError):
        group.version += 1  # the ranks would refuse to export under it
    held = group.version
    update = group.export_weights(CPU_TRANSPORTS[0])
    assert update.version == held  # the same weights again: the version the ranks hold

    def refused_step():  # a step the learner refuses leaves the version: the sync stops
        pass

    with pytest.raises(RuntimeError, match="refused"):
        measure_sync(group, worker, "tiny-random", 1, lambda n: 1.0, refused_step,
                     CPU_TRANSPORTS[:1])
