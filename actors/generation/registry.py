"""The generation modes, one table: their names (`GenerationModeName`), the mode each names
(`MODES`), and the one reading of the config's switch (`generation_mode`). Everything that must
tell modes apart asks the mode instead of reading `rollout.in_flight_updates`: the config's
rules, the worker pool, the controller, the rollout worker (`tests/test_generation.py` checks
that no code outside this package reads the switch or stale_kv).

Adding a mode (partial rollouts with abort and re-prefill, say): a module of this package with
its `GenerationMode` subclass and driver, its name in `GenerationModeName`, its class in
`MODES` (the two must agree, checked below), and the config's spelling of it in
`generation_mode`.

Imported by the config: no Ray or vLLM at module level, here or in the modes' modules.
"""
from __future__ import annotations

from typing import Literal, get_args

from actors.generation.base import GenerationMode, StaleKv
from actors.generation.batch import BatchLevel
from actors.generation.in_flight import Continuous

GenerationModeName = Literal["batch", "continuous"]
MODES: dict[str, type[GenerationMode]] = {m.name: m for m in (BatchLevel, Continuous)}
if tuple(MODES) != get_args(GenerationModeName):
    raise ImportError(f"actors.generation.registry.MODES {tuple(MODES)} must name exactly the "
                      f"GenerationModeName Literal's modes {get_args(GenerationModeName)}, in "
                      "its order")


def generation_mode(in_flight_updates: bool, stale_kv: StaleKv = "recompute") -> GenerationMode:
    """The mode `rollout.in_flight_updates` picks, with `rollout.stale_kv` (continuous only:
    batch-level refuses keep in its `check`)."""
    return MODES["continuous" if in_flight_updates else "batch"](stale_kv)
