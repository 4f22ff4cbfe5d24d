"""Skip a test module when a package it needs is not installed, without importing it.

`pytest.importorskip("vllm")` imports vLLM to decide, and a module-level call runs while
pytest collects: every xdist worker paid seconds for it, `make test-quick` included, which runs
none of those tests. Looking the package up is enough to decide."""
from __future__ import annotations

import importlib.util

import pytest


def skip_without(package: str) -> None:
    """At module level: skip the whole module when `package` cannot be found."""
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed", allow_module_level=True)
