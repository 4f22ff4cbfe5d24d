"""The nccl transport of actors/weight_sync.py (GPU only; written against
`vllm.distributed.weight_transfer` as vLLM 0.26 and 0.32 have it, NOT exercised by the CPU
test-suite): learner rank 0's `NcclWeightSender`, the update-info records and the version
differences weight_sync.py's docstring describes. A module of its own so that the CPU
transports read in one file.
"""
from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Collection, Mapping, Sequence

import torch

# The settings of vLLM's packed broadcast: trainer and workers must agree on them.
NCCL_PACKING_FIELDS = ("packed", "packed_buffer_size_bytes", "packed_num_buffers")


def nccl_update_info(items: list[tuple[str, torch.Tensor]], extra: Mapping | None = None) -> dict:
    """The per-sync update info of vLLM's NCCL engine (`NCCLWeightTransferUpdateInfo`
    fields): what each worker allocates and receives, in broadcast order; plus `extra`
    (the packing settings, where the installed vLLM carries them here: `nccl_packing_split`)."""
    return {"names": [n for n, _ in items],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in items],
            "shapes": [list(t.shape) for _, t in items],
            **(extra or {})}


def nccl_record_fields() -> tuple[frozenset[str], frozenset[str]]:
    """Field names of the installed vLLM's `NCCLWeightTransferInitInfo` and
    `NCCLWeightTransferUpdateInfo`."""
    from actors.engine import transfer_record_fields

    return transfer_record_fields("nccl", "NCCL")


def nccl_packing_split(packing: Mapping, init_fields: Collection[str],
                       update_fields: Collection[str]) -> tuple[dict, dict]:
    """Where the packing settings go, given the field names of vLLM's init and update info
    types: `(extra init info, extra update info)`. vLLM 0.32 reads them from the init info
    (once per worker), vLLM 0.26 from every update info; a vLLM whose types have them in
    neither cannot receive what `NcclWeightSender` sends (RuntimeError)."""
    if set(packing) != set(NCCL_PACKING_FIELDS):
        raise ValueError(f"packing settings must be exactly {NCCL_PACKING_FIELDS}, got {sorted(packing)}")
    if all(f in init_fields for f in NCCL_PACKING_FIELDS):
        return dict(packing), {}
    if all(f in update_fields for f in NCCL_PACKING_FIELDS):
        return {}, dict(packing)
    raise RuntimeError(
        "the installed vLLM's NCCLWeightTransferInitInfo / NCCLWeightTransferUpdateInfo carry "
        f"none of {NCCL_PACKING_FIELDS}: klrl's nccl transport supports the layouts of vLLM "
        "0.26 (update info) and 0.32 (init info); use sync.transport: object_store or shm")


def trainer_init_kwargs(trainer_init: Callable) -> dict:
    """Keyword arguments that make vLLM's `trainer_init(init_info, ...)` open the group as
    rank 0: `rank=0` where it takes a rank (vLLM 0.32), none where the trainer is always
    rank 0 (vLLM 0.26, whose trainer_init has no such parameter)."""
    return {"rank": 0} if "rank" in inspect.signature(trainer_init).parameters else {}


def check_nccl_devices(learner_device: str, worker_devices: Sequence[Sequence[str]]) -> None:
    """Refuse an NCCL weight-transfer group in which two members share a GPU: NCCL itself
    refuses it ("Duplicate GPU detected", an invalid-usage error from ncclCommInitRank).
    learner_device: the CUDA device UUID of learner rank 0; worker_devices[i]: those of
    rollout worker i's engine (one per tensor-parallel rank)."""
    owners: dict[str, list[str]] = {}
    owners.setdefault(learner_device, []).append("learner rank 0")
    for i, devices in enumerate(worker_devices):
        for d in devices:
            owners.setdefault(d, []).append(f"rollout worker {i}")
    shared = {d: who for d, who in owners.items() if len(who) > 1}
    if shared:
        detail = "; ".join(f"{' and '.join(who)} on GPU {d}" for d, who in shared.items())
        raise RuntimeError(
            f"sync.transport=nccl needs a GPU of its own for learner rank 0 and for every rollout "
            f"worker, but {detail} (NCCL refuses two ranks on one GPU). Give them whole GPUs "
            "(learner.num_gpus_per_rank, rollout.num_gpus_per_worker), or use "
            "sync.transport: shm (one node) or object_store, which work on a shared GPU")


class NcclWeightSender:
    """Learner rank 0's end of vLLM's NCCL weight-transfer group. GPU only; not tested on CPU.

    Rendezvous (once, all at the same time, e.g. from the controller):
        sender = NcclWeightSender(master_address, master_port, num_workers)   # learner rank 0
        refs = [w.init_nccl.remote(sender.worker_init_info(i)) for i, w in enumerate(workers)]
        sender.connect()                                                        # learner rank 0
        ray.get(refs)
    Then every sync: `publish(..., transport="nccl", nccl_sender=sender)` on the learner and
    `load_weights(update)` on every worker (all of them: a broadcast needs the whole group).
    Group ranks: the sender is 0; worker i's engine ranks start at 1 + i * ranks_per_worker.

    The trainer end uses `vllm.distributed.weight_transfer.nccl_common.trainer_init` and
    `packed_tensor.packed_nccl_broadcast_producer`, i.e. exactly what vLLM's own
    `NCCLTrainerWeightTransferEngine` does, but split so the learner does not drive the
    workers' RPCs (the controller already sends them `load_weights`).
    """

    def __init__(self, master_address: str, master_port: int, num_workers: int,
                 ranks_per_worker: int = 1, *, packed: bool = True,
                 buffer_size_bytes: int | None = None, num_buffers: int | None = None):
        from vllm.distributed.weight_transfer.packed_tensor import (
            DEFAULT_PACKED_BUFFER_SIZE_BYTES,
            DEFAULT_PACKED_NUM_BUFFERS,
        )

        self.master_address, self.master_port = master_address, int(master_port)
        self.ranks_per_worker = ranks_per_worker
        self.world_size = 1 + num_workers * ranks_per_worker
        self.packed = packed
        self.buffer_size_bytes = buffer_size_bytes or DEFAULT_PACKED_BUFFER_SIZE_BYTES
        self.num_buffers = num_buffers or DEFAULT_PACKED_NUM_BUFFERS
        packing = {"packed": self.packed, "packed_buffer_size_bytes": self.buffer_size_bytes,
                   "packed_num_buffers": self.num_buffers}
        # The init info or every update info carries the packing settings, as the installed
        # vLLM's types say (module docstring, "vLLM versions").
        self._init_extra, self._update_extra = nccl_packing_split(packing, *nccl_record_fields())
        self.group = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def worker_init_info(self, worker_index: int) -> dict:
        """`init_info` for worker `worker_index`'s `init_weight_transfer_engine`."""
        return {"master_address": self.master_address, "master_port": self.master_port,
                "rank_offset": 1 + worker_index * self.ranks_per_worker,
                "world_size": self.world_size, **self._init_extra}

    def update_info(self, items: list[tuple[str, torch.Tensor]]) -> dict:
        """The update info of one sync of `items` (`nccl_update_info` with the packing
        settings where the installed vLLM reads them per update)."""
        return nccl_update_info(items, self._update_extra)

    def connect(self) -> None:
        """Join the group as rank 0; blocks until every worker has joined."""
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        self.group = trainer_init({"master_address": self.master_address,
                                   "master_port": self.master_port,
                                   "world_size": self.world_size},
                                  **trainer_init_kwargs(trainer_init))

    def send_async(self, items: list[tuple[str, torch.Tensor]]) -> dict:
        """Start broadcasting `items` (CUDA tensors) on a background thread; return the
        update info the workers need to receive them."""
        if self.group is None:
            raise RuntimeError("NcclWeightSender.connect() was not called")
        self.wait()
        items = [(n, t.detach().contiguous()) for n, t in items]
        info = self.update_info(items)
        device = items[0][1].device if items else None
        self._error = None
        self._thread = threading.Thread(target=self._broadcast, args=(items, device),
                                        name="klrl-nccl-send", daemon=True)
        self._thread.start()
        return info

    def wait(self, timeout: float | None = None) -> None:
        """Block until the last broadcast has been received by every worker (the learner
        must call it before changing the tensors it published); re-raise its error."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError("NCCL weight broadcast still running")
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def _broadcast(self, items, device) -> None:
        try:
            if device is not None and device.type == "cuda":
                torch.cuda.set_device(device)
            if self.packed:
                from vllm.distributed.weight_transfer.packed_tensor import (
                    packed_nccl_broadcast_producer,
                )

                packed_nccl_broadcast_producer(
                    iterator=iter(items), group=self.group, src=0,
                    post_iter_func=lambda item: item[1],
                    buffer_size_bytes=self.buffer_size_bytes, num_buffers=self.num_buffers)
            else:
                stream = torch.cuda.current_stream()
                for _, t in items:
                    self.group.broadcast(t, src=0, stream=stream)
                stream.synchronize()
        except BaseException as e:  # noqa: BLE001 - re-raised by wait() in the learner
            self._error = e

    def close(self) -> None:
        if self.group is not None:
            self.group.destroy()
            self.group = None
