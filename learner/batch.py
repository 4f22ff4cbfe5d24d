"""`TrainBatch`: the padded tensors the learner trains on.

Only tensors and tensor-level operations (select, shard) live here: cluster/train/batching.py builds
a TrainBatch from the actors' `Rollout` records, since learner/ may import only kl/.

Alignment convention (the one every log-prob tensor in learner/ follows):
    logp[:, t] = log p(input_ids[:, t] | input_ids[:, <t])
so a per-token quantity lives at the position of the token it scores, and
`response_mask[:, t]` is True iff input_ids[:, t] is a response token. Position 0 is never a
response token (a prompt has at least one token), so logp[:, 0] is never needed.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass(frozen=True)
class TrainBatch:
    """B sequences (prompt + response, right-padded to length L) and their per-sequence data.

    input_ids [B, L] long; attention_mask [B, L] long (1 on real tokens); response_mask [B, L]
    bool; behaviour_logp [B, L] float32 (sampler log-prob of each response token, 0 elsewhere);
    rewards [B] float32 (task rewards); advantages [B] float32 (task advantages, computed over
    the whole global batch by the controller); group_ids [B] long (samples of one prompt share
    it); token_lags [B, L] long or None (how many versions each response
    token's sampler lags the weights this batch trains, 0 elsewhere; None where nobody said:
    the tokens sampled by the learner's own weights, `is/abs_log_ratio_fresh_token_mean`, are
    then not told apart).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    behaviour_logp: torch.Tensor
    rewards: torch.Tensor
    advantages: torch.Tensor
    group_ids: torch.Tensor
    token_lags: torch.Tensor | None = None

    def __post_init__(self):
        B, L = self.input_ids.shape
        for f in ("attention_mask", "response_mask", "behaviour_logp", "token_lags"):
            if getattr(self, f) is None:
                continue
            if (shape := tuple(getattr(self, f).shape)) != (B, L):
                raise ValueError(f"TrainBatch.{f} shape {shape} != {(B, L)}")
        for f in ("rewards", "advantages", "group_ids"):
            if (shape := tuple(getattr(self, f).shape)) != (B,):
                raise ValueError(f"TrainBatch.{f} shape {shape} != {(B,)}")
        if self.response_mask.dtype != torch.bool:
            raise ValueError("TrainBatch.response_mask must be bool")
        if B and bool(self.response_mask[:, 0].any()):
            raise ValueError("response_mask[:, 0] must be False: every sequence needs a prompt "
                             "token")
        if bool((self.response_mask & (self.attention_mask == 0)).any()):
            raise ValueError("response tokens must be attended (response_mask implies "
                             "attention_mask)")

    @property
    def num_sequences(self) -> int:
        return self.input_ids.shape[0]

    @property
    def width(self) -> int:
        """L: token columns (prompt + response, padded)."""
        return self.input_ids.shape[1]

    def to(self, device: torch.device | str) -> TrainBatch:
        """The same batch with every tensor on `device` (token_lags stays None if it is)."""
        return TrainBatch(**{f.name: None if (t := getattr(self, f.name)) is None
                             else t.to(device) for f in fields(self)})

    def select(self, index: torch.Tensor) -> TrainBatch:
        """Rows `index` (a long tensor), with padding columns beyond the longest kept sequence
        trimmed (the loss sums over tokens, so padding never changes it)."""
        width = int(self.attention_mask[index].sum(-1).max().item()) if len(index) else 0
        width = max(width, 1)
        out = {}
        for f in fields(self):
            t = getattr(self, f.name)
            if t is not None:
                t = t[index]
                t = t[:, :width] if t.dim() == 2 else t
            out[f.name] = t
        return TrainBatch(**out)

    def shard(self, rank: int, world_size: int) -> TrainBatch:
        """The rank's share: whole prompt groups, the same number of sequences on every rank.

        Invariant (enforced): a group is never split across ranks, because the KL baseline
        (leave-one-out over the group) and kl_in_advantage=normalized need all of a group's
        samples; and every rank gets B / world_size sequences, because DeepSpeed averages the
        ranks' gradients with equal weights (see learner/rank.py). Groups are cut in order of
        first appearance into consecutive shards when possible, else packed largest first; a
        batch whose groups cannot be packed into equal shards is an error.
        """
        return self.select(self.shard_indices(rank, world_size))

    def shard_indices(self, rank: int, world_size: int) -> torch.Tensor:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} not in [0, {world_size})")
        B = self.num_sequences
        if B % world_size:
            raise ValueError(f"cannot shard {B} sequences over {world_size} learner ranks equally; "
                             f"the global batch size must be a multiple of learner.num_ranks")
        target = B // world_size
        order: list[int] = []                    # group ids in order of first appearance
        members: dict[int, list[int]] = {}
        for i, g in enumerate(self.group_ids.tolist()):
            if g not in members:
                order.append(g)
                members[g] = []
            members[g].append(i)
        shards = _contiguous(order, members, target) or _first_fit_decreasing(
            order, members, target, world_size)
        if shards is None:
            sizes = [len(members[g]) for g in order]
            raise ValueError(f"cannot cut prompt groups of sizes {sizes} into {world_size} "
                             f"shards of {target} sequences without splitting a group")
        return torch.tensor(sorted(shards[rank]), dtype=torch.long)


def _contiguous(order, members, target) -> list[list[int]] | None:
    """Groups in order, cut into consecutive shards of exactly `target` sequences."""
    shards: list[list[int]] = [[]]
    for g in order:
        if len(shards[-1]) == target:
            shards.append([])
        shards[-1].extend(members[g])
        if len(shards[-1]) > target:
            return None
    return shards


def _first_fit_decreasing(order, members, target, world_size) -> list[list[int]] | None:
    """Unequal group sizes: largest group first into the first shard with room (deterministic)."""
    shards: list[list[int]] = [[] for _ in range(world_size)]
    for g in sorted(order, key=lambda g: -len(members[g])):  # stable: ties keep first appearance
        for s in shards:
            if len(s) + len(members[g]) <= target:
                s.extend(members[g])
                break
        else:
            return None
    return shards if all(len(s) == target for s in shards) else None

