"""What the learner writes for people to read: Hugging Face model and adapter directories, and
the file modes they get.

safetensors writes its file 0600 (readable by its owner only) whatever the umask, so a trained
model shared on a cluster filesystem would be unreadable by colleagues; `mkdtemp` makes 0700
directories. Files and directories written for others get the modes the umask allows, as any
other file would (0644 / 0755 under the usual umask 022): `give_normal_modes`, in
learner/file_modes.py, torch-free, so the tiny model's cache (cluster/tiny/) uses it without
loading torch at `klrl --help`.
"""
from __future__ import annotations

from pathlib import Path

import torch

from learner import lora
from learner.file_modes import give_normal_modes
from learner.loading import ModelFiles, load_tokenizer


def write_model(module, weights: dict[str, torch.Tensor], out_dir: str | Path,
                files: ModelFiles) -> str:
    """`module`'s config with `weights` (HF names) and the policy's tokenizer in `out_dir`,
    loadable by transformers and vLLM."""
    if getattr(module.config, "tie_word_embeddings", False):
        weights.pop("lm_head.weight", None)  # tied: transformers and vLLM re-tie on load
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    module.save_pretrained(str(out), state_dict=weights, safe_serialization=True)
    load_tokenizer(files).save_pretrained(str(out))
    give_normal_modes(out)  # safetensors writes 0600: colleagues could not read the model
    return str(out)


def write_adapter_dir(module, tensors: dict[str, torch.Tensor],
                      full: dict[str, torch.Tensor] | None, scaling: float, out_dir: str | Path,
                      files: ModelFiles) -> str:
    """A LoRA policy (`module`, PEFT-wrapped) as PEFT's adapter files for the base model, with
    the tokenizer; with `full` (all HF-named weights, adapters included) also the merged model
    in out_dir/merged."""
    if full is not None:
        merged = lora.merged_weights(full, scaling)
        write_model(module.get_base_model(), merged, Path(out_dir) / "merged", files)
    load_tokenizer(files).save_pretrained(str(out_dir))
    config = lora.adapter_config(module) | {"base_model_name_or_path": files.policy}
    lora.write_adapter(out_dir, tensors, config)  # last: it marks final/ complete
    give_normal_modes(Path(out_dir))
    return str(out_dir)
