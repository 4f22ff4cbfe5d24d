"""How a rollout worker generates, one package: `rollout.in_flight_updates` picks a mode of
`registry.MODES` (`generation_mode`), and that object answers everything that differs between
modes.

- `batch.py` (`rollout.in_flight_updates: false`): a worker generates a whole generate call
  with one policy version; its calls run one at a time, in the order sent, and a weight load
  waits behind the generate calls sent before it.
- `in_flight.py` (`true`, with `rollout.stale_kv`): the engine generates continuously
  (`continuous.py`, the `ContinuousEngine`) and takes each weight update between two engine
  steps while requests are in flight; each token carries the version that sampled it.

`base.py` says what every mode answers: its config rules and refusals, its engine options, the
worker actor's concurrency groups and how generate calls are sent to it, the min_version of a
generate call, what a weight load waits behind, and the driver the worker drives its engine
through (`EngineDriver`: one `generate`, one `update` shape for every mode).

`progress.py` is every mode's alike: the engine's steps, counted and timed under whatever
drives them, which a worker reports apart from its probe (a wedged engine, cluster/train/).
"""
from actors.generation.base import Completion, EngineDriver, GenerationMode, Generated, StaleKv
from actors.generation.registry import MODES, GenerationModeName, generation_mode

__all__ = ["MODES", "Completion", "EngineDriver", "GenerationMode", "GenerationModeName",
           "Generated", "StaleKv", "generation_mode"]
