"""The transport-neutral ends of a sync: `publish` (learner rank 0: the checks every update
passes, then the transport's own publish), `WeightPublisher` (what the learner is handed, with
each transport's sender) and `fetch` (a worker's, through the update's transport)."""
from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from actors.weight_sync.base import LM_HEAD, WeightTransport, WeightUpdate
from actors.weight_sync.registry import TRANSPORTS, TransportName
from actors.weight_sync.registry import transport as transport_named


def publish(
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    version: int,
    transport: TransportName,
    *,
    run_id: str,
    shm_dir: str | os.PathLike = "/dev/shm",
    adapter: Mapping[str, Any] | None = None,
    sender: Any = None,
) -> WeightUpdate:
    """Publish the learner's full HF-named weights as policy `version`; return the record
    the workers load (`RolloutWorker.load_weights`).

    Called once per sync by learner rank 0. `named_tensors` must hold every parameter of the
    checkpoint, `lm_head.weight` included even when embeddings are tied (ValueError
    otherwise; `model.state_dict()` of a HF model has it). For shm and object_store the
    tensors are serialised before this returns, so the caller may step the optimizer right
    away; for nccl it must `sender.wait()` first; for cuda_ipc the workers read `sender`'s
    snapshot of the tensors, so it may step right away too.

    run_id names the shm directory (one per run, so concurrent runs do not collide);
    shm_dir is its parent (SyncConfig.shm_dir). sender: the transport's sender, where it needs
    one (nccl: an NcclWeightSender, opened; cuda_ipc: an IpcWeightSender, tensors on learner
    rank 0's GPU). adapter: a LoRA adapter's config when the tensors are that adapter (the
    transports that carry one; no lm_head then: the workers keep their base).
    """
    t = transport_named(transport)
    items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
    names = [n for n, _ in items]
    if adapter is not None and not t.carries_adapter:
        carriers = " or ".join(n for n, c in TRANSPORTS.items() if c.carries_adapter)
        raise ValueError(f"a LoRA adapter travels by {carriers}: vLLM's {t.vllm_backend} "
                         f"weight transfer ({transport}) replaces base weights, not adapters")
    if LM_HEAD not in names and adapter is None:
        raise ValueError(
            f"weight update for version {version} has no {LM_HEAD!r}. Send it even when "
            "embeddings are tied (e.g. lm_head.weight = model.embed_tokens.weight): vLLM keeps "
            "the old lm_head otherwise and its log-probs silently diverge from the learner's.")
    if len(set(names)) != len(names):
        raise ValueError("duplicate tensor names in a weight update")
    return t.publish(items, version, run_id=run_id, shm_dir=shm_dir, adapter=adapter,
                     sender=sender)


class WeightPublisher:
    """The learner's end of the weight sync: cluster/ builds one and passes it to
    `LearnerGroup`, which hands a (pickled) copy to every rank; only rank 0's publishes. It
    owns each transport's sender in that rank (nccl: the group, once opened; cuda_ipc: the
    snapshots, from the first publish on). Injected rather than imported because learner/ may
    import only kl/ (docs/layout.md): `learner.export.WeightPublisher` is the protocol the
    learner calls it through.
    """

    def __init__(self):
        self.senders: dict[str, Any] = {}

    def needs(self, transport: TransportName) -> WeightTransport:
        """What the learner's export reads from the transport (`on_learner_device`,
        `reads_after_publish`): the transport itself."""
        return transport_named(transport)

    def publish(self, weights: Mapping[str, torch.Tensor], version: int,
                transport: TransportName, *, run_id: str,
                shm_dir: str | os.PathLike | None = None,
                adapter: Mapping[str, Any] | None = None) -> WeightUpdate:
        """`publish` these weights with the transport's sender; shm_dir None means its
        default. nccl needs `open` and `connect` first (`NcclTransport.connect` drives
        both)."""
        if transport not in self.senders:
            self.senders[transport] = transport_named(transport).first_sender()
        kw = {"shm_dir": shm_dir} if shm_dir is not None else {}
        return publish(weights, version, transport, run_id=run_id, adapter=adapter,
                       sender=self.senders[transport], **kw)

    def open(self, transport: TransportName, num_workers: int, ranks_per_worker: int = 1, *,
             host: str | None = None, port: int | None = None) -> list[dict]:
        """GPU only: open the transport's group on this rank (nccl: the trainer end of
        vLLM's NCCL weight-transfer group at host:port, by default this node's address and a
        free port); returns each rollout worker's init info."""
        sender, infos = transport_named(transport).open(num_workers, ranks_per_worker,
                                                        host=host, port=port)
        self.senders[transport] = sender
        return infos

    def connect(self, transport: TransportName) -> None:
        """Join the group `open` opened; blocks until every worker has joined."""
        self.senders[transport].connect()


def fetch(update: WeightUpdate, deadline: float) -> Any:
    """In the rollout worker: make the update's weights reachable for vLLM's worker process
    before `deadline` (a time.monotonic() value); return what its reload reads (shm: the
    path; object_store: the safetensors bytes). TimeoutError when they do not arrive."""
    return transport_named(update.transport).fetch(update, deadline).source
