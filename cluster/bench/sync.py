"""Weight-sync latency for `klrl bench`, per transport, against the copy-bandwidth bound.

One sync is what the controller does after an optimizer step: `LearnerGroup.export_weights`
(gather the HF-named tensors, serialise them into the transport) and then every worker's
`RolloutWorker.load_weights` (fetch, reload into the live vLLM engine), timed from the
driver until the worker answers. Each sync here follows an optimizer step too (not timed), so
that it sends a new policy version, as in a run: a transport that hands out again what it sent
of a version already sent (cuda_ipc's snapshot) copies the weights each time. The bound is one
copy of the bytes: on CPU at the measured memcpy speed of one core (each actor has one), on
CUDA a device-to-device copy of the same bytes (cluster/bench/gpu.py): no sync can move the
weights faster than that.

Where the time goes (`parts`, medians): the learner's "gather" and "serialise_write"
(`WeightUpdate.seconds`), the worker's "fetch", "read", "reload" (vLLM's copy into its
parameters and its processing after it) and "cache_reset" (`RolloutWorker.load_seconds`);
"calls" is the rest: the Ray calls and queueing between them.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from actors.weight_sync import TRANSPORTS

# The transports measured on CPU: those that need no GPU (the registry's own order).
CPU_TRANSPORTS = tuple(name for name, t in TRANSPORTS.items() if not t.needs_gpu)


@dataclass
class SyncLatency:
    """One transport's sync latency on one workload, its parts and its copy bound."""

    model: str
    transport: str
    num_bytes: int
    publish_seconds: float    # median: learner export (gather + serialise)
    load_seconds: float       # median: worker fetch + reload, as the driver sees it
    total_seconds: float      # median: publish + load, one sync end to end
    bound_seconds: float      # one copy of num_bytes (CPU: at memcpy speed; CUDA: device to device)
    reps: int
    parts: dict[str, float] = field(default_factory=dict)  # median seconds by part (above)

    @property
    def ratio_to_bound(self) -> float:
        return self.total_seconds / self.bound_seconds

    def to_dict(self) -> dict[str, Any]:
        gb = self.num_bytes / 1e9
        return asdict(self) | {"ratio_to_bound": self.ratio_to_bound,
                               "publish_seconds_per_gb": self.publish_seconds / gb,
                               "load_seconds_per_gb": self.load_seconds / gb}


def memcpy_bytes_per_s(num_bytes: int = 256 * 2**20, reps: int = 5) -> float:
    """Best-of-`reps` copy speed of one thread between two preallocated buffers."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(num_bytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
        dst.copy_(src)  # fault the pages in before timing
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
        return num_bytes / best
    finally:
        torch.set_num_threads(threads)


def measure_sync(group, worker, model: str, reps: int,
                 bound_seconds: Callable[[int], float], step: Callable[[], Any],
                 transports: tuple[str, ...] = CPU_TRANSPORTS) -> list[SyncLatency]:
    """Sync latency of the learner `group` to the rollout `worker` for each transport
    (median of `reps` after one warm-up), against `bound_seconds(num_bytes)`. Before each
    sync `step()` takes one optimizer step of `group` (`LearnerGroup.train_step`): the sync
    sends that new version, and the worker must answer that it holds it (else RuntimeError,
    as for a step that was refused)."""
    import ray

    out = []
    for name in transports:
        publish, load, total, parts, num_bytes = [], [], [], [], 0
        for r in range(reps + 1):
            before = group.version
            step()
            if group.version != before + 1:
                raise RuntimeError(f"{model}: the optimizer step before {name} sync {r} was "
                                   f"refused (the learner still holds version {before})")
            t0 = time.perf_counter()
            update = group.export_weights(name)
            t1 = time.perf_counter()
            held = ray.get(worker.load_weights.remote(update))
            t2 = time.perf_counter()
            if not update.version == held == group.version:
                raise RuntimeError(f"{model}: {name} sync {r} sent version {update.version}, "
                                   f"the worker holds {held}, the learner {group.version}")
            if r:
                publish.append(t1 - t0)
                load.append(t2 - t1)
                total.append(t2 - t0)
                seconds = dict(update.seconds) | ray.get(worker.load_seconds.remote())
                parts.append(seconds | {"calls": (t2 - t0) - sum(seconds.values())})
            num_bytes = update.num_bytes
            del update  # object_store: frees the learner's copy in the object store
        out.append(SyncLatency(model, name, num_bytes, statistics.median(publish),
                               statistics.median(load), statistics.median(total),
                               bound_seconds(num_bytes), reps,
                               {k: statistics.median(p[k] for p in parts) for k in parts[0]}))
    return out
