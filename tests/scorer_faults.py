"""Misbehaving scorers for the scoring-pool tests.

A module of its own (not a test file) so that spawned scoring workers can import it by name:
pytest puts tests/ on sys.path and workers inherit the parent's sys.path. `misbehave` does
what its completion says, so one batch can mix healthy and faulty items.
"""
from __future__ import annotations

import ctypes
import decimal
import fractions
import os
import time

_LEAKED: list[bytes] = []
MIB = 1024 * 1024


def _hang() -> None:
    while True:
        time.sleep(0.05)


def _spin() -> None:
    """Hangs without ever sleeping or releasing the GIL."""
    x = 0
    while True:
        x += 1


def _allocate_without_bound() -> None:
    # bytes(n) is calloc'd: address space grows at once, without the (slow) page touching,
    # so only the address-space limit can stop this within the timeout.
    chunks = []
    while True:
        chunks.append(bytes(64 * MIB))


def _allocate(mib: int) -> float:
    return float(len(bytes(mib * MIB)) // MIB)


def _leak(mib: int) -> float:
    """Keeps `mib` MiB in a module global: the worker must be retired, not grow forever."""
    _LEAKED.append(bytes(mib * MIB))
    return float(os.getpid())


class _HostileError(Exception):
    def __str__(self):
        raise RuntimeError("no message for you")


def _raise_hostile() -> None:
    raise _HostileError()


VALUES = {
    "none": None, "nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"),
    "str": "1.0", "list": [1.0], "dict": {}, "complex": 1 + 2j, "huge_int": 10**400,
    "object": object(), "true": True, "int": 3, "fraction": fractions.Fraction(1, 4),
    "decimal": decimal.Decimal("0.5"), "float": 0.75,
}

ACTIONS = {
    "hang": _hang,
    "spin": _spin,
    "alloc_unbounded": _allocate_without_bound,
    "alloc_huge": lambda: _allocate(64 * 1024),  # 64 GiB at once
    "raise": lambda: 1 / 0,
    "raise_hostile": _raise_hostile,
    "system_exit": lambda: _system_exit(),
    "exit": lambda: os._exit(7),
    "segfault": lambda: ctypes.string_at(0),  # reads address 0: SIGSEGV
    "recursion": lambda: _recurse(),
}


def _system_exit():
    raise SystemExit(3)


def _recurse():
    return _recurse()


def misbehave(completion: str, problem) -> object:
    """"ok" -> 1.0; "pid" -> the worker's pid; "alloc:N" / "leak:N" -> allocate N MiB;
    "value:KEY" -> VALUES[KEY]; any ACTIONS key -> that fault."""
    if completion == "ok":
        return 1.0
    if completion == "pid":
        return float(os.getpid())
    kind, _, arg = completion.partition(":")
    if kind == "alloc":
        return _allocate(int(arg))
    if kind == "leak":
        return _leak(int(arg))
    if kind == "value":
        return VALUES[arg]
    return ACTIONS[completion]()


def yes_scorer(completion: str, problem) -> float:
    return 1.0 if completion == "yes" else 0.0


not_callable = 42
# A lambda on purpose: pickle cannot send it to a scoring worker, which the task check refuses.
lambda_scorer = lambda completion, problem: 1.0  # noqa: E731
