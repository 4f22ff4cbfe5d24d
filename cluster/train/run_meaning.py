"""Which config keys change what a run means: the one rule behind `klrl train --resume` and
`klrl sweep` counting a run as one of its own.

A run's meaning is what it trained and what it measured: every key of its TrainConfig except
those in FREE, which only say where the run is written and logged, how often it keeps state,
what it runs on, and when a failing run is given up. A key not listed in FREE changes the
meaning, so an option added later is safe until someone decides otherwise (and lists it here,
with its reason).

- `klrl sweep` counts a run directory as a run of the sweep only when its recorded
  config.yaml has the meaning the sweep would give that run now (`meaning_changes`);
  otherwise it refuses, naming the run and the keys (cluster/sweeps/sweep.py).
- `klrl train --resume` refuses a checkpoint whose config has another meaning
  (`resume_changes`), with two differences: a resumed run may move its end (RESUME_MAY_CHANGE:
  the run then did train to the new end, and its config.yaml says so), and it keeps the keys
  its checkpoint's layout depends on (RESUME_KEEPS: DeepSpeed's state is saved per rank and
  ZeRO partition), which are FREE for a sweep's purposes.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.config.loader import ConfigError
from cluster.config.train_config import TrainConfig

# Keys (a section name covers its keys) that never change what a run trains or measures.
FREE = (
    # where the run is written, what it is called, how it is logged, what else it writes
    "run_name", "output_dir", "logging", "learner.lora.save_merged",
    # how often it keeps checkpoints and exports, and when it evaluates (each evaluation
    # measures the same thing; the cadence only says at which steps)
    "eval_every", "checkpoint_every", "keep_checkpoints", "hf_every", "keep_hf",
    # when a failing run is given up: a run that finishes trained the same; one that stops
    # early says so
    "max_consecutive_nonfinite", "faults", "task.max_malformed_fraction",
    # what it runs on: the same computation on other processes, threads or memory budgets
    "ray", "sync", "task.scorer_workers",
    "rollout.cpu_kv_cache_gib", "rollout.gpu_memory_utilization", "rollout.num_cpus_per_worker",
    "rollout.threads_per_worker", "rollout.num_gpus_per_worker", "rollout.enforce_eager",
    "rollout.tensor_parallel_size", "rollout.max_num_seqs", "rollout.max_num_batched_tokens",
    "rollout.enable_prefix_caching",
    "learner.num_ranks", "learner.zero_stage", "learner.offload_optimizer",
    "learner.offload_param", "learner.num_cpus_per_rank", "learner.threads_per_rank",
    "learner.omp_wait_policy", "learner.num_gpus_per_rank", "learner.micro_batch_size",
    "learner.token_budget", "learner.packing", "learner.gradient_checkpointing",
    "learner.attn_implementation",
)
# Where a run ends: a resume may move it (a finished run is extended with a larger total_steps).
RESUME_MAY_CHANGE = ("total_steps", "data.epochs")
# FREE keys a checkpoint's layout depends on: a resumed run keeps them.
RESUME_KEEPS = ("learner.num_ranks", "learner.zero_stage", "learner.offload_optimizer",
                "learner.offload_param")

_ABSENT = object()


@dataclass(frozen=True)
class Change:
    """One key whose value differs between a run's recorded config and the one asked for."""

    key: str
    old: Any
    new: Any

    def __str__(self) -> str:
        shown = ["(absent)" if v is _ABSENT else repr(v) for v in (self.old, self.new)]
        return f"{self.key}: {shown[0]} -> {shown[1]}"


def _covered(key: str, keys: tuple[str, ...]) -> bool:
    return any(key == k or key.startswith(k + ".") for k in keys)


def is_free(key: str) -> bool:
    """Whether the dotted config key `key` is in FREE (itself or inside a FREE section): it
    never changes what a run trains or measures. Reports label runs by the other keys."""
    return _covered(key, FREE)


def meaning_changes(saved: dict, current: dict, free: tuple[str, ...] = FREE) -> list[Change]:
    """Every key outside `free` whose value differs between the config a run recorded and the
    current one (both resolved TrainConfigs as plain dicts, `model_dump(mode="json")`). A key
    the saved config lacks (written before the option existed) had the option's default: a
    change only if the current value is not that default."""
    defaults = TrainConfig().model_dump(mode="json")
    return [c for c in _changes(saved, current, "", defaults) if not _covered(c.key, free)]


def resume_changes(saved: dict, current: dict) -> list[Change]:
    """What a resumed run may not change: its meaning, less where it ends, plus its
    checkpoint's layout."""
    free = tuple(k for k in FREE if k not in RESUME_KEEPS) + RESUME_MAY_CHANGE
    return meaning_changes(saved, current, free)


def check_resume_meaning(run_dir: Path, checkpoint: Path, saved: dict, current: dict) -> None:
    """ConfigError naming each key a resume from `checkpoint` would change (the door of
    `klrl train --resume`, cluster/train/door/preflight.py)."""
    if changes := resume_changes(saved, current):
        raise ConfigError(
            f"cannot resume {run_dir} from {checkpoint.name}: the config changed "
            f"{'; '.join(map(str, changes))}. A resumed run keeps what it trains and measures "
            "(every key but total_steps, data.epochs and the logging, cadence, path and "
            "resource keys listed in docs/checkpoints.md): drop those overrides, or start a new "
            "run (another run_name)")


def _changes(old: Any, new: Any, key: str, default: Any) -> list[Change]:
    if old is _ABSENT:
        old = default
    if isinstance(old, dict) and isinstance(new, dict):
        sub = default if isinstance(default, dict) else {}
        keys = [*old, *(k for k in new if k not in old)]
        return [c for k in keys for c in _changes(
            old.get(k, sub.get(k, _ABSENT)), new.get(k, _ABSENT), f"{key}.{k}" if key else k,
            sub.get(k, _ABSENT))]
    if old == new:
        return []
    return [Change(key, old, new)]
