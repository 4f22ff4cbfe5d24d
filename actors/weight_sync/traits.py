"""What each weight transport is, without torch: `sync.transport`'s names (`TransportName`),
where a run puts the two ends of a sync (`Placement`), and each transport's traits (its
class attributes, its config rules `check`, `why_no_replacement`), in one table
(`TRANSPORT_TRAITS`). The config reads them from here, so loading it imports no torch.

This is their one home: each transport's class (its own module: shm.py, object_store.py,
nccl.py, cuda_ipc.py) inherits its traits class, and registry.py checks that each transport
of `TRANSPORTS` is an instance of the traits class of its name.

Nothing here imports torch, Ray or vLLM, at module level or in a function.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, get_args

# `sync.transport`'s names, the Literal SyncConfig takes.
TransportName = Literal["shm", "object_store", "nccl", "cuda_ipc"]


@dataclass(frozen=True)
class Placement:
    """Where a run puts the two ends of a sync, as its config asks Ray for them: what each
    transport's `check` decides from (`TrainConfig` builds it from learner and rollout)."""

    learner_ranks: int            # learner.num_ranks
    learner_gpus: float           # learner.num_gpus_per_rank
    num_workers: int              # rollout.num_workers
    worker_gpus: float            # rollout.num_gpus_per_worker
    tensor_parallel_size: int     # rollout.tensor_parallel_size
    lora: bool                    # learner.lora is set: the syncs carry an adapter


class TransportTraits:
    """What one transport is, for the code that must choose without naming it (the config's
    rules, the learner's export, the recovery, `klrl bench`, the docs' option table)."""

    name: ClassVar[str]
    summary: ClassVar[str]             # the sync.transport description of it (docs table)
    payload_field: ClassVar[str]       # the WeightUpdate field its records fill
    needs_gpu: ClassVar[bool] = False  # refused without GPUs
    shares_a_gpu: ClassVar[bool] = True  # works with learner rank 0 and a worker on one GPU
    carries_adapter: ClassVar[bool] = True  # can send a LoRA adapter (learner.lora)
    vllm_backend: ClassVar[str | None] = None  # the engines' weight_transfer_config backend
    # The learner's export: the tensors stay on the learner's GPU (not CPU copies), and the
    # transport reads them after `publish` returned, so they must be copies of their own
    # (the optimizer steps the live ones in place).
    on_learner_device: ClassVar[bool] = False
    reads_after_publish: ClassVar[bool] = False
    writes_shm_dir: ClassVar[bool] = False  # writes files in SyncConfig.shm_dir
    # A learner restart may keep the rollout workers' engines (cluster/train/recovery.py):
    # their link to the learner is a file or an object each load reads, not a group or a
    # handle into the failed learner's process.
    engines_outlive_the_learner: ClassVar[bool] = False

    def check(self, placement: Placement) -> None:
        """Refuse (ValueError, naming the transports that would work) a placement this
        transport cannot serve; the config calls it before anything starts."""

    def why_no_replacement(self) -> str | None:
        """Why a dead or hung worker cannot be replaced under this transport, or None."""
        return None


class VllmEngineTraits(TransportTraits):
    """The transports through vLLM's weight-transfer engines (base.VllmEngineTransport): GPU
    only, no LoRA adapter, the tensors stay on learner rank 0's GPU."""

    needs_gpu = True
    carries_adapter = False
    payload_field = "update_info"
    on_learner_device = True
    # nccl's group holds the failed learner rank 0, and cuda_ipc's engines read its memory:
    # a learner restart starts the engines again, as a fresh run does (whether vLLM's engine
    # could join a second group instead is untested here: it needs a GPU).
    engines_outlive_the_learner = False


class ShmTraits(TransportTraits):
    """shm (shm.py): a safetensors file in a tmpfs."""

    name = "shm"
    summary = "a safetensors file in shm_dir (learner and workers on one node)"
    payload_field = "path"
    writes_shm_dir = True


class ObjectStoreTraits(TransportTraits):
    """object_store (object_store.py): the safetensors bytes in Ray's object store."""

    name = "object_store"
    summary = "the safetensors bytes in Ray's object store (any nodes, CPU or GPU)"
    payload_field = "ref"


class NcclTraits(VllmEngineTraits):
    """nccl (nccl.py): a broadcast through vLLM's NCCL weight-transfer engine, whose group is
    fixed once formed."""

    name = "nccl"
    summary = ("GPU only, not yet run on GPUs (it needs two): a broadcast through vLLM's NCCL "
               "weight-transfer engine; learner rank 0 and every worker need a GPU of their own")
    vllm_backend = "nccl"
    shares_a_gpu = False
    reads_after_publish = True  # the broadcast runs on after publish returns

    def check(self, p: Placement) -> None:
        if p.learner_gpus == 0:
            raise ValueError("sync.transport=nccl needs GPUs (learner.num_gpus_per_rank > 0); "
                             "use shm (one node) or object_store on CPU")
        if shared := nccl_gpu_sharing(p.learner_gpus, p.worker_gpus, p.num_workers):
            raise ValueError(
                f"sync.transport=nccl needs a GPU of its own for learner rank 0 and for every "
                f"rollout worker (NCCL refuses two ranks of one group on the same GPU), but "
                f"{shared}. Request whole GPUs (learner.num_gpus_per_rank and "
                "rollout.num_gpus_per_worker >= 1), or use sync.transport: shm (one node) or "
                "object_store, which work on a shared GPU")
        if p.lora:
            raise ValueError("learner.lora with sync.transport=nccl: vLLM's NCCL weight "
                             "transfer replaces base weights and cannot load an adapter; an "
                             "adapter is small, so use sync.transport: object_store (or shm on "
                             "one node)")
        if p.tensor_parallel_size > 1:
            # `connect` sizes the NCCL weight-transfer group for one engine rank per worker.
            raise ValueError("sync.transport=nccl supports rollout.tensor_parallel_size=1 only; "
                             "use sync.transport: object_store (or shm on one node)")

    def why_no_replacement(self) -> str | None:
        return ("a replaced worker cannot join the NCCL weight-transfer group, which is formed "
                "once, at start-up, for learner rank 0 and the workers then running")


def nccl_gpu_sharing(learner_gpus: float, worker_gpus: float, num_workers: int) -> str | None:
    """Why Ray could place two members of the NCCL weight-transfer group (learner rank 0 and
    each rollout worker) on one GPU, from their GPU requests alone; None if it cannot.

    What the config knows: Ray gives a request of 1 GPU or more whole GPUs of its own, and
    packs requests below 1 onto one GPU while their sum fits in it; how many GPUs the cluster
    has is not in the config (a run that asks for more whole GPUs than exist waits for them
    rather than sharing). A worker without a GPU request cannot hold a rank of the group (and
    Ray 2.60 does not hide the node's GPUs from it, so its engine could still start on the
    learner's). `NcclTransport.connect` compares the devices' UUIDs at start-up."""
    if worker_gpus == 0:
        return "rollout.num_gpus_per_worker is 0, so a worker has no GPU of its own"
    fits = 1.0 + 1e-9
    if learner_gpus < 1 and worker_gpus < 1 and learner_gpus + worker_gpus <= fits:
        return (f"learner.num_gpus_per_rank={learner_gpus:g} and rollout.num_gpus_per_worker="
                f"{worker_gpus:g} let Ray place learner rank 0 and a rollout worker on one GPU")
    if num_workers >= 2 and worker_gpus < 1 and 2 * worker_gpus <= fits:
        return (f"rollout.num_gpus_per_worker={worker_gpus:g} with {num_workers} workers lets "
                "Ray place two rollout workers on one GPU")
    return None


class CudaIpcTraits(VllmEngineTraits):
    """cuda_ipc (cuda_ipc.py): CUDA IPC handles of a GPU snapshot, one GPU for all."""

    name = "cuda_ipc"
    summary = ("GPU only, run on one H100 at commit cc124fa, not since: CUDA IPC handles "
               "through vLLM's IPC weight-transfer engine, device to device; one learner rank "
               "and every worker on ONE GPU (fractional GPU requests that fit in one GPU)")
    vllm_backend = "ipc"

    def check(self, p: Placement) -> None:
        """A CUDA IPC handle opens only on the GPU it comes from, so learner rank 0 and every
        rollout worker must be on ONE GPU, which the config can ask of Ray only as a single
        learner rank and fractional GPU requests that fit in one GPU together; whether Ray did
        place them there is checked at start-up (`connect`). That excludes tensor parallelism
        too (tp > 1 needs whole GPUs per worker: RolloutConfig). vLLM's IPC engine replaces
        base weights, so no LoRA adapter."""
        others = "sync.transport: shm (one node) or object_store"
        if p.learner_gpus == 0:
            raise ValueError("sync.transport=cuda_ipc hands the rollout workers GPU memory of "
                             "learner rank 0, so the learner must run on a GPU "
                             f"(learner.num_gpus_per_rank > 0); on CPU use {others}")
        if p.learner_ranks != 1:
            raise ValueError(f"sync.transport=cuda_ipc needs one learner rank (learner.num_ranks"
                             f"={p.learner_ranks}): every rollout worker must share rank 0's "
                             "GPU, and Ray cannot be told to place them beside rank 0 rather "
                             f"than another rank; use sync.transport: nccl (a GPU each), or "
                             f"{others}")
        if why := cuda_ipc_gpu_sharing(p.learner_gpus, p.worker_gpus, p.num_workers):
            raise ValueError(f"sync.transport=cuda_ipc needs learner rank 0 and every rollout "
                             f"worker on ONE GPU, but {why}. Request fractions of one GPU (e.g. "
                             "learner.num_gpus_per_rank 0.5 and rollout.num_gpus_per_worker 0.5 "
                             "for one worker), or use sync.transport: nccl (a GPU each), shm "
                             "(one node) or object_store")
        if p.lora:
            raise ValueError("learner.lora with sync.transport=cuda_ipc: vLLM's IPC weight "
                             "transfer replaces base weights and cannot load an adapter; an "
                             "adapter is small, so use sync.transport: object_store (or shm on "
                             "one node)")


def cuda_ipc_gpu_sharing(learner_gpus: float, worker_gpus: float,
                         num_workers: int) -> str | None:
    """Why these Ray GPU requests cannot put learner rank 0 and every rollout worker on one
    GPU (cuda_ipc's need); None if they can. Ray packs requests below 1 GPU onto one GPU while
    their sum fits in it, and gives a request of 1 or more whole GPUs of its own; that it did
    pack them onto the same GPU (not another GPU or node with room) is checked at start-up."""
    if worker_gpus == 0:
        return "rollout.num_gpus_per_worker is 0, so a worker's engine has no share of the GPU"
    if learner_gpus >= 1:
        return (f"learner.num_gpus_per_rank={learner_gpus:g} holds whole GPUs, which Ray shares "
                "with no worker")
    if worker_gpus >= 1:
        return (f"rollout.num_gpus_per_worker={worker_gpus:g} gives each worker whole GPUs of "
                "its own")
    total = learner_gpus + num_workers * worker_gpus
    if total > 1.0 + 1e-9:
        return (f"learner.num_gpus_per_rank + rollout.num_workers x rollout.num_gpus_per_worker "
                f"= {learner_gpus:g} + {num_workers} x {worker_gpus:g} = {total:g} does not fit "
                "in one GPU")
    return None


TRANSPORT_TRAITS: dict[str, TransportTraits] = {
    t.name: t for t in (ShmTraits(), ObjectStoreTraits(), NcclTraits(), CudaIpcTraits())}
if tuple(TRANSPORT_TRAITS) != get_args(TransportName):
    raise ImportError(f"actors.weight_sync.traits.TRANSPORT_TRAITS {tuple(TRANSPORT_TRAITS)} "
                      f"must name exactly the TransportName Literal's transports "
                      f"{get_args(TransportName)}, in its order")


def transport_traits(name: str) -> TransportTraits:
    """What transport `name` is; ValueError listing the transports otherwise."""
    found = TRANSPORT_TRAITS.get(name)
    if found is None:
        raise ValueError(f"unknown transport {name!r}; one of {tuple(TRANSPORT_TRAITS)}")
    return found


def payload_field_of(name: str) -> str:
    """The WeightUpdate field the records of transport `name` fill; ValueError listing the
    transports for an unknown name."""
    return transport_traits(name).payload_field


def describe() -> str:
    """`sync.transport`'s description: each transport's summary, in the table's order."""
    return " ".join(f"{name}: {t.summary}." for name, t in TRANSPORT_TRAITS.items())
