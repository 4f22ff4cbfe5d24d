"""`klrl bench`: the learner's step packed against padded, on the same batch of spread lengths.

Reasoning data's response lengths spread over orders of magnitude, so a padded micro-batch is
mostly padding. On the headline workload's model, a batch whose response lengths are drawn
from a long-tailed (Pareto) distribution up to `SPREAD.max_response` tokens is trained by the
learner's own step (learner/micro_batches.py: reference log-probs, forward, loss, backward
under the run's token budget, then AdamW) in both layouts, interleaved (padded, packed, then
packed, padded, ...) so that a machine's drift reaches both alike; the figures are each
layout's median seconds with their range, trained tokens per second (real tokens, no padding),
and the speed-up as the median of the pairs' ratios with its range. What bounds it: the
padding share (reported) caps what packing saves in the layers; the logits, the loss and the
optimizer step cost the same in both. One process, no Ray and no DeepSpeed (their costs are
the engines table's); run in a subprocess with the rank's threads.
"""
from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Spread:
    """The length-spread batch: `sequences` in groups of `group`, prompts of `prompt`
    tokens, response lengths min(max_response, ceil(scale x Pareto(alpha)))."""

    sequences: int = 64
    group: int = 4
    prompt: int = 16
    max_response: int = 320
    scale: float = 12.0
    alpha: float = 1.1


SPREAD = Spread()
QUICK_SPREAD = Spread(sequences=8, group=2, prompt=4, max_response=48, scale=4.0)


def spread_batch(vocab_size: int, spread: Spread, seed: int = 0):
    """A TrainBatch of random tokens with long-tailed response lengths (right-padded)."""
    import math

    import torch

    from learner.batch import TrainBatch

    rng = random.Random(f"bench-packing:{seed}")
    lengths = [min(spread.max_response, math.ceil(spread.scale * rng.paretovariate(spread.alpha)))
               for _ in range(spread.sequences)]
    width = spread.prompt + max(lengths)
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(width)[None]
    total = torch.tensor(lengths)[:, None] + spread.prompt
    attn = pos < total
    resp = attn & (pos >= spread.prompt)
    ids = torch.where(attn, torch.randint(4, vocab_size, (spread.sequences, width), generator=g), 0)
    n = spread.sequences
    return TrainBatch(
        input_ids=ids, attention_mask=attn.long(), response_mask=resp,
        behaviour_logp=torch.where(resp, -torch.rand(n, width, generator=g) * 4, 0.0),
        rewards=torch.randint(0, 2, (n,), generator=g).float(),
        advantages=torch.randn(n, generator=g),
        group_ids=torch.arange(n) // spread.group)


def measure_packing(model_dir: str | Path, cfg, reps: int, warmup: int,
                    spread: Spread = SPREAD) -> dict[str, Any]:
    """Packed against padded on `model_dir` under TrainConfig `cfg`'s learner (its resolved
    token budget and threads), in a subprocess (module docstring)."""
    spec = {"model_dir": str(model_dir), "learner": cfg.rank_learner.model_dump(mode="json"),
            "kl": cfg.kl.model_dump(mode="json"),
            "advantage": cfg.advantage.model_dump(mode="json"), "reps": reps, "warmup": warmup,
            "spread": spread.__dict__, "seed": cfg.seed}
    with tempfile.TemporaryDirectory(prefix="klrl-bench-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        proc = subprocess.run([sys.executable, "-m", "cluster.bench.packing", str(spec_path),
                               str(out_path)], check=False, capture_output=True, text=True,
                              timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"packed against padded failed ({proc.returncode}):\n"
                               f"{proc.stderr[-4000:]}")
        return json.loads(out_path.read_text())


def interleaved(spec: dict) -> dict[str, Any]:
    """The measurement itself (in the subprocess, or in a test's process)."""
    import torch

    from kl.config import AdvantageConfig, KLConfig
    from learner import micro_batches
    from learner.config import DEFAULT_TOKEN_BUDGET, LearnerConfig
    from learner.loading import ModelFiles, load_causal_lm
    from learner.loss import PolicyLoss

    base = LearnerConfig(**spec["learner"])
    torch.set_num_threads(base.threads)
    torch.manual_seed(spec["seed"])
    files = ModelFiles(spec["model_dir"])
    policy = load_causal_lm(files.policy, files, base).train()
    ref = load_causal_lm(files.reference_path, files, base).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=base.lr)
    batch = spread_batch(policy.config.vocab_size, Spread(**spec["spread"]), spec["seed"])
    longest = int(batch.attention_mask.sum(-1).max())
    # The run's budget (the default's where none), at least the batch's longest sequence.
    budget = max(base.token_budget or DEFAULT_TOKEN_BUDGET, longest)
    layouts = {name: base.model_copy(update={"token_budget": budget, "packing": packed,
                                             "micro_batch_size": 0})
               for name, packed in (("padded", False), ("packed", True))}
    kl_cfg, adv_cfg = KLConfig(**spec["kl"]), AdvantageConfig(**spec["advantage"])
    device = torch.device("cpu")
    seconds: dict[str, list[float]] = {name: [] for name in layouts}
    losses = {name: PolicyLoss(kl_cfg, adv_cfg, cfg) for name, cfg in layouts.items()}

    def step(name: str) -> float:
        cfg = layouts[name]
        t0 = time.perf_counter()
        ref_logp = micro_batches.logprobs(ref, batch, cfg, device)
        micro_batches.accumulate(policy, batch, ref_logp, losses[name], batch.num_sequences,
                                 lambda loss, _logp: loss.backward(), device)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    for r in range(spec["warmup"] + spec["reps"]):
        order = list(layouts) if r % 2 == 0 else list(reversed(layouts))
        for name in order:
            s = step(name)
            if r >= spec["warmup"]:
                seconds[name].append(s)
    tokens = int(batch.attention_mask.sum())
    padded_tokens = sum(len(i) * int(batch.attention_mask[i].sum(-1).max())
                        for i in micro_batches.plan(batch, layouts["padded"]))
    ratios = [a / b for a, b in zip(seconds["padded"], seconds["packed"])]
    out: dict[str, Any] = {"sequences": batch.num_sequences, "tokens": tokens,
                           "padded_tokens": padded_tokens,
                           "padding_share": 1 - tokens / padded_tokens, "token_budget": budget,
                           "reps": spec["reps"]}
    for name, s in seconds.items():
        out[name] = {"seconds_median": statistics.median(s), "seconds_min": min(s),
                     "seconds_max": max(s),
                     "tokens_per_s": tokens / statistics.median(s)}
    out["speedup_median"] = statistics.median(ratios)
    out["speedup_min"], out["speedup_max"] = min(ratios), max(ratios)
    return out


if __name__ == "__main__":
    spec_file, out_file = sys.argv[1:3]
    Path(out_file).write_text(json.dumps(interleaved(json.loads(Path(spec_file).read_text()))))
