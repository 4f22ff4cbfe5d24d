"""What the trainer logs about the KL, each metric an estimate of the quantity its name says.

Sequences in a training batch come from the sampler mu (the weights that generated them, up to
max_lag versions old), not from the current policy pi. A plain mean of sum_t k_t over the batch
therefore estimates E_mu[sum_t k_t], which is not KL(pi || ref) as soon as mu != pi (on the
enumerable toy, seed 0 at lag 3: 0.653 against a true 0.415). The estimates here are:

    pi_ref     sum_t w_t * k1_t   unbiased for KL(pi || ref)   (per-decision importance sampling)
    pi_ref_k3  sum_t w_t * k3_t   unbiased for KL(pi || ref)   (K3: lower variance per token)
    mu_ref     sum_t (log mu_t - log ref_t)   unbiased for KL(mu || ref), the sampler's own KL

with k_t computed from the current policy's log-probs and w_t = prod_{s<=t} pi/mu the prefix
weight (formed in log space, float64). Why w_t and not the sequence weight W: the t-th term only
depends on the prefix up to t, so E_mu[w_t f_t] = E_pi[f_t] and later tokens add no variance.
At max_lag 0 with exact weight sync, temperature 1 and no top-k/top-p, before a batch's second
update, every w_t is 1 and pi_ref is the plain sequence K1 mean. At another temperature mu is
the tempered policy: the w_t differ from 1 even then, and the estimates stay unbiased (mu
has full support). With top-k/top-p, mu has no mass where pi has some and no weight recovers
pi: these estimates are then biased (on the toy with top-k 2 of 3, pi_ref 0.32 for a true
0.415); klrl refuses importance corrections with such sampling (cluster/config/train_config).
"""
from __future__ import annotations

import torch

from kl.estimators import estimate


def sequence_kl_estimates(logp: torch.Tensor, ref_logp: torch.Tensor, behaviour_logp: torch.Tensor,
                          mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-sequence estimates [B] (float64, detached) named as in the module docstring.

    logp / ref_logp / behaviour_logp: [B, T] log-probs of the sampled tokens under the current
    policy, the reference and the sampler; mask: [B, T] response tokens. Masked positions may
    hold anything (they are replaced by zeros first)."""
    m = mask.bool()
    lp = torch.where(m, logp.detach().double(), 0.0)
    ref = torch.where(m, ref_logp.detach().double(), 0.0)
    mu = torch.where(m, behaviour_logp.detach().double(), 0.0)
    prefix_w = torch.where(m, torch.exp((lp - mu).cumsum(-1)), 0.0)
    k1 = torch.where(m, estimate(lp, ref, "k1"), 0.0)
    k3 = torch.where(m, estimate(lp, ref, "k3"), 0.0)
    return {
        "pi_ref": (prefix_w * k1).sum(-1),
        "pi_ref_k3": (prefix_w * k3).sum(-1),
        "mu_ref": (mu - ref).sum(-1),
    }
