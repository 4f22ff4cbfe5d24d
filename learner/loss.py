"""The learner's loss: task policy-gradient term + beta x KL term (+ an entropy bonus). What it
logs, and how that merges over micro-batches, ranks and updates, is learner.loss_metrics.

Pure torch + kl (no DeepSpeed), so it is unit-tested without any engine. Notation: per
response token t of sequence i, logp_t (current policy, live), mu_t (behaviour = sampler
log-prob), rho_t = exp(logp_t - mu_t), A_i the task advantage from the controller (computed
globally with kl.compute_advantages), sg() stop-gradient, N = num_sequences_global.

Task term (learner.task_off_policy, one learner.task_terms.TASK_TERMS entry each, whose module
docstring has the formulas: none, tis, ppo_clip and the masks icepop, mis, seq_mask_geo,
seq_mask_prod), summed over response tokens, divided by N. On-policy (mu = pi) every entry has
the gradient -A_i grad logp_t. The masks act on the task term only: the KL term below never
sees them (a KL reward folded into A_{i,t} is masked with its token, being part of A).

KL term (kl.KLConfig, beta = kl.beta):
  * kl_in_advantage = "separate", or placement = "loss":
        beta * sum_i kl.surrogate(logp, ref_logp, mask, estimator, placement, importance,
                                  behaviour_logp, truncate, baseline=b_i)_i / N
    with b_i = kl.kl_baseline(seq_kl, group_ids, advantage.estimator) for placements with
    a reward part (seq_kl_i = sum_t k_t with the detached current-policy estimates; the
    leave-one-out mean for rloo, grpo and drgrpo alike; "reinforce" gives no baseline). This
    is exactly beta x the gradient contract of kl.surrogate, whatever the task rewards and
    the task estimator are (proved over every group of 2 and 3 toy sequences by
    learner/exact_table.py, `klrl kl-table`).
  * kl_in_advantage != "separate" with placement "reward": the KL reward is folded into
    per-token advantages A_{i,t} = kl.compute_advantages(rewards, group_ids, kl_tokens=sg(k),
    mask, beta, kl_in_advantage) which replace A_i in the task term (and get its off-policy
    handling); loss/task then includes the folded KL reward and loss/kl is 0. kl.KLConfig and
    kl.config.check_compatible reject the combinations this could not honour (reward+loss,
    kl.importance, advantage.normalize=batch).

Entropy bonus (learner.entropy_coef = c >= 0). H_{i,t} = -sum_v pi(v|s_{i,t}) log pi(v|s_{i,t}),
the full-vocabulary entropy of the current policy at the state s_{i,t} = (prompt, y_{i,<t}) of
response token t, from the logits the forward pass already made, in fp32 (`token_entropy`).
The loss gets
    -c * sum_i sum_t H_{i,t} / N
(the same constant N, so it splits over micro-batches and ranks like the other terms), whose
exact gradient is
    -(c/N) sum_i sum_t grad H_{i,t},  dH_{i,t}/dz_v = -pi_v (log pi_v + H_{i,t})
for the logits z of position t: the gradient of the per-token entropies at the *sampled*
prefixes, which are held fixed. It is not an estimator of the gradient of the sequence entropy
H(pi(.|x)) = E_{y~pi}[sum_t H_t(y_<t)]: that gradient also has the score-function term
E[sum_t grad log pi(y_t|s_t) * sum_{t'>t} H_t'] (how the policy moves which prefixes occur),
which the bonus leaves out, and the prefixes come from the sampler mu, not reweighted toward
pi. c = 0 adds nothing; the metric `policy/entropy` (mean H over response tokens, merged
token-weighted) is logged whenever the caller passes `entropy`.

Group statistics (b_i, A_{i,t}) need every sample of a prompt. They are computed by
`PolicyLoss.group_stats` once over whole groups and handed to the loss (GroupStats), so a
micro-batch that cuts a group anywhere gets exactly the whole batch's gradient share.

Normalisation invariant: both terms are sums over tokens divided by the constant N, never by a
sequence's own length (that would reweight sequences by 1/|y| and bias the gradient), so
padding never changes the loss and a batch split into shards/micro-batches, each with the
same N, has losses (and gradients) that add up to the whole batch's.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

import kl
from kl.advantage import ADVANTAGE_ESTIMATORS
from kl.config import AdvantageConfig, KLConfig, check_compatible
from kl.registry import lookup
from kl.surrogate import PLACEMENT_FORMS
from learner.batch import TrainBatch
from learner.config import LearnerConfig
from learner.loss_metrics import step_metrics
from learner.task_terms import TASK_TERMS


def sequence_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """[B, L] log-probs aligned with input_ids: out[:, t] = log p(ids[:, t] | ids[:, <t]);
    out[:, 0] = 0 (no prediction for the first token). fp32 at least (fp64 logits stay fp64)."""
    logits = logits[:, :-1].to(torch.promote_types(logits.dtype, torch.float32))
    target = input_ids[:, 1:].unsqueeze(-1)
    # gather - logsumexp: the same value as log_softmax().gather() without a second [B, L, V] tensor
    lp = logits.gather(-1, target).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return torch.cat([lp.new_zeros(lp.shape[0], 1), lp], dim=1)


# Response positions per chunk of the no-grad entropy: bounds the [chunk, vocab] fp32 temporaries
# (the metric must not cost a second logits-sized tensor on a long batch).
_ENTROPY_CHUNK = 1024


def token_entropy(logits: torch.Tensor, response_mask: torch.Tensor, *, grad: bool) -> torch.Tensor:
    """[B, L] full-vocabulary entropy of the distribution each logits row defines, aligned like
    `sequence_logprobs`: out[:, t] = H(p(. | ids[:, <t])) from logits[:, t-1], at response
    positions only (0 elsewhere). fp32 at least (fp64 logits stay fp64). grad=False computes it
    detached, in chunks of response positions; grad=True keeps it differentiable (for
    learner.entropy_coef > 0)."""
    dt = torch.promote_types(logits.dtype, torch.float32)
    mask = response_mask[:, 1:]
    if not grad:
        with torch.no_grad():
            # Gather each chunk's rows by index: `logits[:, :-1][mask]` would first copy every
            # response row (a second logits-sized tensor on a long batch).
            b, t = mask.nonzero(as_tuple=True)  # row-major, the order masked_scatter fills
            h = torch.cat([_entropy(logits[b[s:s + _ENTROPY_CHUNK], t[s:s + _ENTROPY_CHUNK]].to(dt))
                           for s in range(0, b.shape[0], _ENTROPY_CHUNK)]) \
                if b.shape[0] else logits.new_zeros(0, dtype=dt)
    else:
        h = _entropy(logits[:, :-1][mask].to(dt))
    out = torch.zeros(response_mask.shape, dtype=dt, device=logits.device)
    return out.masked_scatter(response_mask, h)  # column 0 is never a response position


def _entropy(z: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(z) over the last dimension: logsumexp(z) - sum_v p_v z_v (no log p
    tensor; finite for any finite z)."""
    return torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)


@dataclass(frozen=True)
class GroupStats:
    """Statistics of whole prompt groups that the loss of any part of them needs.

    kl_baseline [B]: the KL reward's baseline per sequence (the advantage estimator applied to
        the group's sequence KLs), or None when the loss has no separate KL reward part.
    token_advantages [B, L]: per-token advantages with the KL reward folded in (kl_in_advantage
        != separate), replacing the controller's task advantage, or None.

    Invariant: computed once over whole groups (a learner mini-batch) with the current policy's
    detached log-probs, and sliced row-wise for its micro-batches, so a micro-batch that cuts a
    group anywhere sees the statistics of the whole group.
    """

    kl_baseline: torch.Tensor | None = None
    token_advantages: torch.Tensor | None = None

    def rows(self, index: torch.Tensor, width: int) -> GroupStats:
        """The statistics of sequences `index`, token columns cut to `width`."""
        adv = self.token_advantages
        return GroupStats(
            None if self.kl_baseline is None else self.kl_baseline[index],
            None if adv is None else adv[index, :width])


def needs_group_stats(kl_cfg: KLConfig, adv_cfg: AdvantageConfig) -> bool:
    """Whether the loss depends on group statistics of the current policy's KL (so that a
    micro-batch cutting a group needs them computed over the whole group first)."""
    reward_part = PLACEMENT_FORMS[kl_cfg.placement].reward and kl_cfg.beta > 0
    return kl_cfg.folds_into_advantage or (reward_part
                                           and ADVANTAGE_ESTIMATORS[adv_cfg.estimator].centres)


class PolicyLoss:
    """The loss of one run's settings, built once (per learner rank): the configs are checked
    and the task term looked up at construction, and each call takes only tensors.

    `loss(logp, ref_logp, batch, num_sequences_global, stats, entropy)` is the loss of the
    module docstring for `batch` (a shard or micro-batch of the global batch) and its metrics;
    `loss.group_stats(logp, ref_logp, batch)` the GroupStats of whole groups it may need
    (`loss.needs_group_stats` says whether it does)."""

    def __init__(self, kl_cfg: KLConfig, adv_cfg: AdvantageConfig, learner_cfg: LearnerConfig):
        check_compatible(kl_cfg, adv_cfg)
        self.kl_cfg, self.adv_cfg, self.learner_cfg = kl_cfg, adv_cfg, learner_cfg
        self.task_term = lookup(TASK_TERMS, learner_cfg.task_off_policy,
                                "learner.task_off_policy")
        self.needs_group_stats = needs_group_stats(kl_cfg, adv_cfg)
        # A KL term in the loss itself (not folded into the task advantage).
        self.separate_kl = kl_cfg.beta > 0 and not kl_cfg.folds_into_advantage

    def group_stats(self, logp: torch.Tensor, ref_logp: torch.Tensor,
                    batch: TrainBatch) -> GroupStats:
        """GroupStats of `batch`, which must hold whole prompt groups; `logp` [B, L] is the
        current policy's (used detached), aligned with batch.input_ids."""
        if not self.needs_group_stats:
            return GroupStats()
        kl_cfg, adv_cfg = self.kl_cfg, self.adv_cfg
        mask = batch.response_mask
        dt = torch.promote_types(logp.dtype, torch.float32)
        lp = torch.where(mask, logp.detach().to(dt), 0.0)
        ref = torch.where(mask, ref_logp.detach().to(dt), 0.0)
        k_tokens = torch.where(mask, kl.estimate(lp, ref, kl_cfg.estimator), 0.0)
        if kl_cfg.folds_into_advantage:
            adv = kl.compute_advantages(
                batch.rewards, batch.group_ids, estimator=adv_cfg.estimator,
                normalize=adv_cfg.normalize, kl_tokens=k_tokens, mask=mask, beta=kl_cfg.beta,
                kl_in_advantage=kl_cfg.kl_in_advantage, eps=adv_cfg.eps)
            return GroupStats(token_advantages=adv)
        return GroupStats(kl_baseline=kl.kl_baseline(k_tokens.sum(-1), batch.group_ids,
                                                     adv_cfg.estimator))

    def __call__(self, logp: torch.Tensor, ref_logp: torch.Tensor, batch: TrainBatch,
                 num_sequences_global: float, stats: GroupStats | None = None,
                 entropy: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """Loss (a scalar to minimise) and metrics for `batch`; see the module docstring.
        `logp` [B, L] is live (fp32), `ref_logp` [B, L] constant, both aligned with
        batch.input_ids. `stats`: the GroupStats of these rows computed over their whole
        groups; None computes them from `batch` itself, which must then hold whole groups.
        `entropy` [B, L]: `token_entropy` of the same forward pass (differentiable when
        learner.entropy_coef > 0, which requires it); None: no policy/entropy metric. The
        metrics are learner.loss_metrics.step_metrics, merged across micro-batches and ranks
        by its `merge_metrics`."""
        self._check_tensors(logp, ref_logp, batch, num_sequences_global, entropy)
        kl_cfg, learner_cfg = self.kl_cfg, self.learner_cfg
        if stats is None:
            stats = self.group_stats(logp, ref_logp, batch)
        mask = batch.response_mask
        dt = torch.promote_types(logp.dtype, torch.float32)  # fp32 at least (fp64 in exact tests)
        zero = torch.zeros((), dtype=dt, device=logp.device)
        lp = torch.where(mask, logp.to(dt), zero)
        ref = torch.where(mask, ref_logp.detach().to(dt), zero)
        mu = torch.where(mask, batch.behaviour_logp.to(dt), zero)
        n = float(num_sequences_global)

        if kl_cfg.folds_into_advantage:
            adv = stats.token_advantages.to(dt)
        else:
            adv = batch.advantages.to(dt)[:, None].expand_as(lp)
        task_tokens = self.task_term.tokens(lp, mu, adv, mask, learner_cfg)
        task_tokens = replace(task_tokens, loss=torch.where(mask, task_tokens.loss, zero))
        task = task_tokens.loss.sum() / n
        terms = {"task": task, "kl": self._kl_term(lp, ref, mu, mask, stats, n, like=task)}
        loss = task + terms["kl"]
        coef = learner_cfg.entropy_coef
        if coef > 0:
            edt = torch.promote_types(dt, entropy.dtype)  # fp64 entropies stay fp64 (exact tests)
            terms["entropy"] = -coef * torch.where(mask, entropy.to(edt), 0.0).sum() / n
            loss = loss + terms["entropy"]
        terms["total"] = loss

        fresh = None if batch.token_lags is None else mask & (batch.token_lags == 0)
        metrics = step_metrics(terms, lp=lp, ref=ref, mu=mu, mask=mask, entropy=entropy,
                               kl_cfg=kl_cfg, task_off_policy=learner_cfg.task_off_policy,
                               task_clipped=task_tokens.clipped,
                               task_masked=task_tokens.masked, fresh=fresh)
        return loss, metrics

    def _check_tensors(self, logp, ref_logp, batch, num_sequences_global, entropy) -> None:
        if num_sequences_global <= 0:
            raise ValueError(f"num_sequences_global must be > 0, got {num_sequences_global}")
        if logp.shape != batch.input_ids.shape or ref_logp.shape != logp.shape:
            raise ValueError(f"logp {tuple(logp.shape)} / ref_logp {tuple(ref_logp.shape)} must "
                             f"match input_ids {tuple(batch.input_ids.shape)}")
        if entropy is not None and entropy.shape != logp.shape:
            raise ValueError(f"entropy {tuple(entropy.shape)} must match logp "
                             f"{tuple(logp.shape)}")
        if self.learner_cfg.entropy_coef > 0 and entropy is None:
            raise ValueError("learner.entropy_coef > 0 needs the per-token entropy "
                             "(token_entropy)")

    def _kl_term(self, lp, ref, mu, mask, stats: GroupStats, n: float,
                 like: torch.Tensor) -> torch.Tensor:
        """beta x the KL surrogate summed over sequences / n: the whole KL term, or a zero (like
        `like`) when there is none or the KL reward is folded into the advantage (KLConfig
        rejects a loss part beside a folded reward part)."""
        if not self.separate_kl:
            return torch.zeros((), dtype=like.dtype, device=like.device)
        kl_cfg = self.kl_cfg
        # behaviour_logp is read only by an importance that reweights (IMPORTANCE_CORRECTIONS).
        per_seq = kl.surrogate(
            lp, ref, mask, estimator=kl_cfg.estimator, placement=kl_cfg.placement,
            importance=kl_cfg.importance, behaviour_logp=mu, truncate=kl_cfg.truncate,
            baseline=stats.kl_baseline)
        return kl_cfg.beta * per_seq.sum() / n


def group_stats(logp: torch.Tensor, ref_logp: torch.Tensor, batch: TrainBatch, kl_cfg: KLConfig,
                adv_cfg: AdvantageConfig) -> GroupStats:
    """One-off `PolicyLoss.group_stats` (the exact tables' and tests' use; a learner rank
    builds its PolicyLoss once)."""
    return PolicyLoss(kl_cfg, adv_cfg, LearnerConfig()).group_stats(logp, ref_logp, batch)


def policy_loss(logp: torch.Tensor, ref_logp: torch.Tensor, batch: TrainBatch, kl_cfg: KLConfig,
                adv_cfg: AdvantageConfig, learner_cfg: LearnerConfig,
                num_sequences_global: float, stats: GroupStats | None = None,
                entropy: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """One-off `PolicyLoss(kl_cfg, adv_cfg, learner_cfg)(...)`: builds and checks the loss at
    every call, for the exact tables and tests that evaluate one setting once; a learner rank
    builds its PolicyLoss once."""
    return PolicyLoss(kl_cfg, adv_cfg, learner_cfg)(logp, ref_logp, batch,
                                                   num_sequences_global, stats, entropy)
