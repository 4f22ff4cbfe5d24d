"""The one form of every kl/ setting: a `Literal` names the choices and one table maps each name
to the object (or function) that owns its behaviour.

The Literal is the home of the names (the pydantic configs validate against it and the tables'
public name tuples are derived from it with `get_args`); the table is the home of what each name
does and requires. Code that depends on a setting looks its name up in the table and asks the
entry, never compares the name with a string, so a new choice is one Literal name and one entry.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar, get_args

Entry = TypeVar("Entry")


def literal_names(literal: Any, table: Mapping[str, Any], *, table_name: str, literal_name: str,
                  kind: str) -> tuple[str, ...]:
    """The names of `literal`, in its order, once `table` is known to key exactly those names in
    that order. Called at import, so a name in one and not the other fails before any use."""
    names = get_args(literal)
    if tuple(table) != names:
        raise ImportError(f"{table_name} {tuple(table)} must name exactly the {literal_name} "
                          f"Literal's {kind} {names}")
    return names


def lookup(table: Mapping[str, Entry], name: str, setting: str) -> Entry:
    """`table[name]`; an unknown name is refused with the supported ones listed."""
    entry = table.get(name)
    if entry is None:
        raise ValueError(f"{setting} must be one of {tuple(table)}, got {name!r}")
    return entry
