"""A random model whose response lengths spread from one token to the cap: `klrl bench`'s
long-tail workload, where a batch that waits for its longest response waits longest.

The tiny random model alone does not spread much: its byte-level vocabulary (260 tokens)
makes the end-of-sequence token about 1 in 260 at every step, so with 128 new tokens some 60%
of the samples reach the cap (lengths' max / mean about 1.35). Here the same model gets an
end-of-sequence probability `p` at every step instead, so the lengths are geometric with
mean about 1 / p, cut at the cap: most are short, a few run many times longer.

How, with the architecture unchanged (vLLM serves it as any Qwen2): every token's embedding
gains one shared direction u (of norm 1, several times a random row's), so the final hidden
state h of every position points largely along u, with little spread (layer outputs are
small at this initialisation); the end-of-sequence row of the output layer gains k u, which
adds about k (h . u) to that token's logit at every position, k chosen from h . u measured on
random sequences so that the added logit is log((V - 1) p / (1 - p)) against the other V - 1
tokens' near-zero logits. Deterministic for a seed: k is rounded, so a rebuild is the same
model bit for bit up to the forward pass's rounding.
"""
from __future__ import annotations

import math
from pathlib import Path

from cluster.tiny.model import build_random_model

SHARED_NORM = 1.0          # the norm of the direction added to every embedding row
CALIBRATION_SHAPE = (8, 64)  # random sequences on which h . u is measured


def build_long_tail_model(out_dir: str | Path, eos_probability: float, seed: int = 0,
                          **size) -> Path:
    """The tiny random model (`build_random_model(out_dir, seed, **size)`) with the
    end-of-sequence token sampled with about `eos_probability` at every step (at temperature
    1, no top-k or top-p); returns its directory."""
    import torch
    from transformers import AutoModelForCausalLM

    if not 0 < eos_probability < 1:
        raise ValueError(f"eos_probability must be in (0, 1), not {eos_probability}")
    out = build_random_model(out_dir, seed=seed, **size)
    model = AutoModelForCausalLM.from_pretrained(str(out))  # fp32, as built
    if model.config.tie_word_embeddings:
        raise ValueError("the long-tail model needs untied embeddings: the shared direction "
                         "would otherwise enter every output row too")
    vocab, eos = model.config.vocab_size, model.config.eos_token_id
    gen = torch.Generator().manual_seed(seed + 1)
    u = torch.randn(model.config.hidden_size, generator=gen)
    u /= u.norm()
    with torch.no_grad():
        model.model.embed_tokens.weight += SHARED_NORM * u
        ids = torch.randint(0, vocab, CALIBRATION_SHAPE, generator=gen)
        h = model(ids, output_hidden_states=True).hidden_states[-1]  # after the final norm
        along = float((h @ u).mean())
        bias = math.log((vocab - 1) * eos_probability / (1 - eos_probability))
        model.lm_head.weight[eos] += float(f"{bias / along:.3g}") * u
    model.save_pretrained(str(out))  # replaces the weights; tokenizer and configs stay
    return out
