"""The weight transports' one table (actors/weight_sync/registry.py): the config's Literal, the
option's description in the docs and klrl bench's lists come from it, and no code outside
actors/weight_sync/ tells transports apart by name (checked on the source with `ast`)."""
from __future__ import annotations

import ast
import typing
from pathlib import Path

import pytest

from actors.config import SyncConfig
from actors.weight_sync import TRANSPORTS, Placement, WeightUpdate, transport
from cluster.bench import gpu
from cluster.bench.sync import CPU_TRANSPORTS

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "actors" / "weight_sync"


def test_the_config_takes_exactly_the_registrys_transports_described_by_each():
    field = SyncConfig.model_fields["transport"]
    assert typing.get_args(field.annotation) == tuple(TRANSPORTS)
    for name, t in TRANSPORTS.items():
        assert t.name == name and f"{name}: {t.summary}." in field.description
        assert t.__doc__, f"{type(t).__name__} says what it owns"


def test_an_unknown_transport_is_refused_listing_the_known_ones():
    with pytest.raises(ValueError, match="unknown transport 'tcp'.*shm.*object_store.*nccl"):
        transport("tcp")
    with pytest.raises(ValueError, match="unknown transport"):
        WeightUpdate(1, "tcp", 0, path="x")


def test_benchs_lists_follow_what_each_transport_says_it_needs():
    assert CPU_TRANSPORTS == ("shm", "object_store")
    assert gpu.sync_transports() == ("shm", "object_store", "cuda_ipc")  # nccl: a GPU each
    assert gpu.run_transport() == "cuda_ipc"
    assert gpu.measured_transports("shm") == ("shm", "object_store")


@pytest.mark.parametrize("placement, refused", [
    (Placement(1, 0, 1, 0, 1, False), ("nccl", "cuda_ipc")),        # CPU
    (Placement(1, 1, 2, 1, 1, True), ("nccl", "cuda_ipc")),         # LoRA on GPUs of their own
    (Placement(1, 0.5, 1, 0.5, 1, False), ("nccl",)),               # one shared GPU
    (Placement(2, 1, 2, 1, 1, False), ("cuda_ipc",)),               # GPUs of their own
])
def test_each_transport_refuses_what_it_cannot_serve_naming_another(placement, refused):
    for name, t in TRANSPORTS.items():
        if name not in refused:
            t.check(placement)
            continue
        with pytest.raises(ValueError) as e:
            t.check(placement)
        others = [o for o in TRANSPORTS if o != name and o in str(e.value)]
        assert f"sync.transport={name}" in str(e.value) and others, str(e.value)


def _compares_a_transport_name(node: ast.Compare) -> bool:
    """`x.transport == "shm"`, `transport in ("nccl", ...)`, `"shm" != name_of_transport`."""
    sides = [node.left, *node.comparators]

    def names_transport(n):
        name = n.attr if isinstance(n, ast.Attribute) else getattr(n, "id", "")
        return "transport" in name

    def literal_names(n):
        values = n.elts if isinstance(n, (ast.Tuple, ast.List, ast.Set)) else [n]
        return any(isinstance(v, ast.Constant) and v.value in TRANSPORTS for v in values)

    return any(names_transport(s) for s in sides) and any(literal_names(s) for s in sides)


def test_no_code_outside_the_package_tells_transports_apart_by_name():
    """Each transport's behaviour is its class's: code elsewhere asks the transport
    (`transport(name).needs_gpu`, `.check`, `.connect`, ...) instead of comparing names."""
    found = []
    for package in ("actors", "learner", "cluster"):
        for path in (ROOT / package).rglob("*.py"):
            if PACKAGE in path.parents:
                continue
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.Compare) and _compares_a_transport_name(node):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, "transport names compared outside actors/weight_sync/: " + ", ".join(found)


def test_the_check_finds_a_comparison():
    tree = ast.parse('if cfg.sync.transport == "nccl" or "shm" != transport: pass\n'
                     'if update.transport in ("nccl", "cuda_ipc"): pass\n'
                     'if transport.name == other: pass\n')
    found = sorted(n.lineno for n in ast.walk(tree)
                   if isinstance(n, ast.Compare) and _compares_a_transport_name(n))
    assert found == [1, 1, 2]
