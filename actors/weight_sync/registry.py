"""The weight transports, one table: `sync.transport`'s names (`TransportName`, the Literal
SyncConfig takes) and the transport each names (`TRANSPORTS`). Everything that must tell
transports apart asks the transport (`transport(name)`) instead of comparing its name: the
learner's export, the controller, the workers and `klrl bench`. What each transport is (its
traits, which the config and the docs' option description read) lives in traits.py, without
torch: the config asks `traits.transport_traits(name)`.

Adding a transport: its name in `TransportName` and its traits class (config rules, what it
is) in `TRANSPORT_TRAITS` (traits.py), then a module of this package with its
`WeightTransport` subclass, which inherits that traits class, and its instance in `TRANSPORTS`
(names and classes must agree, checked below).

No Ray, vLLM or DeepSpeed at module level, here or in the transports' modules (they import
them inside the methods that run in the actors).
"""
from __future__ import annotations

from typing import get_args

from actors.weight_sync.base import WeightTransport
from actors.weight_sync.cuda_ipc import CudaIpcTransport
from actors.weight_sync.nccl import NcclTransport
from actors.weight_sync.object_store import ObjectStoreTransport
from actors.weight_sync.shm import ShmTransport
from actors.weight_sync.traits import TRANSPORT_TRAITS, TransportName

TRANSPORTS: dict[str, WeightTransport] = {
    t.name: t for t in (ShmTransport(), ObjectStoreTransport(), NcclTransport(),
                        CudaIpcTransport())}
if tuple(TRANSPORTS) != get_args(TransportName):
    raise ImportError(f"actors.weight_sync.registry.TRANSPORTS {tuple(TRANSPORTS)} must name "
                      f"exactly the TransportName Literal's transports "
                      f"{get_args(TransportName)}, in its order")
if stray := [n for n, t in TRANSPORTS.items() if not isinstance(t, type(TRANSPORT_TRAITS[n]))]:
    raise ImportError(f"the transports {stray} must inherit the traits class of their name "
                      "(actors.weight_sync.traits.TRANSPORT_TRAITS), the one home of their traits")


def transport(name: str) -> WeightTransport:
    """The transport `name` names; ValueError listing the transports otherwise."""
    found = TRANSPORTS.get(name)
    if found is None:
        raise ValueError(f"unknown transport {name!r}; one of {tuple(TRANSPORTS)}")
    return found

