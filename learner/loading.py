"""Where the learner's models and tokenizer come from, and how they are loaded.

learner/ may import only kl/ (docs/layout.md), so cluster/train/launch.py turns
`TrainConfig.model` into a `ModelFiles` and hands it in. Every `from_pretrained` of learner/
goes through this module, so `revision` and `trust_remote_code` reach all of them (policy,
reference, tokenizer).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from learner.config import LearnerConfig


@dataclass(frozen=True)
class ModelFiles:
    """policy: the policy's starting weights (a directory or hub name); reference: the KL
    reference's, None for the policy's own starting weights; revision (hub branch, tag or
    commit, for both) and trust_remote_code as `model.revision` / `model.trust_remote_code`."""

    policy: str
    reference: str | None = None
    revision: str | None = None
    trust_remote_code: bool = False

    @classmethod
    def of(cls, model: str | Path | ModelFiles) -> ModelFiles:
        """A ModelFiles as given, or one for a bare policy path (reference = policy)."""
        return model if isinstance(model, ModelFiles) else cls(policy=str(model))

    @property
    def reference_path(self) -> str:
        return self.reference or self.policy

    def hub_kwargs(self) -> dict:
        return {"revision": self.revision, "trust_remote_code": self.trust_remote_code}


def load_causal_lm(path: str, files: ModelFiles, cfg: LearnerConfig):
    """The model at `path` (the policy's or the reference's) in cfg.dtype with cfg's attention
    kernel (None: transformers' default)."""
    from transformers import AutoModelForCausalLM

    kwargs = files.hub_kwargs()
    if cfg.attn_implementation is not None:
        kwargs["attn_implementation"] = cfg.attn_implementation
    dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)


def load_tokenizer(files: ModelFiles):
    """The policy's tokenizer (the reference shares it: model.ref_path's contract)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(files.policy, **files.hub_kwargs())
