"""What `klrl eval MODEL_DIR` evaluates: a model directory; a LoRA adapter (a LoRA run's
final/ or hf/step_N/: served on its base model by vLLM, as the run's rollout workers served
it); or a refusal that names the way on (a run directory, a training checkpoint).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from cluster.config.loader import ConfigError
from cluster.train import checkpoint as ckpt
from cluster.train.run_log import config_path, final_dir, read_config

ADAPTER_CONFIG = "adapter_config.json"


@dataclass(frozen=True)
class EvalTarget:
    """The model vLLM loads (`model`: a directory or 'default'), the LoRA adapter served on
    it, if any (`adapter`, of rank `rank`), and the engine's dtype: that of the training run
    the model or adapter was exported by (`run_dtype`), None for a model of no run (the
    engine's default: float32 on CPU, the checkpoint's on a GPU, fp32 checkpoints as bf16)."""

    model: str
    adapter: Path | None = None
    rank: int = 0
    dtype: str | None = None


def eval_target(given: str) -> EvalTarget:
    """MODEL_DIR checked: ConfigError naming the way on when it cannot be evaluated."""
    from cluster.train.door.commands import check_eval_model

    if given == "default":
        return EvalTarget("default")
    path = Path(given).expanduser()
    _refuse_checkpoint(path)
    if (path / ADAPTER_CONFIG).is_file() and not (path / "config.json").is_file():
        adapter = json.loads((path / ADAPTER_CONFIG).read_text())
        base = _base_model(path, adapter)
        if base != "default":
            check_eval_model(base)
        return EvalTarget(base, path, int(adapter.get("r") or 8), run_dtype(path))
    check_eval_model(given)
    return EvalTarget(given, dtype=run_dtype(path))


def run_dtype(model_dir: Path) -> str | None:
    """The dtype the rollout workers of the run that exported `model_dir` (final/, hf/step_N/,
    final/merged/) sampled with: its rollout.dtype, null there meaning learner.dtype (as
    `RolloutConfig.resolved` has it). Why: the run's own evaluations ran its workers' engines,
    so `klrl eval` scores the checkpoint as training did; on a GPU vLLM's default would load an
    fp32 checkpoint as bf16. None where the directory is in no run."""
    for run_dir in (model_dir.parent, model_dir.parent.parent):
        if config_path(run_dir).is_file():
            config = read_config(run_dir)
            return ((config.get("rollout") or {}).get("dtype")
                    or (config.get("learner") or {}).get("dtype"))
    return None


def _base_model(adapter_dir: Path, adapter: dict) -> str:
    """The adapter's base: PEFT's base_model_name_or_path when that directory is here, else
    the model.path of the run the adapter belongs to (final/ or hf/step_N/ of a run
    directory; null there is the embedded tiny model: 'default')."""
    named = adapter.get("base_model_name_or_path")
    if named and Path(named).expanduser().is_dir():
        return str(Path(named).expanduser())
    for run_dir in (adapter_dir.parent, adapter_dir.parent.parent):
        if config_path(run_dir).is_file():
            return (read_config(run_dir).get("model") or {}).get("path") or "default"
    raise ConfigError(f"MODEL_DIR {adapter_dir} is a LoRA adapter whose base model "
                      f"{named!r} is not here, and it is not inside a run directory that names "
                      "one; copy the base model here, or evaluate a merged export "
                      "(learner.lora.save_merged: true writes final/merged/)")


def _refuse_checkpoint(path: Path) -> None:
    """A training checkpoint (checkpoints/ or checkpoints/step_N/) holds DeepSpeed state, not
    a model: name the exports of that run that are models."""
    if path.name == "checkpoints" and path.parent.is_dir():
        run_dir, step = path.parent, None
    elif (path / ckpt.MARKER).is_file() or (path / "controller.json").is_file():
        run_dir, step = path.parent.parent, path.name
    else:
        return
    exports = ckpt.hf_exports(run_dir)
    same = [p for p in exports if p.name == step]
    models = [str(p) for p in same or exports[-2:]]
    if final_dir(run_dir).is_dir():
        models.append(str(final_dir(run_dir)))
    where = (f"evaluate {' or '.join(models)}" if models else
             "this run wrote no model yet: let it finish (final/), or give it hf_every > 0 "
             "for an export every N steps (`klrl train --resume RUN_DIR hf_every=N`)")
    raise ConfigError(f"MODEL_DIR {path} is a training checkpoint (the learner's DeepSpeed "
                      f"state, for --resume), not a model; {where}")
