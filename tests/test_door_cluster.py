"""The part of the door that needs Ray: with a ray.address the cluster's nodes are known only
once joined, and `check_cluster_resources` compares the run's CPU and GPU requests with the
alive nodes' before any actor is created (Ray would leave such an actor pending until
faults.hang_startup_s). Here against the session's real local cluster (4 logical CPUs, no
GPU); a cluster of two nodes with custom resources is tests/test_multinode.py's. Slow: Ray."""
from __future__ import annotations

import pytest

from cluster.config.loader import DEMO_CONFIG, ConfigError
from cluster.config.train_config import load_train_config
from cluster.train.door.resources import check_cluster_resources

pytestmark = pytest.mark.slow


def test_requests_the_joined_cluster_cannot_meet_are_refused(ray_cluster):
    import ray

    total = ray.cluster_resources()
    cpus, gpus = int(total.get("CPU", 0)), int(total.get("GPU", 0))
    check_cluster_resources(load_train_config(DEMO_CONFIG))  # the demo fits
    for overrides, said in (
            ([f"rollout.num_cpus_per_worker={cpus + 1}"],
             f"the run requests {cpus + 2} CPU"),
            (["rollout.num_workers=2", f"rollout.num_cpus_per_worker={cpus // 2}"],
             f"the run requests {cpus + 1} CPU"),
            ([f"learner.num_gpus_per_rank={gpus + 1}"], f"the run requests {gpus + 1} GPU")):
        with pytest.raises(ConfigError, match="Ray cluster") as refused:
            check_cluster_resources(load_train_config(DEMO_CONFIG, overrides))
        assert said in str(refused.value) and len(str(refused.value).splitlines()) == 1
