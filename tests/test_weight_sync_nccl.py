"""The nccl transport as far as a CPU can take it: where the packing settings go for each of
the two field layouts of vLLM's NCCL weight-transfer types (0.26: on the update info; 0.32: on
the init info), the refusal of a group with two members on one GPU (at start-up, from the
devices' UUIDs; the config-time check is in tests/test_configs.py), and, with the installed
vLLM's own rendezvous and communicator (which libnccl, absent here, leaves disabled): the
rendezvous port held from its choice to the store, both ends' refusal of a disabled
communicator, and the broadcast waiting for the export's copies (a stand-in group and event
record the calls' order). tests/test_weight_sync.py checks the records against the installed
vLLM's types and, on two GPUs, the broadcast itself."""
import socket
import threading
from types import SimpleNamespace

import pytest
import torch

from actors.weight_sync import nccl
from actors.weight_sync.nccl import (
    NCCL_PACKING_FIELDS,
    NcclTransport,
    NcclWeightSender,
    check_nccl_devices,
    nccl_packing_split,
    nccl_update_info,
)
from actors.worker_extension import KlrlWorkerExtension

PACKING = {"packed": True, "packed_buffer_size_bytes": 1 << 20, "packed_num_buffers": 2}
RECORD = ("names", "dtype_names", "shapes")
RENDEZVOUS = ("master_address", "master_port", "rank_offset", "world_size")
# Field names of NCCLWeightTransferInitInfo / NCCLWeightTransferUpdateInfo in each version.
VLLM_026 = (RENDEZVOUS, RECORD + NCCL_PACKING_FIELDS)
VLLM_032 = (RENDEZVOUS + ("nccl_unique_id_b64",) + NCCL_PACKING_FIELDS, RECORD)


def test_packing_settings_go_on_the_update_info_for_vllm_026():
    init_extra, update_extra = nccl_packing_split(PACKING, *VLLM_026)
    assert init_extra == {} and update_extra == PACKING
    items = [("a.weight", torch.zeros(2, 3)),
             ("lm_head.weight", torch.ones(4, dtype=torch.bfloat16))]
    info = nccl_update_info(items, update_extra)
    assert set(info) == set(VLLM_026[1])  # exactly the 0.26 dataclass's fields
    assert info["dtype_names"] == ["float32", "bfloat16"] and info["shapes"] == [[2, 3], [4]]


def test_packing_settings_go_on_the_init_info_for_vllm_032():
    init_extra, update_extra = nccl_packing_split(PACKING, *VLLM_032)
    assert init_extra == PACKING and update_extra == {}
    assert set(nccl_update_info([("w", torch.zeros(1))], update_extra)) == set(RECORD)


def test_a_vllm_with_no_packing_fields_is_refused_naming_the_alternatives():
    with pytest.raises(RuntimeError, match="object_store"):
        nccl_packing_split(PACKING, RENDEZVOUS, RECORD)
    with pytest.raises(ValueError, match="exactly"):
        nccl_packing_split({"packed": True}, *VLLM_032)


def test_distinct_gpus_pass():
    check_nccl_devices("GPU-a", [["GPU-b"], ["GPU-c", "GPU-d"]])


@pytest.mark.parametrize("learner, workers, who", [
    ("GPU-a", [["GPU-b"], ["GPU-a"]], "learner rank 0 and rollout worker 1"),
    ("GPU-a", [["GPU-b"], ["GPU-b"]], "rollout worker 0 and rollout worker 1"),
])
def test_a_shared_gpu_is_refused_naming_the_alternatives(learner, workers, who):
    with pytest.raises(RuntimeError, match=who) as e:
        check_nccl_devices(learner, workers)
    assert "sync.transport: shm" in str(e.value) and "object_store" in str(e.value)


# ------------------------------------------------------------------ rendezvous and refusals

def _port_is_taken(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def _worker_joins(port: int, world_size: int, joined: dict) -> threading.Thread:
    """A worker's engine rank 1 joining the group as vLLM's worker_init_process_group does."""
    def join():
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        store = StatelessProcessGroup.create("127.0.0.1", port, 1, world_size)
        joined["group"] = PyNcclCommunicator(store, device=0)

    thread = threading.Thread(target=join, daemon=True)
    thread.start()
    return thread


def test_the_port_is_held_until_vllms_store_listens_and_a_disabled_group_is_refused():
    """The sender binds its rendezvous port when it is made and holds it (no other process
    can take it before the group meets); connect hands that socket to vLLM's store, which a
    worker then reaches. Here libnccl does not load, so vLLM disables both communicators
    without a word: learner rank 0 refuses it, and so does the worker's check."""
    pytest.importorskip("vllm")
    if torch.cuda.is_available():
        pytest.skip("libnccl loads on a CUDA machine; test_nccl_sync_gpu runs the group there")
    sender = NcclWeightSender("127.0.0.1", None, num_workers=1)
    assert _port_is_taken(sender.master_port)
    joined: dict = {}
    worker = _worker_joins(sender.master_port, sender.world_size, joined)
    with pytest.raises(RuntimeError, match="learner rank 0 is disabled.*shm.*object_store"):
        sender.connect()
    worker.join(timeout=60)
    assert joined["group"].disabled and sender.group.disabled  # what the refusals read
    worker_rank = SimpleNamespace(weight_transfer_engine=SimpleNamespace(
        model_update_group=joined["group"]))
    assert KlrlWorkerExtension.klrl_nccl_group_disabled(worker_rank)
    sender.close()


class _Engine:
    """vLLM's LLM as `NcclTransport.init_engine` uses it: records the calls, and answers the
    collective RPC with klrl's worker extension on engine ranks holding `groups`."""

    def __init__(self, *groups):
        self.calls: list[str] = []
        self.ranks = [SimpleNamespace(weight_transfer_engine=SimpleNamespace(
            model_update_group=g)) for g in groups]

    def init_weight_transfer_engine(self, request):
        self.calls.append(f"join rank_offset={request['init_info']['rank_offset']}")

    def collective_rpc(self, method):
        self.calls.append(method)
        return [getattr(KlrlWorkerExtension, method)(rank) for rank in self.ranks]


def test_a_worker_joins_then_refuses_an_engine_rank_whose_group_is_disabled():
    info = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 3, "world_size": 5}
    live, off = SimpleNamespace(disabled=False), SimpleNamespace(disabled=True)
    engine = _Engine(live, live)
    NcclTransport().init_engine(engine, info, worker_index=2)
    assert engine.calls == ["join rank_offset=3", "klrl_nccl_group_disabled"]
    for ranks, who in [((live, off), "rollout worker 2's engine rank 1"),
                       ((None,), "rollout worker 2's engine rank 0")]:  # never joined
        with pytest.raises(RuntimeError, match=f"{who} is disabled"):
            NcclTransport().init_engine(_Engine(*ranks), info, worker_index=2)


def test_the_broadcast_starts_only_once_the_exports_copies_are_made_and_waits_for_its_end(
        monkeypatch):
    """send_async marks the learner stream's queued copies (an event, recorded before it
    returns, on the calling thread) and the broadcast thread waits for that mark before its
    first broadcast (vLLM's producer broadcasts from streams of its own, which nothing else
    orders after the copies)."""
    pytest.importorskip("vllm")
    assert nccl.copies_made(torch.device("cpu")) is None  # CPU copies are done on return
    calls: list[tuple[str, str]] = []

    class Copied:  # the CUDA event, as _broadcast uses it
        def synchronize(self):
            calls.append(("wait for the copies", threading.current_thread().name))

    def copies_made(device):
        calls.append(("mark the copies", threading.current_thread().name))
        return Copied()

    class Group:  # vLLM's PyNcclCommunicator, as the unpacked broadcast uses it
        def broadcast(self, tensor, src, stream=None):
            calls.append((f"broadcast {tensor.numel()}", threading.current_thread().name))

    def broadcasts_done(device):  # the device-wide synchronize, as _broadcast ends with it
        calls.append(("broadcasts done", threading.current_thread().name))

    monkeypatch.setattr(nccl, "copies_made", copies_made)
    monkeypatch.setattr(nccl, "broadcasts_done", broadcasts_done)
    sender = NcclWeightSender("127.0.0.1", 29555, num_workers=1, packed=False)
    sender.group = Group()
    items = [("a.weight", torch.zeros(2, 3)), ("lm_head.weight", torch.ones(4))]
    info = sender.send_async(items)
    assert calls[0] == ("mark the copies", threading.current_thread().name)
    sender.wait(timeout=30)
    # wait() returns only once the broadcasts are done on the device, not when the last one
    # was queued (vLLM's packed producer leaves its last buffers queued on its own streams)
    assert [c for c, _ in calls] == ["mark the copies", "wait for the copies", "broadcast 6",
                                     "broadcast 4", "broadcasts done"]
    assert {t for _, t in calls[1:]} == {"klrl-nccl-send"}
    assert info["names"] == ["a.weight", "lm_head.weight"]
