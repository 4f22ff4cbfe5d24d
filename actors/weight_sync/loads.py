"""Whether a weight load reached every parameter of the engine's model: vLLM's in-place
reload only logs the parameters no checkpoint name reached, at a level klrl's ERROR hides, so a
name mismatch would keep old layers without a word. The worker extension records the names
the model's `load_weights` reports around each load (actors/worker_extension.py) and refuses
a load that missed any (`WeightsNotLoaded`). No vLLM import here."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator


class WeightsNotLoaded(RuntimeError):
    """A weight load left parameters of the engine's model with their old values."""


def _models(runner) -> list:
    """The model objects a load may go through: the runner's `model` (on a GPU possibly vLLM's
    CUDA-graph wrapper, which the weight-transfer path calls) and `get_model()` (the unwrapped
    model, which `reload_weights` calls)."""
    found = []
    for model in (getattr(runner, "model", None), runner.get_model()):
        if model is not None and all(model is not f for f in found):
            found.append(model)
    return found


@contextlib.contextmanager
def recorded_loads(runner) -> Iterator[list[set[str] | None]]:
    """Within it, every `load_weights` call on the runner's model adds the names vLLM reports
    loaded to the yielded list (one set per call; None where the model reports nothing)."""
    calls: list[set[str] | None] = []
    models = _models(runner)
    for model in models:
        def load_weights(weights, _original=model.load_weights):
            names = _original(weights)
            calls.append(set(names) if names is not None else None)
            return names
        model.load_weights = load_weights  # this instance only, for this load
    try:
        yield calls
    finally:
        for model in models:
            model.__dict__.pop("load_weights", None)


def unloaded(runner, vllm_config, calls: list[set[str] | None]) -> list[str]:
    """The model's parameters that none of `calls` loaded, as vLLM's own check names them
    (`reload/inplace.py`, which only logs them at a level klrl's ERROR hides): a checkpoint name
    that maps to no parameter would otherwise leave old layers in place without a word. No
    check for quantized models (vLLM skips them too) or where a call reported nothing."""
    if getattr(vllm_config.model_config, "quantization", None) is not None:
        return []
    if not calls:
        return ["(no load_weights call: nothing was loaded)"]
    if any(c is None for c in calls):
        return []
    lora = getattr(vllm_config, "lora_config", None) is not None
    want = {n.replace(".base_layer.", ".") if lora else n
            for n, _ in runner.get_model().named_parameters()}
    return sorted(want - set().union(*calls))


def refuse_unloaded(missing: list[str], where: str) -> None:
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8
                                          else "")
        raise WeightsNotLoaded(f"{where} left {len(missing)} parameters of the engine's model "
                               f"unloaded (they keep their old values): {shown}; the learner's "
                               "names do not match the engine's model")
