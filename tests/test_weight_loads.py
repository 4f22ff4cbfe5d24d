"""A weight load that leaves a parameter of the engine's model unloaded raises
(actors/weight_sync/loads.py): vLLM only logs such names, at a level klrl hides. The recorder
and the check, on a small torch model with vLLM's `load_weights` contract (it returns the
names it loaded); tests/test_weight_sync.py checks the same through a real vLLM engine."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from actors.weight_sync.loads import WeightsNotLoaded, recorded_loads, refuse_unloaded, unloaded


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(4, 2)
        self.head = torch.nn.Linear(2, 4, bias=False)

    def load_weights(self, weights) -> set[str]:
        params, names = dict(self.named_parameters()), set()
        for name, tensor in weights:
            if name in params:  # a name the model does not have is skipped, as vLLM's are
                params[name].data.copy_(tensor)
                names.add(name)
        return names


class _Runner:
    def __init__(self, model):
        self.model = model

    def get_model(self):
        return self.model


CONFIG = SimpleNamespace(model_config=SimpleNamespace(quantization=None), lora_config=None)


def test_the_parameters_no_load_reached_are_named_and_refused():
    runner = _Runner(_Model())
    weights = {"embed.weight": torch.ones(4, 2), "head.weight": torch.ones(4, 2)}
    with recorded_loads(runner) as calls:
        runner.get_model().load_weights(iter(weights.items()))
    assert unloaded(runner, CONFIG, calls) == []
    assert "load_weights" not in vars(runner.model)  # the model's own method again

    with recorded_loads(runner) as calls:  # in two calls, one with a name the model lacks
        runner.model.load_weights(iter([("embed.weight", torch.zeros(4, 2))]))
        runner.model.load_weights(iter([("lm_head.weight", torch.zeros(4, 2))]))
    missing = unloaded(runner, CONFIG, calls)
    assert missing == ["head.weight"]
    with pytest.raises(WeightsNotLoaded, match="left 1 parameters .* head.weight"):
        refuse_unloaded(missing, "the weight load")
    refuse_unloaded([], "the weight load")  # nothing missing: nothing said

    with recorded_loads(runner) as calls:
        pass
    assert unloaded(runner, CONFIG, calls) == ["(no load_weights call: nothing was loaded)"]
    quantized = SimpleNamespace(model_config=SimpleNamespace(quantization="fp8"), lora_config=None)
    assert unloaded(runner, quantized, calls) == []  # vLLM does not check those either
