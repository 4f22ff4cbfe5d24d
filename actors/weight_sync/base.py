"""What every weight transport does: the record one sync sends (`WeightUpdate`), and
`WeightTransport`, the class each transport of this package is (one module each, one
instance in the registry).

Transports come in two families, each with a base class here:
- `SafetensorsTransport` (shm, object_store): learner rank 0 serialises CPU copies of the
  weights to safetensors before `publish` returns; each worker fetches the file or the bytes
  and reloads them through klrl's worker extension (actors/worker_extension.py). A LoRA
  adapter travels this way only.
- `VllmEngineTransport` (nccl, cuda_ipc): vLLM's weight-transfer engines move the tensors
  off learner rank 0's GPU; the record carries the update info each worker hands vLLM's
  `update_weights`, and the engines are built for the transport's vLLM backend.

What each transport is (its traits, `Placement`, the names) lives in traits.py, which the
config imports without torch. Nothing here imports Ray or vLLM at module level.
"""
from __future__ import annotations

import abc
import dataclasses
import os
import stat
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from actors.weight_sync.loads import refuse_unloaded
from actors.weight_sync.traits import (
    TransportName,
    TransportTraits,
    VllmEngineTraits,
    payload_field_of,
)

LM_HEAD = "lm_head.weight"
Items = list[tuple[str, torch.Tensor]]
WaitAll = Callable[[list], list]  # ray.get of refs, raising the first error as soon as it comes


@dataclass(frozen=True)
class WeightUpdate:
    """What the controller sends to every rollout worker for one sync (small, picklable).

    Exactly one payload field is set, the one the transport names (`payload_field`): `path`
    (shm: a safetensors file), `ref` (object_store: a `ray.ObjectRef` of the safetensors
    bytes, owned by the publishing learner actor), `update_info` (the transports through
    vLLM's weight-transfer engines: the update info the worker hands vLLM's `update_weights`;
    nccl: names/dtype_names/shapes, the tensors follow as a broadcast; cuda_ipc: the same and
    one CUDA IPC handle per tensor, into learner rank 0's snapshot).
    """

    version: int                    # policy version (optimizer steps) of these weights
    transport: TransportName
    num_bytes: int                  # size of the tensors sent
    path: str | None = None
    ref: Any = None
    update_info: dict | None = None
    # Where the publishing side's time went, in seconds: "gather" (the learner's full weights
    # on rank 0) and "serialise_write" (into the transport; cuda_ipc: "snapshot", the copy on
    # the GPU, about 0 for a version sent before, whose snapshot is reused); `klrl bench`
    # reports them.
    seconds: Mapping[str, float] = dataclasses.field(default_factory=dict)
    # LoRA: the tensors are a PEFT adapter for the workers' base model, and this is its
    # adapter_config.json (actors/lora_serving.py); None: the full weights.
    adapter: Mapping[str, Any] | None = None

    def __post_init__(self):
        if self.version < 0:
            raise ValueError(f"version must be >= 0, got {self.version}")
        if getattr(self, payload_field_of(self.transport)) is None:
            raise ValueError(f"a {self.transport} WeightUpdate needs its payload field set")


@dataclass(frozen=True)
class Fetched:
    """What a worker's fetch gives its reload: the transport's `source` (a path, bytes, or
    the update info), and the seconds the fetch took by part ({} when there is no fetch)."""

    source: Any
    seconds: Mapping[str, float]


class WeightTransport(TransportTraits, abc.ABC):
    """One weight transport: its config rules, its learner end (set-up, publish), its
    controller's part (connect at start, after a worker restart, cleanup at the end) and its
    worker end (engine options, fetch, reload). The registry's instances hold no settings and
    answer what the transport is; a run's ends use the instance `for_run` builds with the
    transport's own settings (shm: its directory), so that nothing on the way to `publish` or
    `cleanup` carries another transport's setting. Instances hold no run state: the learner's
    senders live in `WeightPublisher`, one per transport, and are passed in.

    What the transport is (its class attributes, its config rules `check`, and
    `why_no_replacement`) it inherits from its traits class (traits.py, their one home, which
    the config reads without torch)."""

    # ------------------------------------------------------------------ config

    def for_run(self, run_id: str, sync: Any) -> WeightTransport:
        """This transport with its own settings for run `run_id`, read from `sync` (a
        SyncConfig: its fields for this transport). The transports without settings are
        their registry instance."""
        return self

    # ------------------------------------------------------------------ learner rank 0

    def open(self, num_workers: int, ranks_per_worker: int = 1, *, host: str | None = None,
             port: int | None = None) -> tuple[Any, list[dict]]:
        """Learner rank 0, before the first publish of a transport whose workers join a
        group: `(sender, each worker's init info)`."""
        raise ValueError(f"transport {self.name} has no weight-transfer group to open")

    def first_sender(self) -> Any:
        """The sender a publish uses when none was opened (None: it needs none)."""
        return None

    @abc.abstractmethod
    def publish(self, items: Items, version: int, *, adapter: Mapping[str, Any] | None,
                sender: Any) -> WeightUpdate:
        """Send `items` (checked by `WeightPublisher.publish`) as policy `version`."""

    # ------------------------------------------------------------------ controller

    def connect(self, learner, workers: Sequence, wait_all: WaitAll) -> None:
        """Once before the first publish: join learner rank 0 (`learner`, a LearnerGroup) and
        the rollout `workers` (actor handles) where the transport needs it."""

    def after_restart(self, learner, worker, wait_all: WaitAll) -> None:
        """A replacement `worker` has started: ready it before its re-sync."""

    def cleanup(self) -> None:
        """At the end of a run (an instance `for_run` built): remove what the transport left
        behind."""

    # ------------------------------------------------------------------ rollout worker

    def engine_options(self) -> dict[str, Any]:
        """Extra arguments of the workers' vLLM engines."""
        return {}

    def init_engine(self, llm, init_info: dict | None, worker_index: int) -> None:
        """Ready a worker's engine for the transport (`RolloutWorker.init_weight_transfer`)."""
        raise ValueError(f"transport {self.name} has no weight-transfer engine to ready")

    @abc.abstractmethod
    def fetch(self, update: WeightUpdate, deadline: float) -> Fetched:
        """In the rollout worker, before `deadline` (a time.monotonic() value): what the
        reload reads. TimeoutError when the weights do not arrive in time (the engine is
        untouched then)."""

    @abc.abstractmethod
    def reload(self, llm, source: Any) -> dict[str, float]:
        """On the worker's engine thread: load the full weights of `source` (a `fetch`'s)
        into `llm`; the seconds spent, by part."""


class SafetensorsTransport(WeightTransport):
    """The transports that serialise CPU copies to safetensors before `publish` returns, so
    the learner may step the optimizer at once; a worker reloads them through klrl's worker
    extension (`klrl_reload_weights`), which also takes a LoRA adapter's files."""

    engines_outlive_the_learner = True

    def publish(self, items, version, *, adapter, sender) -> WeightUpdate:
        t0 = time.perf_counter()
        tensors = cpu_tensors(items)
        metadata = {"klrl_version": str(version)}
        payload, num_bytes = self.store(tensors, metadata, version)
        return WeightUpdate(version, self.name, num_bytes, **payload,
                            seconds={"serialise_write": time.perf_counter() - t0},
                            adapter=adapter)

    @abc.abstractmethod
    def store(self, tensors: dict[str, torch.Tensor], metadata: dict[str, str],
              version: int) -> tuple[dict[str, Any], int]:
        """Serialise `tensors` into the transport: `({payload field: value}, bytes sent)`."""

    def reload(self, llm, source) -> dict[str, float]:
        ranks = llm.collective_rpc("klrl_reload_weights", args=(source,))
        return {"read": max(r["read"] for r in ranks), "reload": max(r["reload"] for r in ranks)}


class VllmEngineTransport(VllmEngineTraits, WeightTransport):
    """The transports through vLLM's weight-transfer engines: the tensors go from learner
    rank 0's GPU to the engines' weights without host copies, and the engines are built for
    `vllm_backend`. They replace base weights only: no LoRA adapter."""

    def engine_options(self) -> dict[str, Any]:
        return {"weight_transfer_config": {"backend": self.vllm_backend}}

    def fetch(self, update, deadline) -> Fetched:
        # A copy: vLLM 0.26's IPC engine pops keys off the dict it is given, and in-process
        # that would be the record's own dict.
        return Fetched(dict(update.update_info), {})

    def reload(self, llm, source) -> dict[str, float]:
        t0 = time.perf_counter()
        llm.collective_rpc("klrl_track_loads", args=(True,))
        try:
            llm.start_weight_update()
            llm.update_weights({"update_info": source})
            llm.finish_weight_update()
        finally:  # stop recording even when the load failed
            missing = llm.collective_rpc("klrl_track_loads", args=(False,))
        refuse_unloaded(sorted({n for rank in missing for n in rank}),
                        f"the {self.vllm_backend} weight load")
        return {"reload": time.perf_counter() - t0}


def transfer_record_fields(backend: str, prefix: str) -> tuple[frozenset[str], frozenset[str]]:
    """Field names of the installed vLLM's `<prefix>WeightTransferInitInfo` and
    `<prefix>WeightTransferUpdateInfo` (dataclasses of
    `vllm.distributed.weight_transfer.<backend>_engine` in every version klrl supports): the
    nccl and cuda_ipc transports read the record layout from them, not from a version string."""
    import importlib

    module = importlib.import_module(f"vllm.distributed.weight_transfer.{backend}_engine")
    return tuple(frozenset(f.name for f in dataclasses.fields(getattr(module, f"{prefix}{kind}")))
                 for kind in ("WeightTransferInitInfo", "WeightTransferUpdateInfo"))


# --------------------------------------------------------------------------- tensors


def cpu_tensors(items: Items) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU tensors safetensors can write. It refuses tensors that share
    storage (tied embeddings), so a tensor whose storage was already seen is cloned. No other
    copy is made: the tensors are serialised before `publish` returns."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def nbytes(items: Items) -> int:
    return sum(t.numel() * t.element_size() for _, t in items)


def load_tensors(source: str | bytes) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file (path) or of safetensors bytes, on CPU."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        from safetensors.torch import load

        return load(bytes(source))
    from safetensors.torch import load_file

    # Open in Python first: an open that blocks (a FIFO, a hung network mount) then waits
    # with the GIL released, so RolloutWorker.load_weights' timeout still fires. safetensors
    # blocks inside Rust holding the GIL, which freezes the whole actor process.
    with open(source, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ValueError(f"weight file {source} is not a regular file")
    return load_file(source, device="cpu")
