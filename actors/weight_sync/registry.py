"""The weight transports, one table: `sync.transport`'s names (`TransportName`, the Literal
SyncConfig takes) and the transport each names (`TRANSPORTS`). Everything that must tell
transports apart asks the transport (`transport(name)`) instead of comparing its name: the
config's rules, the learner's export, the controller, the workers, `klrl bench`, and the
option's description in the docs (`describe`).

Adding a transport: a module of this package with its `WeightTransport` subclass, its name in
`TransportName` (base.py) and its instance in `TRANSPORTS` (the two must agree, checked below).

Imported by the config: no Ray, vLLM, DeepSpeed or CUDA at module level, here or in the
transports' modules (they import them inside the methods that run in the actors).
"""
from __future__ import annotations

from typing import get_args

from actors.weight_sync.base import TransportName, WeightTransport
from actors.weight_sync.cuda_ipc import CudaIpcTransport
from actors.weight_sync.nccl import NcclTransport
from actors.weight_sync.object_store import ObjectStoreTransport
from actors.weight_sync.shm import ShmTransport

TRANSPORTS: dict[str, WeightTransport] = {
    t.name: t for t in (ShmTransport(), ObjectStoreTransport(), NcclTransport(),
                        CudaIpcTransport())}
if tuple(TRANSPORTS) != get_args(TransportName):
    raise ImportError(f"actors.weight_sync.registry.TRANSPORTS {tuple(TRANSPORTS)} must name "
                      f"exactly the TransportName Literal's transports "
                      f"{get_args(TransportName)}, in its order")


def transport(name: str) -> WeightTransport:
    """The transport `name` names; ValueError listing the transports otherwise."""
    found = TRANSPORTS.get(name)
    if found is None:
        raise ValueError(f"unknown transport {name!r}; one of {tuple(TRANSPORTS)}")
    return found


def describe() -> str:
    """`sync.transport`'s description: each transport's summary, in the table's order."""
    return " ".join(f"{name}: {t.summary}." for name, t in TRANSPORTS.items())
