"""How a learner rank cuts a mini-batch into micro-batches, lays each out for the model's
forward, and accumulates their gradients into one optimizer step. Pure torch + transformers'
forward (no DeepSpeed): learner/rank.py runs it with its engine, the tests with a bare model.

Micro-batches (`plan`): consecutive rows of the mini-batch, as many as `learner.token_budget`
allows (the tokens the forward holds: with `learner.packing` the sum of the sequences' own
lengths, else rows x the micro-batch's padded width; cut at a prompt group's start where one
fits, sparing the extra forward of group statistics), or `learner.micro_batch_size` rows, or
the whole mini-batch. Every row is in exactly one micro-batch, in order; a sequence longer than
the budget (the config refuses a budget below the longest allowed sequence) forms its own.

Layout (`forward`): padded, the micro-batch's [b, L] rows as TrainBatch holds them; packed
(`Packed`), its sequences back to back in one row [1, T] (T = the sum of their lengths, no
padding) with position ids restarting at 0 per sequence and no attention mask, which is how
transformers is told to confine attention to each sequence: from position_ids it builds a
block-diagonal causal mask for sdpa and eager (masking_utils.find_packed_sequence_indices),
and flash_attention_2 calls flash-attn's varlen kernel with the sequences' cu_seqlens
(modeling_flash_attention_utils.prepare_fa_kwargs_from_position_ids; GPU-only, not exercised
by the CPU test-suite). The packed log-probs and entropies are put back into the padded
[b, L] layout before the loss, so packing is a layout of the forward only: the loss, its
metrics and its gradient are the padded step's (tests/test_packing.py), and every per-token
field of TrainBatch, present or added later, reaches the loss as it does unpacked.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from learner.batch import TrainBatch
from learner.config import LearnerConfig
from learner.loss import GroupStats, PolicyLoss, sequence_logprobs, token_entropy


def plan(batch: TrainBatch, cfg: LearnerConfig, passes: int | None = None
         ) -> list[torch.Tensor]:
    """The micro-batches of `batch`: row indices (long tensors), consecutive, covering every
    row once (module docstring). `passes`: at least this many (the largest micro-batches are
    halved until there are), so that every rank makes the same number of forward passes when
    the ranks' shards fall into different numbers under a token budget (ZeRO-3 gathers the
    parameters collectively in each forward)."""
    B = batch.num_sequences
    if not B:
        return []
    if cfg.token_budget:
        chunks = _within_budget(batch.attention_mask.sum(-1).tolist(), batch.group_ids.tolist(),
                                cfg.token_budget, cfg.packing)
    else:
        micro = cfg.micro_batch_size or B
        chunks = [torch.arange(s, min(B, s + micro)) for s in range(0, B, micro)]
    while passes is not None and len(chunks) < min(passes, B):
        k = max(range(len(chunks)), key=lambda j: len(chunks[j]))
        half = (len(chunks[k]) + 1) // 2
        chunks[k:k + 1] = [chunks[k][:half], chunks[k][half:]]
    return chunks


def _within_budget(lengths: list[int], groups: list[int], budget: int,
                   packed: bool) -> list[torch.Tensor]:
    """Consecutive rows while their cost (packed: the sum of lengths; padded: rows x the
    longest) stays within `budget`, at least one row each. A micro-batch that the budget
    ends inside a prompt group ends at the group's start instead, where one began inside it:
    a micro-batch of whole groups needs no extra forward for the group statistics."""
    chunks, start, B = [], 0, len(lengths)
    while start < B:
        end, total, widest = start + 1, lengths[start], lengths[start]
        while end < B:
            total, widest = total + lengths[end], max(widest, lengths[end])
            if (total if packed else (end + 1 - start) * widest) > budget:
                break
            end += 1
        if end < B and groups[end] == groups[end - 1]:
            starts = [j for j in range(start + 1, end) if groups[j] != groups[j - 1]]
            end = starts[-1] if starts else end
        chunks.append(torch.arange(start, end))
        start = end
    return chunks


@dataclass(frozen=True)
class Packed:
    """A micro-batch's sequences back to back in one row (module docstring).

    tokens: every per-token field of the TrainBatch ([B, L] there; None stays None) as [1, T],
        the real tokens of each row in order (attention_mask 1, a prefix of the row: TrainBatch
        is right-padded). position_ids [1, T]: 0, 1, ... within each sequence. real [B, L]
        bool: where each packed token sits in the padded layout (`unpack`)."""

    tokens: dict[str, torch.Tensor | None]
    position_ids: torch.Tensor
    real: torch.Tensor

    @classmethod
    def of(cls, batch: TrainBatch) -> Packed:
        real = batch.attention_mask.bool()
        lengths = real.sum(-1)
        if not bool((real == (torch.arange(batch.width, device=real.device) < lengths[:, None]))
                    .all()):
            raise ValueError("packing needs right-padded rows (attention_mask a prefix of each)")
        tokens = {f.name: (None if (t := getattr(batch, f.name)) is None else t[real][None])
                  for f in fields(batch) if _per_token(getattr(batch, f.name), batch)}
        starts = torch.cumsum(lengths, 0) - lengths
        flat = torch.arange(int(lengths.sum()), device=real.device)
        positions = flat - starts.repeat_interleave(lengths)
        return cls(tokens, positions[None], real)

    @property
    def input_ids(self) -> torch.Tensor:
        return self.tokens["input_ids"]

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """[1, T] -> [B, L], zeros at padding (differentiable in `packed`)."""
        return packed.new_zeros(self.real.shape).masked_scatter(self.real, packed[0])


def _per_token(t: torch.Tensor | None, batch: TrainBatch) -> bool:
    """Whether a TrainBatch field is per token ([B, L]); None fields travel as None."""
    return t is None or (t.dim() == 2 and tuple(t.shape) == tuple(batch.input_ids.shape))


def forward(model: Callable, mb: TrainBatch, *, packed: bool,
            entropy: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`mb`'s log-probs [b, L] under `model` (aligned with mb.input_ids, learner.loss
    `sequence_logprobs`), and with entropy=True/False its `token_entropy` (differentiable when
    True; None: not computed), through the padded or the packed layout."""
    if not packed:
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                       use_cache=False).logits
        logp = sequence_logprobs(logits, mb.input_ids)
        ent = None if entropy is None else token_entropy(logits, mb.response_mask, grad=entropy)
        return logp, ent
    p = Packed.of(mb)
    logits = model(input_ids=p.input_ids, position_ids=p.position_ids, use_cache=False).logits
    # At a sequence's first token the packed row predicts it from the previous sequence: that
    # value lands in column 0 of its row, which the padded layout holds at 0 (never a response).
    logp = torch.where(p.position_ids == 0, 0.0, sequence_logprobs(logits, p.input_ids))
    ent = (None if entropy is None
           else p.unpack(token_entropy(logits, p.tokens["response_mask"], grad=entropy)))
    return p.unpack(logp), ent


def _alone(values: list[int]) -> list[int]:
    return values


@torch.no_grad()
def logprobs(model: Callable, batch: TrainBatch, cfg: LearnerConfig, device: torch.device,
             progress: Callable[[], None] = lambda: None,
             agree: Callable[[list[int]], list[int]] = _alone) -> torch.Tensor:
    """[B, L] log-probs of `batch` under `model` (no grad), micro-batch by micro-batch.
    `agree`: the element-wise maximum of its argument over the ranks (a collective), so that
    every rank makes as many passes as the one with most; alone, the identity."""
    out = None  # fp32, or the model's dtype where wider (fp64 in the exact tests)
    (passes,) = agree([len(plan(batch, cfg))])
    for index in plan(batch, cfg, passes):
        mb = to_device(batch.select(index), device)
        lp, _ = forward(model, mb, packed=cfg.packing)
        if out is None:
            out = torch.zeros(batch.input_ids.shape, device=device,
                              dtype=torch.promote_types(lp.dtype, torch.float32))
        out[index.to(device), :mb.width] = lp
        progress()
    return out if out is not None else torch.zeros(batch.input_ids.shape, device=device)


def accumulate(model: Callable, mini: TrainBatch, ref_logp: torch.Tensor, loss: PolicyLoss,
               num_sequences: float, backward: Callable[[torch.Tensor, torch.Tensor], None],
               device: torch.device, progress: Callable[[], None] = lambda: None,
               agree: Callable[[list[int]], list[int]] = _alone) -> list[dict[str, float]]:
    """Forward, loss and `backward(loss, logp)` of every micro-batch of `mini` (whole prompt
    groups; `ref_logp` [B, L] its reference log-probs), the group statistics computed over
    whole groups first when a micro-batch cuts one; returns each micro-batch's metrics.
    `agree` as for `logprobs`: every rank makes the same passes (and the statistics' extra
    one where any rank needs it)."""
    cfg = loss.learner_cfg
    chunks = plan(mini, cfg)
    cuts = loss.needs_group_stats and _cuts_groups(mini.group_ids, chunks)
    passes, any_cuts = agree([len(chunks), int(cuts)])
    chunks = plan(mini, cfg, passes)
    stats: GroupStats | None = None  # None: each micro-batch holds whole groups
    if loss.needs_group_stats and any_cuts:
        # One extra no-grad forward: the group statistics of the current policy over whole
        # groups, which no micro-batch could compute alone (GroupStats invariant). Computed
        # where the chunks cut no group too when another rank needs the pass: the same
        # statistics, since whole groups give them alone.
        stats = loss.group_stats(logprobs(model, mini, cfg, device, progress, agree),
                                 ref_logp, to_device(mini, device))
    parts = []
    for index in chunks:  # `agree`: the same number of passes on every rank
        mb = to_device(mini.select(index), device)
        # The entropy from the same logits (no extra forward); differentiated only for a bonus.
        logp, entropy = forward(model, mb, packed=cfg.packing, entropy=cfg.entropy_coef > 0)
        value, metrics = loss(logp, ref_logp[index, :mb.width], mb, num_sequences,
                              stats.rows(index.to(device), mb.width) if stats else None,
                              entropy=entropy)
        backward(value, logp)
        progress()
        parts.append(metrics)
    return parts


def _cuts_groups(group_ids: torch.Tensor, chunks: list[torch.Tensor]) -> bool:
    """Whether some prompt group has samples in two of `chunks` (micro-batch row indices)."""
    seen: set[int] = set()
    for index in chunks:
        ids = set(group_ids[index].tolist())
        if ids & seen:
            return True
        seen |= ids
    return False


def to_device(batch: TrainBatch, device: torch.device) -> TrainBatch:
    return batch if device.type == "cpu" else batch.to(device)
