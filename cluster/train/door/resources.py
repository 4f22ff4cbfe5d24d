"""Resources: what the run's actors request (CPUs, GPUs, custom resources) against what can
supply them. Ray keeps an actor whose request no node can meet pending, and the run would wait
for faults.hang_startup_s before failing; here it is refused in one line instead.

Without ray.address (or RAY_ADDRESS) the run starts a local cluster on this machine:
`check_local_resources` compares the requests with ray.num_cpus and this machine's GPUs before
anything starts. With an address the cluster's nodes are known only once joined:
`check_cluster_resources` runs then, before any actor is created. Both check necessary
conditions (totals, and each single request against the largest node), not a placement.
"""
from __future__ import annotations

from cluster.config.loader import ConfigError
from cluster.config.train_config import TrainConfig

_EPS = 1e-9  # absorbs 0.1 + 0.2 arithmetic in fractional requests


def requests(cfg: TrainConfig) -> dict[str, list[tuple[str, int, float]]]:
    """{resource: [(option, actors, amount each)]}: the CPUs and GPUs of the rollout workers,
    the learner ranks and the environment actors, with the option that sets each amount."""
    r, lc, pool = cfg.rollout, cfg.learner, cfg.task.environment.pool
    return {
        "CPU": [("rollout.num_cpus_per_worker", r.num_workers, r.num_cpus_per_worker),
                ("learner.num_cpus_per_rank", lc.num_ranks, lc.num_cpus_per_rank),
                ("task.environment.pool.cpus_per_actor",
                 r.num_workers * pool.actors_per_worker * cfg.task.environment.enabled,
                 pool.cpus_per_actor)],
        "GPU": [("rollout.num_gpus_per_worker", r.num_workers, r.num_gpus_per_worker),
                ("learner.num_gpus_per_rank", lc.num_ranks, lc.num_gpus_per_rank)],
    }


def _check(cfg: TrainConfig, name: str, total: float, largest: float, where: str,
           fix: str) -> None:
    wanted = [(option, n, each) for option, n, each in requests(cfg)[name] if n and each]
    need = sum(n * each for _, n, each in wanted)
    if need <= total + _EPS and all(each <= largest + _EPS for _, _, each in wanted):
        return
    asked = " + ".join(f"{n} x {option}={each:g}" for option, n, each in wanted)
    raise ConfigError(f"the run requests {need:g} {name} ({asked}) but {where} has {total:g}"
                      + (f" (at most {largest:g} on one node)" if largest < total else "")
                      + f"; {fix}")


def local_gpus() -> int:
    """GPUs this machine shows (CUDA_VISIBLE_DEVICES honoured), as a local Ray cluster finds
    them; 0 without CUDA. Initialises no CUDA context."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_local_resources(cfg: TrainConfig) -> None:
    """A local cluster (no address): ray.num_cpus, when set, must hold every CPU the run
    reserves (null sizes the cluster to fit), and this machine must have the GPUs it asks for."""
    if cfg.ray.num_cpus is not None:
        _check(cfg, "CPU", cfg.ray.num_cpus, cfg.ray.num_cpus, "the local cluster "
               f"(ray.num_cpus={cfg.ray.num_cpus})", "raise ray.num_cpus (or drop it: null "
               "sizes the cluster to fit) or lower the requests")
    if any(n and each for _, n, each in requests(cfg)["GPU"]):
        gpus = local_gpus()
        _check(cfg, "GPU", gpus, gpus, "this machine", "lower the GPU requests (0 on a CPU "
               "machine), or join a cluster with GPUs (ray.address)")


def check_cluster_resources(cfg: TrainConfig) -> None:
    """Once connected to Ray, before any actor is created: the alive nodes' CPUs and GPUs
    hold every request (in total, and each request on one node), and enough nodes carry the
    custom resources of ray.worker_resources / ray.learner_resources for every rollout worker
    / learner rank. Read from the nodes up now: an autoscaling cluster must have them running
    when the run starts."""
    import ray  # the caller has connected

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    for name in ("CPU", "GPU"):
        amounts = [n["Resources"].get(name, 0.0) for n in nodes]
        _check(cfg, name, sum(amounts), max(amounts, default=0.0),
               f"the Ray cluster ({len(nodes)} alive node(s))", "add nodes with them "
               "(`ray start --address ...`), or lower the requests")
    for field, wanted, count, what in (
            ("ray.worker_resources", cfg.ray.worker_resources, cfg.rollout.num_workers,
             "rollout worker"),
            ("ray.learner_resources", cfg.ray.learner_resources, cfg.learner.num_ranks,
             "learner rank")):
        for name, amount in wanted.items():
            # how many such actors fit, node by node
            fits = sum(int(n["Resources"].get(name, 0) / amount + _EPS) for n in nodes)
            if fits < count:
                have = ", ".join(f"{n['NodeManagerAddress']} {n['Resources'].get(name, 0):g}"
                                 for n in nodes)
                raise ConfigError(
                    f"{field}: {count} {what}(s) each request {name}={amount:g}, but the Ray "
                    f"cluster's nodes hold room for {fits} ({name} per node: {have}); start the "
                    f"nodes with `ray start ... --resources='{{\"{name}\": N}}'`, or change "
                    f"{field} (a local cluster, without ray.address, has no custom resources)")


def check_allocation(configs: list[TrainConfig], nodes: int, gpus_per_node: int,
                     cpus_per_node: int | None, parallel: int = 1) -> None:
    """`klrl slurm`: the job's allocation against what its runs' actors request (`parallel` runs
    at once for a sweep). GPUs reserved while no actor asks for one are refused (SLURM would
    hold them idle for the whole job), and so is an allocation without room for the requests
    (Ray would keep the actors pending). CPUs are checked when --cpus-per-node gives them."""
    given = f"--nodes {nodes} --gpus-per-node {gpus_per_node}"
    gpus = [sum(n * each for _, n, each in requests(cfg)["GPU"]) for cfg in configs]
    if gpus_per_node and not any(gpus):
        raise ConfigError(
            f"--gpus-per-node {gpus_per_node}: the job would reserve {nodes * gpus_per_node} "
            "GPU(s), but the run's actors ask for none (rollout.num_gpus_per_worker=0, "
            "learner.num_gpus_per_rank=0); drop --gpus-per-node, or give them GPUs "
            "(rollout.num_gpus_per_worker=1 learner.num_gpus_per_rank=1)")
    at_once = min(parallel, len(configs))
    for cfg in configs:
        _check(cfg, "GPU", nodes * gpus_per_node / at_once, gpus_per_node,
               f"the job ({given}" + (f", {at_once} runs at once" if at_once > 1 else "") + ")",
               "raise --gpus-per-node or --nodes, or lower the requests")
        if cpus_per_node is not None:
            _check(cfg, "CPU", nodes * cpus_per_node / at_once, cpus_per_node,
                   f"the job (--nodes {nodes} --cpus-per-node {cpus_per_node}"
                   + (f", {at_once} runs at once" if at_once > 1 else "") + ")",
                   "raise --cpus-per-node or --nodes, or lower the requests")
