"""The controller's books on the weight sync: the run's transport (actors/weight_sync/), the
version last published, and every weight load queued on a worker with the moment its
`sync.timeout_s` starts counting.

Sync deadlines: a weight load is queued behind the generate calls already sent to the worker,
so it cannot start before the newest of them has finished. Each load therefore gets its own
`sync.timeout_s`, counted from the moment that batch was generated (`PendingSync.ready_since`),
never from when the load was queued (at max_lag k it waits behind up to k generate calls).
With continuous generation (`rollout.in_flight_updates`, actors/generation/) the generate calls
run in a concurrency group of their own and a load is applied between two engine steps while
they run: the generation mode queues it behind nothing (`loads_queue_behind`), and its
`sync.timeout_s` counts from the publish.

Invariant (enforced in `WeightSyncState.publish`): before version v is published, every load
of a version below v - 1 has finished, so at most one version's loads are in flight per worker
and no worker has to load a version its transport no longer holds (shm keeps the newest two
files, cuda_ipc the newest two GPU snapshots, and nccl broadcasts one version at a time).
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError

from actors.config import SyncConfig
from actors.weight_sync import transport
from cluster.train.deadlines import Deadline, Hung
from cluster.train.error_line import error_line
from cluster.train.worker_pool import InFlight, WorkerCall
from learner.group import get_all


@dataclass
class PendingSync:
    """A queued weight load, and when it could start (see the module docstring)."""

    call: WorkerCall
    after: InFlight | None       # the newest batch queued before it on that worker
    ready_since: float | None    # time.monotonic() once `after` was generated; None before

    @property
    def version(self) -> int:
        return self.call.args[0].version


class WeightSyncState:
    """Owns a run's weight sync as the controller sees it: connects the transport at start,
    publishes each new version and queues its loads, holds every load to its deadline,
    re-syncs a replaced or resumed worker, and cleans the transport up at the end. The
    learner (a LearnerGroup) and the worker pool are given at `connect`."""

    def __init__(self, cfg: SyncConfig, run_id: str):
        self.cfg = cfg
        self.transport = transport(cfg.transport).for_run(run_id, cfg)  # with its settings
        self.published_version = 0   # version of the weights the workers were last sent
        self.loads: list[PendingSync] = []  # weight loads not yet confirmed
        self.learner = self.pool = None

    def connect(self, learner, pool) -> None:
        """Once every worker's engine is up: join learner rank 0 and the workers as the
        transport needs (GPU only: nccl's group, cuda_ipc's engines; nothing for the others)."""
        self.learner, self.pool = learner, pool
        self.transport.connect(learner, pool.workers, get_all)

    def resume(self) -> None:
        """A resumed run: every worker gets the learner's restored weights."""
        for w in self.pool.workers:
            self.resync(w)
        self.published_version = self.learner.version

    def rewind(self) -> None:
        """A learner restart kept the workers (their calls settled): each loads the restored
        weights though it holds a later version (`RolloutWorker.rewind_weights`). One that
        fails to, dies or does not answer within sync.timeout_s is replaced (one restart) and
        its replacement re-synced."""
        update = self.learner.export_weights(self.cfg.transport)
        calls = [self.pool.call(i, "rewind_weights", update) for i in range(len(self.pool))]
        for call in calls:
            try:
                held = ray.get(call.ref, timeout=self.cfg.timeout_s)
            except (RayError, GetTimeoutError) as exc:
                self.pool.restart(call.worker, "could not load the checkpoint's weights "
                                               f"({error_line(exc, 200)})")
                continue
            if held != update.version:
                raise RuntimeError(f"rewound worker {call.worker} holds version {held}, the "
                                   f"learner {update.version}")
        self.published_version = update.version

    def publish(self, in_flight: Sequence[InFlight]) -> dict:
        """Publish the learner's new weights and queue their load on every worker, behind the
        newest batch of `in_flight` (oldest first). Not awaited here: each worker applies it
        before its next generate call; failures surface in `check`."""
        version = self.learner.version
        if version == self.published_version:
            return {}  # a refused step changed nothing: the workers already hold these weights
        t0 = time.perf_counter()
        # The invariant (module docstring); confirming the loads of the last version published
        # can wait behind the generate calls sent before them.
        self.check(settle_through=self.published_version - 1)
        self.published_version = version
        update = self.learner.export_weights(self.cfg.transport)
        after = in_flight[-1] if in_flight else None
        self.loads += [PendingSync(self.pool.call(i, "load_weights", update), after,
                                   None if after else time.monotonic())
                       for i in range(len(self.pool))]
        return {"time/weight_publish": time.perf_counter() - t0}

    def batch_generated(self, batch: InFlight) -> None:
        """`batch` has been generated: the loads queued right behind it can run from now."""
        for sync in self.loads:
            if sync.after is batch and sync.ready_since is None:
                sync.ready_since = time.monotonic()

    def check(self, settle_through: int | None = None) -> None:
        """Every weight load that could start must finish within sync.timeout_s of that moment
        (module docstring), else the run fails loudly. Loads still queued behind a batch in
        flight are checked later, except those of versions <= `settle_through`, whose batch is
        waited for first. A worker that died meanwhile is replaced (and re-synced)."""
        timeout, waiting = self.cfg.timeout_s, []
        for sync in self.loads:
            if not self.pool.is_current(sync.call):
                continue  # its worker was replaced and re-synced to the current weights
            if (sync.ready_since is None and settle_through is not None
                    and sync.version <= settle_through):
                self._wait_for_generation(sync)
                if not self.pool.is_current(sync.call):
                    continue
            if sync.ready_since is None:
                waiting.append(sync)
                continue
            try:
                remaining = sync.ready_since + timeout - time.monotonic()
                ray.get(sync.call.ref, timeout=max(0.0, remaining))
            except RayActorError:
                self.pool.restart(sync.call.worker, "died while loading weights")
            except GetTimeoutError:
                self._on_late_load(sync, timeout)
        self.loads = waiting

    def resync(self, worker) -> None:
        """Give a fresh worker (a replacement, or any worker of a resumed run) the current
        weights and check it holds them (by version)."""
        self.transport.after_restart(self.learner, worker, get_all)
        step = self.learner.version
        if step > 0:
            update = self.learner.export_weights(self.cfg.transport)
            ray.get(worker.load_weights.remote(update), timeout=self.cfg.timeout_s)
        version = ray.get(worker.version.remote(), timeout=self.cfg.timeout_s)
        if version != step:
            raise RuntimeError(f"re-synced worker holds version {version}, the learner {step}")

    def cleanup(self) -> None:
        """Remove what the transport left behind (shm: the run's files; /dev/shm is RAM)."""
        self.transport.cleanup()

    def _on_late_load(self, sync: PendingSync, timeout: float) -> None:
        """A load past its sync.timeout_s: a worker that no longer answers (frozen, as a hang
        in the load itself or just before it leaves it) is hung and replaced like one that
        hangs in generate (one restart; the replacement is re-synced); a live worker whose
        load is that slow is a broken sync, which a restart would not mend: the run fails."""
        i, version = sync.call.worker, sync.version
        why = self.pool.unresponsive(i)
        if why is None:
            raise TimeoutError(f"rollout worker {i} did not load weights version {version} "
                               f"within sync.timeout_s={timeout:g} of being able to start")
        deadline = Deadline(timeout, timeout, f"sync.timeout_s={timeout:g}")
        self.pool.restart(i, Hung(f"rollout worker {i}", f"its load of weights version {version}",
                                  timeout, why, deadline).detail)

    def _wait_for_generation(self, sync: PendingSync) -> None:
        """Wait until the worker of `sync` has generated the batch queued before its load (a
        worker that dies meanwhile has answered; one that hangs is replaced); from then on the
        load can run, and its sync.timeout_s counts."""
        self.pool.wait_done([c for c in sync.after.calls if c.worker == sync.call.worker])
        sync.ready_since = time.monotonic()
