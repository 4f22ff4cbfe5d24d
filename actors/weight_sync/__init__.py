"""Weight sync from the learner to the rollout workers, one package: `sync.transport` names a
transport of `registry.TRANSPORTS`, and that object does everything the transport does.

One sync, step by step:

1. Learner rank 0 (a Ray actor) calls `WeightPublisher.publish(named_tensors, version,
   transport)` (learner/export.py, through the publisher cluster/ gave it, which builds each
   transport with its own settings for the run: `WeightTransport.for_run`) with the full
   Hugging Face-named state dict (gathered under ZeRO-3), and gets a `WeightUpdate`, a small
   picklable record, back.
2. The controller sends that record to every worker: `worker.load_weights.remote(update)`
   (cluster/train/weight_sync_state.py keeps the books: versions, queued loads, deadlines).
3. The worker fetches the weights (within `SyncConfig.timeout_s`) and reloads them into its
   engine (`RolloutWorker.load_weights`: the transport's `fetch`, then its `reload` on the
   engine thread), resets the prefix cache (cached KV blocks were computed with the old
   weights) and records the new version.

What each transport is (its config rules and traits, without torch: what the config reads)
is `traits.py`; the transports, one module each, inherit it (`base.py` says what every
transport answers):
- `shm.py`: a safetensors file in a tmpfs; learner and workers on one node.
- `object_store.py`: the safetensors bytes in Ray's object store; any nodes, CPU or GPU.
- `nccl.py` (GPU only): a broadcast through vLLM's NCCL weight-transfer engine; learner rank 0
  and every worker on GPUs of their own.
- `cuda_ipc.py` (GPU only): CUDA IPC handles of a GPU snapshot through vLLM's IPC
  weight-transfer engine; learner rank 0 and every worker on ONE GPU.

`lm_head.weight` must be in every update, also for models with tied embeddings: vLLM's
layerwise reload keeps the *old* values of any layer whose weights were not sent (it only
logs "Failed to load weights"), and its tied lm_head is a layer of its own, so leaving it out
makes the engine's log-probs silently diverge from the learner's. `WeightPublisher.publish`
refuses an update without it.
"""
from __future__ import annotations

import importlib
from typing import Any

# Each public name and the module that owns it, imported on first use (PEP 562): importing
# traits.py (what the config reads) runs no torch through this __init__.
_HOMES = {
    "LM_HEAD": "actors.weight_sync.base", "WeightTransport": "actors.weight_sync.base",
    "WeightUpdate": "actors.weight_sync.base", "load_tensors": "actors.weight_sync.base",
    "WeightPublisher": "actors.weight_sync.publisher",
    "TRANSPORTS": "actors.weight_sync.registry", "transport": "actors.weight_sync.registry",
    "remove_published": "actors.weight_sync.shm", "run_dir": "actors.weight_sync.shm",
    "Placement": "actors.weight_sync.traits", "TransportName": "actors.weight_sync.traits",
    "describe": "actors.weight_sync.traits",
    "transport_traits": "actors.weight_sync.traits",
}
__all__ = list(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'actors.weight_sync' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
