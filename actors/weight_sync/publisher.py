"""The learner's end of a sync: `WeightPublisher`, what cluster/ hands learner rank 0, with each
transport built with its own settings for the run (`WeightTransport.for_run`) and each
transport's sender; its `publish` makes the checks every update passes, then the transport's
own publish."""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from actors.weight_sync.base import LM_HEAD, TransportName, WeightTransport, WeightUpdate
from actors.weight_sync.registry import TRANSPORTS
from actors.weight_sync.registry import transport as transport_named


class WeightPublisher:
    """The learner's end of the weight sync: cluster/ builds one and passes it to
    `LearnerGroup`, which hands a (pickled) copy to every rank; only rank 0's publishes. It
    owns each transport of the run, built with its settings (`for_run`, from `sync`, the run's
    SyncConfig), and that transport's sender in that rank (nccl: the group, once opened;
    cuda_ipc: the snapshots, from the first publish on). Injected rather than imported because
    learner/ may import only kl/ (docs/layout.md): `learner.export.WeightPublisher` is the
    protocol the learner calls it through.

    run_id names what the run's transports keep apart from other runs' (shm: its directory);
    `sync` is the run's SyncConfig (actors/config.py, which imports this package: not named
    here), whose fields for a transport its `for_run` reads.
    """

    def __init__(self, run_id: str, sync: Any):
        self.run_id, self.sync = run_id, sync
        self.transports: dict[str, WeightTransport] = {}
        self.senders: dict[str, Any] = {}

    def needs(self, transport: TransportName) -> WeightTransport:
        """What the learner's export reads from the transport (`on_learner_device`,
        `reads_after_publish`): the transport itself."""
        return transport_named(transport)

    def publish(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                version: int, transport: TransportName, *,
                adapter: Mapping[str, Any] | None = None) -> WeightUpdate:
        """Publish the learner's full HF-named weights as policy `version`; return the record
        the workers load (`RolloutWorker.load_weights`).

        Called once per sync by learner rank 0. `weights` must hold every parameter of the
        checkpoint, `lm_head.weight` included even when embeddings are tied (ValueError
        otherwise; `model.state_dict()` of a HF model has it). For shm and object_store the
        tensors are serialised before this returns, so the caller may step the optimizer right
        away; for nccl it must `sender.wait()` first; for cuda_ipc the workers read the
        sender's snapshot of the tensors, so it may step right away too. nccl needs `open` and
        `connect` first (`NcclTransport.connect` drives both). adapter: a LoRA adapter's config
        when the tensors are that adapter (the transports that carry one; no lm_head then: the
        workers keep their base)."""
        t = self._transport(transport)
        items = list(weights.items() if isinstance(weights, Mapping) else weights)
        names = [n for n, _ in items]
        if adapter is not None and not t.carries_adapter:
            carriers = " or ".join(n for n, c in TRANSPORTS.items() if c.carries_adapter)
            raise ValueError(f"a LoRA adapter travels by {carriers}: vLLM's {t.vllm_backend} "
                             f"weight transfer ({transport}) replaces base weights, not adapters")
        if LM_HEAD not in names and adapter is None:
            raise ValueError(
                f"weight update for version {version} has no {LM_HEAD!r}. Send it even when "
                "embeddings are tied (e.g. lm_head.weight = model.embed_tokens.weight): vLLM "
                "keeps the old lm_head otherwise and its log-probs silently diverge from the "
                "learner's.")
        if len(set(names)) != len(names):
            raise ValueError("duplicate tensor names in a weight update")
        if transport not in self.senders:
            self.senders[transport] = t.first_sender()
        return t.publish(items, version, adapter=adapter, sender=self.senders[transport])

    def open(self, transport: TransportName, num_workers: int, ranks_per_worker: int = 1, *,
             host: str | None = None, port: int | None = None) -> list[dict]:
        """GPU only: open the transport's group on this rank (nccl: the trainer end of
        vLLM's NCCL weight-transfer group at host:port, by default this node's address and a
        free port); returns each rollout worker's init info."""
        sender, infos = self._transport(transport).open(num_workers, ranks_per_worker,
                                                        host=host, port=port)
        self.senders[transport] = sender
        return infos

    def connect(self, transport: TransportName) -> None:
        """Join the group `open` opened; blocks until every worker has joined."""
        self.senders[transport].connect()

    def _transport(self, name: TransportName) -> WeightTransport:
        if name not in self.transports:
            self.transports[name] = transport_named(name).for_run(self.run_id, self.sync)
        return self.transports[name]
