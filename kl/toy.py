"""A tabular autoregressive toy policy whose sequence space can be enumerated exactly.

Used by the exact tests and by `klrl kl-table`. Every non-terminated prefix s (length < T) has
its own row of logits; token 0 is EOS when `eos=True`, giving variable-length sequences (the
padding positions after EOS are masked out). With vocab 3 and length 4 there are 31 sequences
with EOS and 81 without. Because the enumeration is exhaustive, an expectation under any
policy is a finite weighted sum, and sampling a sequence is sampling its index.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

EOS = 0


@dataclass(frozen=True)
class SequenceSpace:
    """All sequences of a toy: tokens [N, T] (0-padded), mask [N, T], state rows [N, T]."""

    tokens: torch.Tensor
    mask: torch.Tensor
    rows: torch.Tensor  # rows[n, t] = index of prefix s_t in the logits table
    prefixes: tuple[tuple[int, ...], ...]  # row index -> prefix tokens
    vocab: int
    length: int

    @property
    def num_rows(self) -> int:
        return len(self.prefixes)


def sequence_space(vocab: int = 3, length: int = 4, eos: bool = True) -> SequenceSpace:
    """Enumerate every sequence of at most `length` tokens (EOS ends a sequence when eos)."""
    if vocab < 2 or length < 1:
        raise ValueError("need vocab >= 2 and length >= 1")
    non_eos = list(range(1, vocab)) if eos else list(range(vocab))
    prefixes = [p for t in range(length) for p in itertools.product(non_eos, repeat=t)]
    row_of = {p: i for i, p in enumerate(prefixes)}
    seqs: list[tuple[int, ...]] = []
    for t in range(1, length + 1):
        seqs += [p + (EOS,) for p in itertools.product(non_eos, repeat=t - 1)] if eos else []
    seqs += list(itertools.product(non_eos, repeat=length))
    tokens = torch.zeros(len(seqs), length, dtype=torch.long)
    mask = torch.zeros(len(seqs), length, dtype=torch.bool)
    rows = torch.zeros(len(seqs), length, dtype=torch.long)
    for n, seq in enumerate(seqs):
        for t, y in enumerate(seq):
            tokens[n, t], mask[n, t], rows[n, t] = y, True, row_of[seq[:t]]
    return SequenceSpace(tokens, mask, rows, tuple(prefixes), vocab, length)


def token_logp(logits: torch.Tensor, space: SequenceSpace) -> torch.Tensor:
    """log pi(y_t | s_t) for every sequence and position: [N, T], 0 where masked."""
    table = torch.log_softmax(logits, dim=-1)  # [rows, vocab]
    lp = table[space.rows, space.tokens]
    return torch.where(space.mask, lp, torch.zeros((), dtype=lp.dtype))


def sequence_prob(logits: torch.Tensor, space: SequenceSpace) -> torch.Tensor:
    """pi(y) for every enumerated sequence: [N]; sums to 1."""
    return token_logp(logits, space).sum(-1).exp()


def prefix_prob(logits: torch.Tensor, space: SequenceSpace) -> torch.Tensor:
    """Probability of reaching each prefix state (each table row) under the policy: [rows]."""
    table = torch.log_softmax(logits, dim=-1)
    row_of = {p: i for i, p in enumerate(space.prefixes)}
    out = []
    for p in space.prefixes:
        lp = sum((table[row_of[p[:t]], p[t]] for t in range(len(p))),
                 torch.zeros((), dtype=table.dtype))
        out.append(lp.exp())
    return torch.stack(out)


def sequence_kl(logits: torch.Tensor, ref_logits: torch.Tensor,
                space: SequenceSpace) -> torch.Tensor:
    """Exact KL(pi || pi_ref) over whole sequences (differentiable in `logits`)."""
    lp, ref = token_logp(logits, space), token_logp(ref_logits, space)
    return (lp.sum(-1).exp() * (lp - ref).sum(-1)).sum()


def token_kl(logits, ref_logits, space, direction: str) -> torch.Tensor:
    """Token-level KL summed over states with the state distribution held fixed (sg):
    sum_s sg(p_pi(s)) * KL(pi(.|s) || ref(.|s)) for "reverse", KL(ref(.|s) || pi(.|s)) for
    "forward".
    Its gradient is the 'token-level' KL gradient of docs/design.md's table."""
    lp, lr = torch.log_softmax(logits, -1), torch.log_softmax(ref_logits, -1)
    if direction == "reverse":
        per_state = (lp.exp() * (lp - lr)).sum(-1)
    elif direction == "forward":
        per_state = (lr.exp() * (lr - lp)).sum(-1)
    else:
        raise ValueError(direction)
    return (prefix_prob(logits, space).detach() * per_state).sum()


def grad_of(fn, logits: torch.Tensor) -> torch.Tensor:
    """Gradient of a scalar function of the logits table, flattened."""
    x = logits.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(fn(x), x)
    return g.flatten()


@dataclass(frozen=True)
class ToyProblem:
    """Policy, reference and behaviour logits on one sequence space (float64)."""

    space: SequenceSpace
    logits: torch.Tensor
    ref_logits: torch.Tensor
    behaviour_logits: torch.Tensor

    @classmethod
    def make(cls, vocab=3, length=4, eos=True, seed=0, ref_scale=1.0, lag=0.0, drift=0.15):
        """Seeded toy. pi and pi_ref have random logits (ref = pi + ref_scale * noise). The
        behaviour policy mu is pi moved by lag * drift along a fixed random direction of the
        logits: a proxy for mu being `lag` updates old. The same seed gives the same pi, ref
        and direction for every lag, so a lag sweep varies mu alone."""
        space = sequence_space(vocab, length, eos)
        g = torch.Generator().manual_seed(seed)
        shape = (space.num_rows, vocab)
        logits = torch.randn(shape, generator=g, dtype=torch.float64)
        ref = logits + ref_scale * torch.randn(shape, generator=g, dtype=torch.float64)
        direction = torch.randn(shape, generator=g, dtype=torch.float64)
        return cls(space, logits, ref, logits + lag * drift * direction)
