"""A tabular autoregressive toy policy whose sequence space can be enumerated exactly.

Used by the exact tests and by `klrl kl-table`. Every non-terminated prefix s (length < T) has
its own row of logits; token 0 is EOS when `eos=True`, giving variable-length sequences (the
padding positions after EOS are masked out). With vocab 3 and length 4 there are 31 sequences
with EOS and 81 without. Because the enumeration is exhaustive, an expectation under any
policy is a finite weighted sum, and sampling a sequence is sampling its index.

`MixedSampler` is a sampler that changes while a sequence is generated (a weight update landing
mid-generation): each token is drawn by the table row of its own prefix, from one of several
tables, and that row's log-prob is the token's behaviour log-prob.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

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
                space: SequenceSpace, env: Environment | None = None) -> torch.Tensor:
    """Exact KL(pi || pi_ref) over whole sequences (differentiable in `logits`); with `env`,
    over trajectories, whose environment factors cancel: E_{P_pi}[sum over policy tokens of
    log pi - log ref], P_pi drawing the environment's tokens from its own table."""
    lp, ref = token_logp(logits, space), token_logp(ref_logits, space)
    if env is None:
        return (lp.sum(-1).exp() * (lp - ref).sum(-1)).sum()
    prob = token_logp(env.world(logits), space).sum(-1).exp()
    return (prob * ((lp - ref) * env.policy_mask(space)).sum(-1)).sum()


def token_kl(logits, ref_logits, space, direction: str,
             env: Environment | None = None) -> torch.Tensor:
    """Token-level KL summed over states with the state distribution held fixed (sg):
    sum_s sg(p_pi(s)) * KL(pi(.|s) || ref(.|s)) for "reverse", KL(ref(.|s) || pi(.|s)) for
    "forward"; with `env`, over the policy's states only, reached under the world's table.
    Its gradient is the 'token-level' KL gradient of docs/design.md's table."""
    lp, lr = torch.log_softmax(logits, -1), torch.log_softmax(ref_logits, -1)
    if direction == "reverse":
        per_state = (lp.exp() * (lp - lr)).sum(-1)
    elif direction == "forward":
        per_state = (lr.exp() * (lr - lp)).sum(-1)
    else:
        raise ValueError(direction)
    if env is None:
        return (prefix_prob(logits, space).detach() * per_state).sum()
    reach = prefix_prob(env.world(logits), space).detach()
    return (torch.where(env.rows, 0.0, reach) * per_state).sum()


def grad_of(fn, logits: torch.Tensor) -> torch.Tensor:
    """Gradient of a scalar function of the logits table, flattened."""
    x = logits.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(fn(x), x)
    return g.flatten()


@dataclass(frozen=True)
class Environment:
    """A multi-turn toy's environment: at the prefix states `rows` (bool [num_rows]) the next
    token is the environment's answer, drawn from its own fixed table `logits` ([num_rows,
    vocab]; rows outside `rows` unused), whatever the policy, the reference or the sampler say
    there. An answer may be EOS: the environment ends the episode.

    A trajectory's probability under policy x is then prod over policy positions of x and over
    environment positions of the environment's table (`world`): the environment factors are
    the same under the policy, the reference and the sampler, so they cancel from every ratio
    and from KL(P_pi || P_ref), which is a sum over policy tokens only. A trainer that lets
    environment tokens into its log-ratios, KL sums or importance products computes something
    else (tests/test_kl_multi_turn.py)."""

    rows: torch.Tensor
    logits: torch.Tensor

    @classmethod
    def at_positions(cls, space: SequenceSpace, positions: Sequence[int], seed: int = 1,
                     scale: float = 1.0) -> Environment:
        """An environment answering at every prefix of a length in `positions` (the turn
        structure: e.g. {1}: policy, environment, policy), with seeded random answer logits."""
        rows = torch.tensor([len(p) in set(positions) for p in space.prefixes])
        g = torch.Generator().manual_seed(seed)
        logits = scale * torch.randn(space.num_rows, space.vocab, generator=g,
                                     dtype=torch.float64)
        return cls(rows, logits)

    def world(self, table: torch.Tensor) -> torch.Tensor:
        """The per-state table trajectories are drawn from when the policy's turns follow
        `table`: the environment's rows replaced by its own."""
        return torch.where(self.rows[:, None], self.logits.to(table.dtype), table)

    def policy_mask(self, space: SequenceSpace) -> torch.Tensor:
        """[N, T]: the positions the policy sampled (real tokens, not the environment's)."""
        return space.mask & ~self.rows[space.rows]


@dataclass(frozen=True)
class ToyProblem:
    """Policy, reference and behaviour logits on one sequence space (float64); with `env`, a
    multi-turn toy whose environment answers at some states (`Environment`)."""

    space: SequenceSpace
    logits: torch.Tensor
    ref_logits: torch.Tensor
    behaviour_logits: torch.Tensor
    env: Environment | None = None

    def world(self, table: torch.Tensor) -> torch.Tensor:
        """`table` with the environment's rows (itself without an environment)."""
        return table if self.env is None else self.env.world(table)

    @property
    def policy_mask(self) -> torch.Tensor:
        """[N, T]: the positions the policy sampled (every real token without an environment)."""
        return self.space.mask if self.env is None else self.env.policy_mask(self.space)

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


def composite_logits(space: SequenceSpace, tables: Sequence[torch.Tensor],
                     version_of: Callable[[tuple[int, ...]], int]) -> torch.Tensor:
    """The per-state sampler of a sequence whose tokens come from several samplers: row s (a
    prefix) is row s of tables[version_of(s)]. version_of sees the prefix only, never the token
    drawn there: that is what makes the switch predictable (docs/kl.md, Sequences sampled by
    several policy versions)."""
    out = torch.empty_like(tables[0])
    for i, prefix in enumerate(space.prefixes):
        out[i] = tables[version_of(prefix)][i]
    return out


def stale_kv_logits(space: SequenceSpace, before: torch.Tensor, after: torch.Tensor, k: int,
                    cache_error: torch.Tensor) -> torch.Tensor:
    """The sampler of a sequence whose weights change from `before` to `after` at position k
    while the KV cache of the first k positions is kept ("new weights over old cache"). A toy
    of it: at a state of t >= k tokens, the new logits moved toward the old ones, plus a fixed
    error `cache_error` [rows, vocab], by the share k / (t + 1) of the attended positions whose
    keys and values the old weights computed. It is neither table, nor any mix of the two."""
    def stale(i: int, t: int) -> torch.Tensor:
        share = k / (t + 1)
        return after[i] + share * (before[i] - after[i] + cache_error[i])

    return torch.stack([before[i] if len(p) < k else stale(i, len(p))
                        for i, p in enumerate(space.prefixes)])


@dataclass(frozen=True)
class MixedSampler:
    """How the sequences of a toy were sampled when the sampler may change mid-sequence.

    Branch j, with probability weights[j], is one outcome of what decides the change without
    looking at the tokens (when the update lands); in branch j the token at prefix state s is
    drawn from row s of tables[j] ([J, rows, vocab] logits) and recorded with that row's
    log-prob. A group of samples of one prompt shares its branch (its requests see the update
    at the same engine step). A row depends on the prefix and the branch only, so every switch
    a MixedSampler describes is predictable."""

    weights: torch.Tensor
    tables: torch.Tensor

    def __post_init__(self):
        if self.tables.dim() != 3 or self.weights.shape != self.tables.shape[:1]:
            raise ValueError(f"weights {tuple(self.weights.shape)} / tables "
                             f"{tuple(self.tables.shape)}: need [J] and [J, rows, vocab]")
        if bool((self.weights < 0).any()) or abs(float(self.weights.sum()) - 1.0) > 1e-12:
            raise ValueError("branch weights must be >= 0 and sum to 1")

    @classmethod
    def single(cls, logits: torch.Tensor) -> MixedSampler:
        """One sampler for every token (no switch)."""
        return cls(torch.ones(1, dtype=logits.dtype), logits[None])

    @property
    def num_branches(self) -> int:
        return self.weights.shape[0]

    def branch(self, toy: ToyProblem, j: int) -> ToyProblem:
        """The toy whose behaviour policy is branch j's sampler."""
        return replace(toy, behaviour_logits=self.tables[j])

    def sequence_prob(self, space: SequenceSpace) -> torch.Tensor:
        """The probability of each sequence over all branches: [N]; sums to 1."""
        return sum(w * sequence_prob(t, space) for w, t in zip(self.weights, self.tables))


def switch_sampler(space: SequenceSpace, before: torch.Tensor, after: torch.Tensor,
                   switch_probs: Mapping[int, float],
                   cache_error: torch.Tensor | None = None) -> MixedSampler:
    """Tokens at positions < k drawn by `before`, from k on by `after`, where the switch
    position k is random (probability switch_probs[k]; k = 0: the whole sequence is after's,
    k >= length: it never switches). cache_error None: the prefix is recomputed with the new
    weights at the switch, so each token is drawn by exactly one of the two; a table: the old
    cache is kept (`stale_kv_logits`)."""
    def table(k: int) -> torch.Tensor:
        if cache_error is None:
            return composite_logits(space, (before, after), lambda p: int(len(p) >= k))
        return stale_kv_logits(space, before, after, k, cache_error)

    ks = sorted(switch_probs)
    return MixedSampler(torch.tensor([switch_probs[k] for k in ks], dtype=before.dtype),
                        torch.stack([table(k) for k in ks]))
