"""`LearnerGroup`: the controller's handle on the learner, `num_ranks` LearnerRank Ray actors.

Every call fans out to all ranks at once (the ranks run collectives in lockstep) and waits for
all of them. If any rank fails, the group is broken (the others may be blocked in a
collective): the error is raised at once rather than waiting on the rest; call `shutdown()`.
How long it waits is its owner's choice (`wait`: cluster/train/deadlines.py gives every call a
deadline); `health()` answers on a thread of each rank's own, even while a call runs.

Invariant (enforced in `train_step`): `version` is the number of rollout batches trained with at
least one applied optimizer step, on every rank alike; a batch whose every step was refused
(non-finite) leaves it unchanged. A batch takes learner.epochs x learner.mini_batches optimizer
steps (one by default).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from kl.config import AdvantageConfig, KLConfig
from learner.batch import TrainBatch
from learner.config import LearnerConfig
from learner.export import WeightPublisher
from learner.loading import ModelFiles
from learner.loss_metrics import merge_metrics, merge_updates
from learner.lr_schedules import lr_schedule
from learner.process_group import remove_shm_buffers
from learner.rank import LearnerRank


class LearnerGroup:
    """The controller's handle on the learner: owns the `LearnerRank` actors (starts them, meets
    them in one process group, kills them), fans every call out to all of them in lockstep,
    merges their metrics, and keeps the policy version (module docstring; the math is in
    learner/rank.py)."""

    def __init__(self, model: str | Path | ModelFiles, learner_cfg: LearnerConfig,
                 kl_cfg: KLConfig, adv_cfg: AdvantageConfig, seed: int = 0,
                 publisher: WeightPublisher | None = None,
                 total_optimizer_steps: int | None = None,
                 resources: dict[str, float] | None = None,
                 wait: Callable[[LearnerGroup, list, str], list] | None = None,
                 collective_timeout_s: float | None = None):
        """`model`: the policy's directory (also the reference), or a ModelFiles (a separate
        reference, hub revision, remote code; cluster/train/launch.py builds it from
        TrainConfig.model). `publisher`: the weight sync `export_weights` uses
        (learner.export.WeightPublisher; cluster/ passes actors.weight_sync.WeightPublisher).
        Every rank gets a copy; rank 0's publishes. `total_optimizer_steps`: the run's
        optimizer steps (total_steps x updates_per_batch), where a decaying learner.lr_schedule
        ends; required by linear and cosine. `resources`: custom Ray resources each rank
        requests (placement on chosen nodes, e.g. {"head": 1}). `wait(group, refs, method)`:
        how every call on the ranks is waited for (default: `get_all`, without a deadline).
        `collective_timeout_s`: the process group's timeout (LearnerRank.setup)."""
        if lr_schedule(learner_cfg.lr_schedule).decays and total_optimizer_steps is None:
            # Refused here, before any actor starts (make_scheduler would refuse in every rank).
            raise ValueError(f"learner.lr_schedule={learner_cfg.lr_schedule} needs "
                             "LearnerGroup(..., total_optimizer_steps=N)")
        self.cfg = learner_cfg
        self._version = 0  # mirrors every rank's own count (`version`)
        self._wait = wait or (lambda _group, refs, _method: get_all(refs))
        self.broken = False  # a call failed or hung: ranks may be blocked in a collective
        self.failure: str | None = None  # the call that broke it, and its failed ranks
        world = learner_cfg.num_ranks
        # "health": a thread of its own in each rank, so `health` answers while a call runs;
        # every other method runs in the default group, one at a time (the lockstep above).
        # OMP_NUM_THREADS from the start (Ray would set it to num_cpus): OpenMP reads it once,
        # and the thread pool Ray runs calls on does not see set_num_threads of another thread.
        actor = ray.remote(concurrency_groups={"health": 1})(LearnerRank).options(
            num_cpus=learner_cfg.num_cpus_per_rank, num_gpus=learner_cfg.num_gpus_per_rank,
            runtime_env={"env_vars": omp_env(learner_cfg)},
            resources=resources or None)
        files = ModelFiles.of(model)
        self.ranks = [actor.remote(r, world, files, learner_cfg, kl_cfg, adv_cfg, seed,
                                   publisher, total_optimizer_steps)
                      for r in range(world)]
        try:
            infos = self._all("node_info")
            nodes = [i["node_id"] for i in infos]
            # One node: rendezvous on loopback. Several: rank 0's node address.
            addr = "127.0.0.1" if len(set(nodes)) == 1 else infos[0]["ip"]
            port = ray.get(self.ranks[0].host_rendezvous.remote(addr, collective_timeout_s))
            # Where the ranks' /dev/shm buffers are named after, when they all share the
            # driver's node: shutdown then removes what a killed rank could not.
            here = ray.get_runtime_context().get_node_id()
            self._local_rendezvous = (addr, port) if set(nodes) == {here} else None
            local = [nodes[:r].count(nodes[r]) for r in range(world)]
            self.rank_info = self._get([  # per rank: parameter count, optimizer class
                h.setup.remote(addr, port, local[r], nodes.count(nodes[r]), collective_timeout_s)
                for r, h in enumerate(self.ranks)], "setup")
        except BaseException:
            self.shutdown()
            raise

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    @property
    def version(self) -> int:
        """The policy version the ranks hold (module docstring). Read-only: each rank keeps
        its own count and refuses to export under another number, so only what moves the
        ranks' count moves this one (an applied `train_step`, `load_checkpoint`)."""
        return self._version

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """Train on the global batch (learner.epochs x learner.mini_batches optimizer steps);
        returns merged metrics (learner.loss_metrics: merge_metrics over ranks, then
        merge_updates), including `nonfinite` (1: every step refused) and `grad/norm`."""
        world, n = self.num_ranks, batch.num_sequences
        shards = [batch.shard(r, world) for r in range(world)]  # whole groups, equal sizes
        per_rank = self._get([h.train_step.remote(s, n) for h, s in zip(self.ranks, shards)],
                             "train_step")
        updates = []
        for parts in zip(*per_rank):  # update k of every rank
            refused = {p["nonfinite"] for p in parts}
            assert len(refused) == 1, f"ranks disagree on refusing a step: {refused}"  # rank.py
            updates.append(merge_metrics(list(parts)))
        merged = merge_updates(updates, self.cfg.mini_batches)
        if not merged["nonfinite"]:
            self._version += 1
        return merged

    def export_weights(self, transport: str):
        """Publish the current weights (version `self.version`) through `transport` (built
        with its settings by the publisher this group was given); returns rank 0's
        WeightUpdate (learner/export.py)."""
        return self._all("export_weights", self.version, transport)[0]

    def open_weight_transfer(self, transport: str, num_workers: int) -> list[dict]:
        """GPU, a transport whose workers join a group (nccl): rank 0 opens it (through its
        publisher); returns each rollout worker's init info. The transport's `connect`
        (actors/weight_sync/) joins the workers: learner/ does not drive actors/."""
        return ray.get(self.ranks[0].open_weight_transfer.remote(transport, num_workers))

    def connect_weight_transfer(self, transport: str) -> ray.ObjectRef:
        """Rank 0 joins the group. Returns the call's ref without waiting: it blocks until every
        worker has joined, so the caller waits on it together with the joins (`get_all`)."""
        return self.ranks[0].connect_weight_transfer.remote(transport)

    def cuda_device_uuid(self) -> str:
        """GPU only: the CUDA device UUID of rank 0, the learner's end of a weight transfer
        on the GPU (nccl, cuda_ipc)."""
        return ray.get(self.ranks[0].cuda_device_uuid.remote())

    def save_hf(self, out_dir: str | Path) -> Path:
        """The policy in Hugging Face format (config, tokenizer, safetensors) under `out_dir`."""
        return Path(self._all("save_hf", str(out_dir))[0])

    def save_checkpoint(self, directory: str | Path, tag: str) -> None:
        """DeepSpeed checkpoint under directory/tag (weights, optimizer, scheduler, version)."""
        self._all("save_checkpoint", str(directory), tag)

    def load_checkpoint(self, directory: str | Path, tag: str) -> int:
        """Restore a checkpoint saved by `save_checkpoint`; returns (and sets) the version."""
        versions = {s["version"] for s in self._all("load_checkpoint", str(directory), tag)}
        assert len(versions) == 1, f"ranks restored different versions: {versions}"
        self._version = versions.pop()
        return self._version

    def named_parameters_for_inference(self) -> dict:
        return self._all("named_parameters_for_inference")[0]

    def health(self, timeout: float) -> list[float | None]:
        """Per rank: seconds since it last made progress (LearnerRank.health), or None if it
        did not answer within `timeout` (frozen, dead, or its node unreachable)."""
        refs = [h.health.options(concurrency_group="health").remote() for h in self.ranks]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        out: list[float | None] = []
        for ref in refs:
            try:
                out.append(ray.get(ref) if ref in ready else None)
            except ray.exceptions.RayError:
                out.append(None)
        return out

    def memory(self) -> list[dict[str, int]]:
        """Each rank's bytes held (LearnerRank.memory), in rank order."""
        return self._all("memory")

    def shutdown(self) -> None:
        """Free the ranks' shared-memory buffers, then kill the rank actors (their process
        group dies with them). Best effort: a dead or hung rank must not block shutdown."""
        ranks = getattr(self, "ranks", [])
        local = getattr(self, "_local_rendezvous", None)
        broken = getattr(self, "broken", False)
        if ranks and not (broken and local):
            # A dead or hung rank cannot free its buffers, which outlive it in /dev/shm (RAM):
            # the driver removes them below when it shares the ranks' node (so a broken group
            # there is not asked). On the health thread, so a rank blocked in a call still
            # frees its own; a frozen one never answers, hence the short wait when broken.
            with contextlib.suppress(Exception):
                ray.get([h.release_shm.options(concurrency_group="health").remote()
                         for h in ranks], timeout=5 if broken else 30)
        for h in ranks:
            ray.kill(h, no_restart=True)
        self.ranks = []
        if local is not None:
            remove_shm_buffers(*local)

    def _all(self, method: str, *args) -> list[Any]:
        return self._get([getattr(h, method).remote(*args) for h in self.ranks], method)

    def _get(self, refs: list, method: str) -> list[Any]:
        try:
            return self._wait(self, refs, method)
        except BaseException:
            self.broken = True
            try:
                failed = failed_ranks(refs)
            except Exception:  # noqa: BLE001 - naming the ranks must not hide the failure
                failed = []
            self.failure = method + (f" on rank {', '.join(map(str, failed))}" if failed else "")
            raise


def failed_ranks(refs: list) -> list[int]:
    """The indices of `refs` (one per rank) whose call has already failed; waits for none."""
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    failed = []
    for rank, ref in enumerate(refs):
        if ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayError:
                failed.append(rank)
    return failed


def get_all(refs: list) -> list:
    """ray.get of every ref, raising the first error as soon as it happens: the other ranks
    may then be blocked forever in a collective with the failed one."""
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        ray.get(ready)  # raises a failed rank's exception now
    return ray.get(refs)


def omp_env(cfg: LearnerConfig) -> dict[str, str]:
    """The OpenMP environment of a rank's process, set at its start (OpenMP reads it once):
    its thread count, and `learner.omp_wait_policy` passive as OMP_WAIT_POLICY=PASSIVE (a rank
    sharing its cores with generating workers gives a core back as soon as a thread idles,
    instead of spinning on it; TrainConfig.rank_learner resolves when)."""
    env = {"OMP_NUM_THREADS": str(cfg.threads)}
    if cfg.omp_wait_policy == "passive":  # null (unresolved) and default: OpenMP's own
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    return env
