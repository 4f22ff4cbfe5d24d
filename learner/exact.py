"""The trainer's loss in exact expectation: `learner.loss.policy_loss` summed over every group
of n sequences of the enumerable toy (kl.toy), each group weighted by its probability under
the sampler mu.

A group of n samples of one prompt is n independent draws from mu, so over a toy of S
sequences there are S^n groups, each with probability prod_j mu(y_j). The expected gradient
of the trainer's loss is a finite sum over them: one call of `policy_loss` on a batch that
holds every group (the group statistics are per group, so groups do not interact), one
backward to the per-token log-probs, and the chain rule through the toy's logits table.
Nothing is sampled: the numbers are exact up to float64 rounding. `klrl kl-table` and the
tests compare these expectations with what docs/kl.md says each configuration computes
(learner/exact_table.py).

The batch is what the trainer sees: a one-token prompt then the response, right-padded;
`advantages` are the controller's task advantages (kl.compute_advantages over the rewards,
as cluster/train/batching.py computes them); `behaviour_logp` the sampler's log-probs.

With a `kl.toy.MixedSampler` (a weight update landing mid-sequence) the groups are enumerated
once per branch (when the update lands, shared by a group), each weighted by the branch's
probability, and every token's behaviour log-prob is the one of the row that drew it.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import torch

import kl
from kl import toy as T
from kl.config import AdvantageConfig, KLConfig
from learner.batch import TrainBatch
from learner.config import LearnerConfig
from learner.loss import group_stats, policy_loss


@dataclass(frozen=True)
class Groups:
    """Every group of n sequences of a toy, as one TrainBatch of S^n x n rows.

    seqs [G, n]: the toy sequence of each member; weight [G]: the group's probability under
    mu; rows [G*n]: the toy sequence of each batch row (= seqs.flatten()); branch [G]: the
    sampler's branch each group was drawn in (kl.toy.MixedSampler; all 0 with one sampler)."""

    toy: T.ToyProblem
    n: int
    seqs: torch.Tensor
    weight: torch.Tensor
    rows: torch.Tensor
    batch: TrainBatch
    branch: torch.Tensor

    def with_task_advantages(self, adv_cfg: AdvantageConfig) -> Groups:
        """The batch with the controller's task advantages of `adv_cfg`."""
        b = self.batch
        adv = kl.compute_advantages(b.rewards, b.group_ids, estimator=adv_cfg.estimator,
                                    normalize=adv_cfg.normalize, eps=adv_cfg.eps)
        return replace(self, batch=replace(b, advantages=adv))

    def relabelled(self, logits: torch.Tensor) -> Groups:
        """The same groups (same probabilities) with every token's behaviour log-prob read from
        one table `logits` instead of the row that drew it: what a trainer records when it
        takes one version's log-probs for a whole sequence."""
        lp = _aligned(T.token_logp(logits, self.toy.space), self.rows)
        return replace(self, batch=replace(self.batch, behaviour_logp=lp))


def enumerate_groups(toy: T.ToyProblem, n: int, reward: torch.Tensor,
                     sampler: T.MixedSampler | None = None) -> Groups:
    """All S^n groups of n toy sequences with task rewards `reward` [S] (float64), once per
    branch of `sampler` (None: toy.behaviour_logits draws every token)."""
    sp = toy.space
    S = sp.tokens.shape[0]
    if sampler is None:
        sampler = T.MixedSampler.single(toy.behaviour_logits)
    J = sampler.num_branches
    if n < 1 or J * S ** n > 200_000:
        raise ValueError(f"{J} x {S}^{n} groups is too many to enumerate (use a smaller toy)")
    one = torch.tensor(list(itertools.product(range(S), repeat=n)),
                       dtype=torch.long).reshape(-1, n)
    seqs = one.repeat(J, 1)
    branch = torch.arange(J).repeat_interleave(one.shape[0])
    # With an environment (toy.env), its turns are drawn from its own table in every branch.
    tables = [toy.world(t) for t in sampler.tables]
    mu_seq = torch.stack([T.sequence_prob(t, sp) for t in tables])  # [J, S]
    weight = sampler.weights[branch] * mu_seq[branch[:, None], seqs].prod(-1)
    rows = seqs.reshape(-1)
    B = rows.shape[0]
    # Each row's behaviour log-probs from its own branch's table: the row that drew each token.
    behaviour = torch.stack([T.token_logp(t, sp) for t in tables])  # [J, S, T]
    row_logp = behaviour[branch.repeat_interleave(n), rows]

    def pad(x, v):  # the one-token prompt in front
        return torch.cat([torch.full((B, 1), v, dtype=x.dtype), x], dim=1)

    # The response mask holds the policy's tokens: environment answers are attended, never
    # trained on (what a multi-turn trainer must do with them: tests/test_kl_multi_turn.py).
    mask = pad(toy.policy_mask[rows], False)
    batch = TrainBatch(
        input_ids=pad(sp.tokens[rows], 0),
        attention_mask=pad(sp.mask[rows].long(), 1),
        response_mask=mask,
        behaviour_logp=_aligned(row_logp, torch.arange(B)),
        rewards=reward.to(torch.float64)[rows],
        advantages=torch.zeros(B, dtype=torch.float64),
        group_ids=torch.arange(seqs.shape[0]).repeat_interleave(n),
    )
    return Groups(toy, n, seqs, weight, rows, batch, branch)


def _aligned(token_logp: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[S, T] toy log-probs -> [B, 1+T] batch log-probs (column 0: the prompt token)."""
    lp = token_logp[rows]
    return torch.cat([torch.zeros(lp.shape[0], 1, dtype=lp.dtype), lp], dim=1)


def expected_grad(groups: Groups, kl_cfg: KLConfig, adv_cfg: AdvantageConfig,
                  learner_cfg: LearnerConfig) -> torch.Tensor:
    """E_mu[grad of the trainer's loss on one group] w.r.t. the policy logits, flattened; the
    loss is policy_loss with N = n (one prompt's batch), the task advantages `groups` holds
    (see `Groups.with_task_advantages`)."""
    c = loss_coefficients(groups, kl_cfg, adv_cfg, learner_cfg)
    return chain_to_logits(groups, (c * groups.weight.repeat_interleave(groups.n)[:, None]))


def loss_coefficients(groups: Groups, kl_cfg, adv_cfg, learner_cfg) -> torch.Tensor:
    """d loss / d logp of every batch row and response position: [G*n, T]."""
    toy, b = groups.toy, groups.batch
    lp = _aligned(T.token_logp(toy.logits, toy.space), groups.rows).requires_grad_(True)
    ref = _aligned(T.token_logp(toy.ref_logits, toy.space), groups.rows)
    loss, _ = policy_loss(lp, ref, b, kl_cfg, adv_cfg, learner_cfg, float(groups.n))
    (c,) = torch.autograd.grad(loss, lp)
    return c[:, 1:]


def chain_to_logits(groups: Groups, c: torch.Tensor) -> torch.Tensor:
    """sum over rows and positions of c[i, t] * d logp(y_t | s_t) / d logits, flattened."""
    sp, toy = groups.toy.space, groups.toy
    per_seq = torch.zeros(sp.tokens.shape, dtype=c.dtype).index_add_(0, groups.rows, c)
    probs = torch.softmax(toy.logits, -1)
    onehot = torch.nn.functional.one_hot(sp.tokens, sp.vocab).to(c.dtype)
    d = (onehot - probs[sp.rows]) * (per_seq * sp.mask)[..., None]  # [S, T, V]
    g = torch.zeros(sp.num_rows, sp.vocab, dtype=c.dtype)
    g.index_put_((sp.rows,), d, accumulate=True)
    return g.flatten()


def per_group_grads(groups: Groups, kl_cfg, adv_cfg, learner_cfg) -> torch.Tensor:
    """The gradient of each group's loss w.r.t. the logits: [G, rows * vocab] (for variances)."""
    sp, toy = groups.toy.space, groups.toy
    c = loss_coefficients(groups, kl_cfg, adv_cfg, learner_cfg)  # [G*n, T]
    probs = torch.softmax(toy.logits, -1)
    seq_rows = sp.rows[groups.rows]                                # [G*n, T]
    onehot = torch.nn.functional.one_hot(sp.tokens[groups.rows], sp.vocab).to(c.dtype)
    d = (onehot - probs[seq_rows]) * (c * sp.mask[groups.rows])[..., None]
    G = groups.seqs.shape[0]
    flat = seq_rows * sp.vocab                                      # [G*n, T] -> logit index
    idx = (flat[..., None] + torch.arange(sp.vocab)).reshape(G, -1)
    out = torch.zeros(G, sp.num_rows * sp.vocab, dtype=c.dtype)
    return out.scatter_add_(1, idx, d.reshape(G, -1))


def folded_advantages(groups: Groups, kl_cfg: KLConfig,
                      adv_cfg: AdvantageConfig) -> torch.Tensor | None:
    """The per-token advantages the loss uses when the KL reward is folded in, [G*n, 1+T]."""
    toy = groups.toy
    lp = _aligned(T.token_logp(toy.logits, toy.space), groups.rows)
    ref = _aligned(T.token_logp(toy.ref_logits, toy.space), groups.rows)
    return group_stats(lp, ref, groups.batch, kl_cfg, adv_cfg).token_advantages
