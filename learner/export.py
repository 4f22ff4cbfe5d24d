"""Weights out of the learner for a sync: what each rank gathers (the full Hugging Face-named
weights, or with LoRA the adapters only), in the form the sync transport needs, and rank 0's
hand-off to the weight publisher.

The transport is injected, not imported: learner/ may import only kl/ (docs/layout.md), so
cluster/ hands every rank a copy of a `WeightPublisher` (actors.weight_sync.WeightPublisher),
and the export asks it what the named transport needs (`ExportNeeds`) instead of telling
transports apart itself.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Protocol

import torch

from learner import lora
from learner.config import LearnerConfig


class ExportNeeds(Protocol):
    """What a transport needs of the exported tensors (actors.weight_sync's transports)."""

    on_learner_device: bool     # on the learner's GPU, not CPU copies
    reads_after_publish: bool   # read after publish returns: copies the optimizer cannot touch


class WeightPublisher(Protocol):
    """What the learner needs from the weight sync: cluster/ passes in
    actors.weight_sync.WeightPublisher. `open` and `connect` are for the transports whose
    workers join a group with learner rank 0 (nccl)."""

    def needs(self, transport: str) -> ExportNeeds: ...

    def publish(self, weights: dict[str, torch.Tensor], version: int, transport: str, *,
                adapter: dict | None = None) -> Any: ...

    def open(self, transport: str, num_workers: int,
             ranks_per_worker: int = 1) -> list[dict]: ...

    def connect(self, transport: str) -> None: ...


class WeightExporter:
    """One rank's weight export: gathers the weights a sync sends (collective under ZeRO-3:
    every rank calls `export`), and on rank 0 publishes them and sets up the transport's group
    through the publisher it owns (None: this learner cannot export)."""

    def __init__(self, publisher: WeightPublisher | None, rank: int, cfg: LearnerConfig):
        self.publisher, self.rank, self.cfg = publisher, rank, cfg

    def export(self, module, device: torch.device, version: int, transport: str):
        """Publish `module`'s weights as `version` through `transport` (collective; rank 0
        returns the WeightUpdate with the gather's seconds, the other ranks None).

        A transport that serialises before `publish` returns (shm, object_store) reads the
        live CPU parameters without a copy: this rank's actor runs one call at a time, so the
        optimizer cannot step meanwhile, and a fresh copy per sync costs page faults for
        nothing (docs/bench.md). One that reads them after (nccl's background broadcast) gets
        copies, and so does every transport under ZeRO-3, which re-partitions after the
        gather. A transport on the learner's GPU (nccl, cuda_ipc) gets them there."""
        needs = self._publisher().needs(transport)
        zero3 = self.cfg.zero_stage == 3
        t0 = time.perf_counter()
        adapter = None
        if self.cfg.lora is not None:  # the adapters only: the workers hold the base
            weights = lora.adapter_tensors(module, gather=zero3)
            adapter = lora.adapter_config(module)
        else:
            weights = full_weights(module, zero3,
                                   str(device) if needs.on_learner_device else "cpu",
                                   copy=needs.reads_after_publish or zero3)
        if self.rank != 0:
            return None
        gather_s = time.perf_counter() - t0
        update = self._publisher().publish(weights, version, transport, adapter=adapter)
        return dataclasses.replace(update, seconds={"gather": gather_s, **update.seconds})

    def open(self, transport: str, num_workers: int, ranks_per_worker: int = 1) -> list[dict]:
        """Rank 0, GPU only: open the transport's group; each rollout worker's init info."""
        return self._publisher().open(transport, num_workers, ranks_per_worker)

    def connect(self, transport: str) -> None:
        self._publisher().connect(transport)  # blocks until every worker has joined

    def _publisher(self) -> WeightPublisher:
        if self.publisher is None:
            raise RuntimeError("this learner has no weight publisher: pass "
                               "LearnerGroup(..., publisher=actors.weight_sync."
                               "WeightPublisher(run_id, sync_cfg))")
        return self.publisher


def full_weights(module, zero3: bool, device: str = "cpu",
                 copy: bool = True) -> dict[str, torch.Tensor]:
    """`module`'s full HF-named weights on `device` (collective under ZeRO-3: parameters are
    gathered one at a time, so no rank holds more than the copy plus one parameter).
    copy=False returns the live parameters where they already are on `device` (ZeRO-0/1/2
    only; the caller must be done with them before the next optimizer step). Includes
    `lm_head.weight` even when tied to the embeddings: vLLM's reload needs it."""
    import deepspeed

    out: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if zero3:
            with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                out[name] = p.detach().to(device, copy=True)
        else:
            out[name] = p.detach().to(device, copy=copy)
    if "lm_head.weight" not in out:
        head = module.get_output_embeddings()
        tied = [n for n, p in module.named_parameters(remove_duplicate=False)
                if p is head.weight]
        out["lm_head.weight"] = out[tied[0]]
    return out
