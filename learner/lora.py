"""LoRA: low-rank adapters (PEFT) trained on a frozen base model.

With `learner.lora` set, the learner wraps the policy in a PEFT `LoraConfig` model: the base
weights are frozen and only the adapters' A and B matrices reach the optimizer (so the AdamW
moments, the gradients and the checkpoints are the adapters' size). B starts at zero, so the
policy at version 0 *is* the base model, and when no separate reference is configured the
reference log-probs are the same model's with the adapters switched off
(`PeftModel.disable_adapter()`): no second copy of the model. The KL math is unchanged:
pi_theta is the base plus the adapters, pi_ref the base, and every estimator and placement
takes their log-probs as before.

Weights out are the adapters only (`adapter_tensors`), under PEFT's file names
(`base_model.model.<module>.lora_A.weight`), which vLLM's LoRA loader reads; the rollout
workers serve them with vLLM's LoRA support (actors/rollout_worker.py). `merged_weights`
folds them into the base for a plain Hugging Face model (`learner.lora.save_merged`).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

ADAPTER = "default"           # PEFT's name of the one adapter
PREFIX = "base_model.model."  # PEFT's prefix of the wrapped model's parameter names


def wrap(policy, cfg) -> Any:
    """The policy with fresh adapters (`cfg`: learner.lora), its base frozen."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(policy, LoraConfig(r=cfg.rank, lora_alpha=cfg.resolved_alpha,
                                             lora_dropout=cfg.dropout,
                                             target_modules=cfg.target_modules, bias="none"))


def is_adapter_parameter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def file_name(name: str) -> str:
    """A parameter's name in the adapter file (PEFT drops the adapter's own name)."""
    return name.replace(f".{ADAPTER}.", ".")


def adapter_tensors(module, gather: bool) -> dict[str, torch.Tensor]:
    """The adapters' CPU copies under their adapter-file names; `gather` (ZeRO-3: collective)
    assembles each partitioned one first."""
    import deepspeed

    out = {}
    for name, p in module.named_parameters():
        if is_adapter_parameter(name):
            with deepspeed.zero.GatheredParameters([p], enabled=gather):
                out[file_name(name)] = p.detach().to("cpu", copy=True)
    return out


def adapter_config(module) -> dict[str, Any]:
    """adapter_config.json's content (PEFT's, JSON-ready: its sets become sorted lists)."""
    raw = module.peft_config[ADAPTER].to_dict()
    return json.loads(json.dumps(
        raw, default=lambda v: sorted(v) if isinstance(v, set) else str(v)))


def write_adapter(out_dir: str | Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    """adapter_model.safetensors, then adapter_config.json (which marks the directory
    complete): what PEFT and vLLM load."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()},
              str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out


def merged_weights(weights: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """The base model's HF-named weights with each adapter folded in, W + scaling x B @ A,
    from the wrapped model's full named parameters (`weights`)."""
    merged: dict[str, torch.Tensor] = {}
    for name, value in weights.items():
        if is_adapter_parameter(name):
            continue
        plain = name.removeprefix(PREFIX)
        if ".base_layer." in plain:
            layer = name.replace(".base_layer.weight", "")
            a = weights.get(f"{layer}.lora_A.{ADAPTER}.weight")
            b = weights.get(f"{layer}.lora_B.{ADAPTER}.weight")
            plain = plain.replace(".base_layer.", ".")
            if a is not None and name.endswith(".base_layer.weight"):
                value = value + scaling * (b.float() @ a.float()).to(value.dtype)
        merged[plain] = value
    return merged
