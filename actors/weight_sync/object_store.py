"""The object_store transport: the safetensors *bytes* are `ray.put` by learner rank 0 (which
owns the object) and fetched by each worker with `ray.get(ref, timeout=...)`: any nodes, CPU
or GPU. The bytes travel to vLLM's worker process as a `collective_rpc` argument (bytes survive
vLLM's serialisation; tensors passed that way arrive broken).
"""
from __future__ import annotations

import time

from actors.weight_sync.base import Fetched, SafetensorsTransport
from actors.weight_sync.traits import ObjectStoreTraits


class ObjectStoreTransport(ObjectStoreTraits, SafetensorsTransport):
    """Owns putting each version's bytes in Ray's object store and getting them in the
    worker within the sync's deadline. The object lives as long as its ref (the record)."""

    def store(self, tensors, metadata, version):
        import ray
        from safetensors.torch import save

        data = save(tensors, metadata=metadata)
        return {"ref": ray.put(data)}, len(data)

    def fetch(self, update, deadline) -> Fetched:
        import ray
        from ray.exceptions import GetTimeoutError

        t0 = time.perf_counter()
        try:
            data = ray.get(update.ref, timeout=max(0.0, deadline - time.monotonic()))
        except GetTimeoutError as e:
            raise TimeoutError(f"weights of version {update.version} not fetched from the "
                               "object store in time") from e
        return Fetched(data, {"fetch": time.perf_counter() - t0})
