"""The cuda_ipc transport (GPU only, learner rank 0 and every worker on ONE GPU; written against
`vllm.distributed.weight_transfer.ipc_engine` as vLLM 0.26 and 0.32 have it; it ran on one H100
with vLLM 0.26 at commit cc124fa, docs/gpu.md. The CPU test-suite checks its records and
decisions, tests/test_ipc_transfer.py).

Learner rank 0 and the rollout workers share one GPU, and a sync hands the workers CUDA IPC
handles of the weights instead of copying them through host memory. Learner rank 0's
`IpcWeightSender.send` copies the weights into a snapshot on the GPU, exports one IPC handle
per tensor (torch's `reduce_tensor`, keyed by the GPU's UUID: vLLM's IPC engine looks up the
handle of its own device) and returns the update info; each worker's `load_weights` runs vLLM's
`start_weight_update` / `update_weights` / `finish_weight_update`, whose IPC engine opens the
handles and copies from the snapshot into the engine's weights (engines are built with
`weight_transfer_config={"backend": "ipc"}`, `CudaIpcTransport.engine_options`).

The invariant: no reader sees half an update. The handles point at the sender's snapshot,
never at the live parameters, which the optimizer steps in place (a worker reading them during
a step would load a mix of two versions). A snapshot is written once, before its handles exist,
and never again; it is kept until every load of it has finished: the sender holds the snapshots
of the KEEP_VERSIONS (2) newest versions sent and releases older ones when it sends a newer
one. That suffices because the controller finishes every load of the versions before the last
published one before it publishes the next (cluster/train/weight_sync_state.py), the rule the
shm transport's two newest files rely on as well. A version sent again (a replaced
worker re-synced) gets the same snapshot and handles: the learner's version moves with every
applied optimizer step, so equal versions are equal weights. The cost: up to two copies of the
weights in GPU memory beside the live ones. Memory released while a worker still maps it stays
allocated until the worker lets go (torch's IPC reference count; `torch.cuda.ipc_collect`).

vLLM versions. klrl sends unpacked updates only (one handle per tensor): vLLM's packed mode
reuses one buffer across several `update_weights` calls of one sync, which one record cannot
carry. vLLM 0.26 and 0.32 take the same handles (`reduce_tensor(t)[1]`, the arguments of
`rebuild_cuda_tensor`) in the same fields (names, dtype_names, shapes, ipc_handles); they
differ in where the `packed` flag sits: on every update info in 0.26, on the init info (sent
once per worker, `RolloutWorker.init_weight_transfer`) in 0.32. `ipc_packing_split` reads the
installed dataclasses' fields, not a version string, and puts `packed: False` where they have
it.

A CUDA IPC handle opens only on the GPU it comes from: `CudaIpcTransport.check` refuses Ray GPU
requests that cannot put learner rank 0 and every worker on one GPU (`traits.cuda_ipc_gpu_sharing`),
and `check_cuda_ipc_devices` compares the devices' UUIDs at start-up and for every replaced
worker (`CudaIpcTransport.connect`, `after_restart`).
"""
from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Collection, Mapping, Sequence

import torch

from actors.weight_sync.base import VllmEngineTransport, WeightUpdate, nbytes
from actors.weight_sync.traits import CudaIpcTraits

KEEP_VERSIONS = 2  # snapshots held: the version being loaded and the one before (docstring)
# An update-info field of the layouts whose handles are rebuild_cuda_tensor's arguments (vLLM
# 0.26 and later); earlier layouts had neither it nor that handle form.
_HANDLE_LAYOUT_FIELD = "tensor_sizes"
_ALTERNATIVES = ("use sync.transport: shm (one node), object_store, or nccl (GPUs of their own)")

Export = Callable[[torch.Tensor], "dict[str, tuple]"]  # tensor -> {gpu uuid: handle}


def ipc_record_fields() -> tuple[frozenset[str], frozenset[str]]:
    """Field names of the installed vLLM's `IPCWeightTransferInitInfo` and
    `IPCWeightTransferUpdateInfo`."""
    from actors.weight_sync.base import transfer_record_fields

    return transfer_record_fields("ipc", "IPC")


def ipc_packing_split(init_fields: Collection[str],
                      update_fields: Collection[str]) -> tuple[dict, dict]:
    """`(extra init info, extra update info)`: `packed: False` on whichever of vLLM's two
    types carries the flag (0.32: init info; 0.26: update info; neither: vLLM's default,
    unpacked). A vLLM whose update info lacks `tensor_sizes` predates the handle form
    `cuda_ipc_handle` makes (it wanted `reduce_tensor`'s whole output): RuntimeError."""
    if _HANDLE_LAYOUT_FIELD not in update_fields:
        raise RuntimeError(
            "the installed vLLM's IPCWeightTransferUpdateInfo has no "
            f"{_HANDLE_LAYOUT_FIELD!r}: its IPC handles have another form than klrl's cuda_ipc "
            f"transport sends (that of vLLM 0.26 and 0.32); {_ALTERNATIVES}")
    unpacked = {"packed": False}
    return (dict(unpacked) if "packed" in init_fields else {},
            dict(unpacked) if "packed" in update_fields else {})


def ipc_update_info(items: Sequence[tuple[str, torch.Tensor]], handles: Sequence[Mapping],
                    extra: Mapping | None = None) -> dict:
    """The update info of vLLM's IPC engine (`IPCWeightTransferUpdateInfo` fields, unpacked):
    each tensor's name, dtype name and shape, `handles[i]` ({gpu uuid: handle}) for
    `items[i]`, and `extra` (`packed` where the installed vLLM reads it per update)."""
    if len(handles) != len(items):
        raise ValueError(f"{len(items)} tensors but {len(handles)} IPC handles")
    return {"names": [n for n, _ in items],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in items],
            "shapes": [list(t.shape) for _, t in items],
            "ipc_handles": [dict(h) for h in handles],
            **(extra or {})}


def cuda_ipc_handle(t: torch.Tensor) -> dict[str, tuple]:
    """{UUID of t's GPU: the arguments of `rebuild_cuda_tensor` for t} (torch's
    `reduce_tensor`), what vLLM's IPC engine opens. GPU only. The handle does not keep t's
    memory alive: the caller must hold t until every reader has loaded it."""
    from torch.multiprocessing.reductions import reduce_tensor

    if not t.is_cuda:
        raise ValueError(f"a CUDA IPC handle needs a CUDA tensor, got one on {t.device}")
    return {str(torch.cuda.get_device_properties(t.device).uuid): reduce_tensor(t)[1]}


class CudaIpcTransport(CudaIpcTraits, VllmEngineTransport):
    """The cuda_ipc transport: its config rules (one GPU for learner rank 0 and every worker),
    the start-up and after-restart device check and engine set-up, and each version's
    snapshot handed out by the learner's `IpcWeightSender`."""

    def first_sender(self) -> IpcWeightSender:
        return IpcWeightSender()  # holds the snapshots the workers read

    def publish(self, items, version, *, adapter, sender) -> WeightUpdate:
        if sender is None:
            raise ValueError("transport 'cuda_ipc' needs sender (an IpcWeightSender)")
        t0 = time.perf_counter()
        info = sender.send(items, version)
        return WeightUpdate(version, self.name, nbytes(items), update_info=info,
                            seconds={"snapshot": time.perf_counter() - t0})

    def connect(self, learner, workers, wait_all) -> None:
        """Refuse a worker whose engine is not on learner rank 0's GPU, where the IPC handles
        could not be opened (`check_cuda_ipc_devices`), then ready each worker's engine."""
        check_cuda_ipc_devices(learner.cuda_device_uuid(),
                               wait_all([w.cuda_device_uuids.remote() for w in workers]))
        wait_all([w.init_weight_transfer.remote(None) for w in workers])

    def after_restart(self, learner, worker, wait_all) -> None:
        self.connect(learner, [worker], wait_all)  # a replacement may land on another GPU

    def init_engine(self, llm, init_info, worker_index) -> None:
        """The init info of the installed vLLM (unpacked transfers, module docstring);
        refuses an engine core outside the worker's process, which could not take the IPC
        handles as they are."""
        if problem := engine_process_problem(os.environ):
            raise RuntimeError(f"rollout worker {worker_index}: {problem}")
        llm.init_weight_transfer_engine({"init_info": worker_init_info()})


def check_cuda_ipc_devices(learner_device: str, worker_devices: Sequence[Sequence[str]]) -> None:
    """Refuse a cuda_ipc run in which a rollout worker's engine is not on learner rank 0's GPU
    (a CUDA IPC handle opens on the GPU it came from only; vLLM would fail at the first sync,
    "IPC handle not found"). learner_device: the CUDA device UUID of learner rank 0;
    worker_devices[i]: those of rollout worker i's engine (one per tensor-parallel rank)."""
    elsewhere = [f"rollout worker {i} on GPU {d}" for i, devices in enumerate(worker_devices)
                 for d in devices if d != learner_device]
    if elsewhere:
        raise RuntimeError(
            f"sync.transport=cuda_ipc needs every rollout worker on learner rank 0's GPU "
            f"({learner_device}), but {'; '.join(elsewhere)}: Ray placed them apart (several "
            "GPUs or nodes). Run on a node with one GPU (or pin the actors with "
            f"ray.learner_resources / ray.worker_resources), or {_ALTERNATIVES}")


def engine_process_problem(environ: Mapping[str, str]) -> str | None:
    """Why a rollout worker's engine cannot take the IPC handles as Python objects, or None.
    They reach vLLM's worker as `collective_rpc` arguments: passed as they are when the engine
    core runs in the actor's process (klrl's default, VLLM_ENABLE_V1_MULTIPROCESSING=0), but
    serialised with msgpack otherwise, which refuses them unless pickle is allowed."""
    in_process = environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") == "0"
    if in_process or environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION") == "1":
        return None
    return ("sync.transport=cuda_ipc hands the engine CUDA IPC handles (Python objects), but "
            "VLLM_ENABLE_V1_MULTIPROCESSING=1 puts its engine core in another process, whose "
            "msgpack refuses them: unset it (klrl runs the engine in the worker's process), or "
            "set VLLM_ALLOW_INSECURE_SERIALIZATION=1")


def worker_init_info() -> dict:
    """The init info of a worker's `init_weight_transfer_engine` for the installed vLLM."""
    return ipc_packing_split(*ipc_record_fields())[0]


@dataclasses.dataclass(frozen=True)
class _Snapshot:
    """One version's copies on the GPU and the update info whose handles point into them."""

    names: tuple[str, ...]
    info: dict                       # the update info whose handles point into `tensors`
    tensors: tuple[torch.Tensor, ...]  # held: the handles do not keep them alive


class IpcWeightSender:
    """Learner rank 0's end of the cuda_ipc transport (GPU only; see the module docstring for
    the invariant it keeps). `send(items, version)` returns the update info of a snapshot of
    `items`; the snapshots of the `keep_versions` newest versions stay alive.

    `export` makes a tensor's {gpu uuid: handle} (default `cuda_ipc_handle`, which needs CUDA
    tensors); tests pass their own to run the snapshot rules on CPU tensors."""

    def __init__(self, keep_versions: int = KEEP_VERSIONS, *, export: Export | None = None):
        if keep_versions < 2:
            raise ValueError("keep_versions must be >= 2: the version being loaded while the "
                             "next is sent stays alive")
        self.keep_versions = keep_versions
        self._cuda = export is None
        self._export: Export = export or cuda_ipc_handle
        self._extra: dict | None = None  # `packed` for the update info, read from vLLM once
        self._held: dict[int, _Snapshot] = {}

    @property
    def held_versions(self) -> list[int]:
        return sorted(self._held)

    def send(self, items: Sequence[tuple[str, torch.Tensor]], version: int) -> dict:
        """The update info of `items` (HF names, tensors on one GPU) as policy `version`."""
        items = list(items)
        names = tuple(n for n, _ in items)
        if version in self._held:  # equal versions are equal weights (module docstring)
            held = self._held[version]
            if held.names != names:
                raise ValueError(f"version {version} was sent with other tensor names")
            return dict(held.info)
        if self._held and version < max(self._held):
            raise ValueError(f"version {version} is older than version {max(self._held)}, "
                             "already sent")
        self._check_devices(items)
        if self._extra is None:
            self._extra = ipc_packing_split(*ipc_record_fields())[1]
        copies = _snapshot(items)
        if self._cuda:  # the copies are complete before any reader can open their handles
            torch.cuda.current_stream(copies[0][1].device).synchronize()
        handle_of: dict[int, dict] = {}  # tied names share one copy and one handle
        for _, t in copies:
            if id(t) not in handle_of:
                handle_of[id(t)] = self._export(t)
        handles = [handle_of[id(t)] for _, t in copies]
        info = ipc_update_info(copies, handles, self._extra)
        self._held[version] = _Snapshot(names, info, tuple(t for _, t in copies))
        for old in sorted(self._held)[:-self.keep_versions]:
            del self._held[old]  # every load of it has finished (module docstring)
        if self._cuda:
            torch.cuda.ipc_collect()
        return dict(info)

    def _check_devices(self, items) -> None:
        if not items:
            raise ValueError("a weight update needs at least one tensor")
        for name, t in items:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
        devices = {t.device for _, t in items}
        if len(devices) > 1:
            raise ValueError(f"the tensors of a cuda_ipc update are on {len(devices)} devices "
                             f"({sorted(map(str, devices))}); they must all be on learner rank "
                             "0's GPU")
        device = devices.pop()
        if self._cuda and device.type != "cuda":
            raise ValueError(f"sync.transport=cuda_ipc sends CUDA tensors, got tensors on "
                             f"{device} (a learner on CPU); {_ALTERNATIVES}")

    def close(self) -> None:
        """Release every snapshot (no worker may load from them any more)."""
        self._held.clear()
        if self._cuda:
            torch.cuda.ipc_collect()


def _snapshot(items: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Contiguous copies of `items` on their device that nothing else writes; views of the
    same memory (tied embeddings: lm_head.weight is embed_tokens.weight) share one copy."""
    copies: dict[tuple, torch.Tensor] = {}
    out = []
    for name, t in items:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
               tuple(t.stride()), t.dtype)
        if key not in copies:
            copies[key] = t.detach().clone(memory_format=torch.contiguous_format)
        out.append((name, copies[key]))
    return out
