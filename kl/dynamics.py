"""The toy trained to its fixed point: where each KL configuration's update *leads*.

kl.analysis gives every configuration's exact expected gradient at one (pi, ref, mu). This
module iterates it: a tabular policy on the enumerable toy (kl.toy) is trained from the
reference by gradient descent on klrl's loss, task term plus beta x kl.surrogate, with the
behaviour policy mu the policy `lag` updates earlier (mu = pi_{t - lag}; pi_0 before step
`lag`), and the run is compared with the regularised optimum

    pi*(y) proportional to ref(y) * exp(r(y) / beta),

the maximiser of E_pi[r] - beta KL(pi || ref) over sequences. Each step is either the exact
expectation under mu (a finite weighted sum over every sequence, no sampling) or an n-sample
estimate (n sequences drawn from mu, leave-one-out baselines as klrl's RLOO). The task term is
learner.task_off_policy "tis" (per-token min(rho_t, C) weights, detached) with the baseline
E_mu[r] (exact) or the leave-one-out mean (n samples); the KL term's reward part gets the
matching baseline of the sequence KL estimates, as the learner's kl_baseline does.

What the theory says (and tests/test_kl_dynamics.py checks), on-policy:
- K1 in the reward has the expected gradient g* = grad KL(pi||ref): it converges to pi*.
- K1 in the loss has expected gradient 0 (E_pi[grad log pi] = 0): its trajectory is the no-KL
  control's step for step, toward the unregularised optimum (all mass on argmax r).
- K3 in the loss has the token-level forward-KL gradient: its fixed point is where grad E_pi[r]
  = beta x grad_token KL(ref || pi), a forward-KL optimum, not pi*.
- K3 in the reward has g* - token-forward gradient: another fixed point, not pi*.
Off-policy (lag > 0), a fixed point has pi = mu, so the fixed points are the on-policy ones;
the lag decides only whether (and how) they are reached. Off-policy K1 in the loss is no longer
zero: its gradient beta x E_mu[grad log pi] pushes pi away from the sequences mu sampled
(minimising E_mu[log pi] raises the cross-entropy to mu), a drive away from where the policy
was, which the reward placement does not have.

Pure torch (kl/ stays free of Ray, vLLM and DeepSpeed).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kl import toy as T
from kl.estimators import estimate
from kl.surrogate import surrogate

NO_KL = "no KL"


@dataclass(frozen=True)
class Configuration:
    """One KL configuration of the trainer (estimator None: the no-KL control, beta 0)."""

    estimator: str | None
    placement: str | None = None
    importance: str = "none"

    @property
    def name(self) -> str:
        if self.estimator is None:
            return NO_KL
        return f"{self.estimator.upper()} in {self.placement}" + (
            f" + importance {self.importance}" if self.importance != "none" else "")


# The sweeps' configurations: the four KL configurations, the no-KL control and the two
# per-decision-weight repairs the confirmation tested.
CONFIGURATIONS = (
    Configuration(None), Configuration("k1", "reward"), Configuration("k1", "loss"),
    Configuration("k3", "reward"), Configuration("k3", "loss"),
    Configuration("k1", "loss", "prefix"), Configuration("k3", "reward", "prefix"),
)


@dataclass(frozen=True)
class Task:
    """A toy RL problem: sequences, the reference policy (the start) and a reward per sequence."""

    space: T.SequenceSpace
    ref_logits: torch.Tensor
    reward: torch.Tensor  # [N], one value per enumerated sequence

    @classmethod
    def make(cls, vocab: int = 3, length: int = 3, seed: int = 0, ref_scale: float = 1.0
             ) -> Task:
        """Seeded: reference logits N(0, ref_scale^2), rewards uniform on [0, 1]."""
        space = T.sequence_space(vocab, length, eos=True)
        g = torch.Generator().manual_seed(seed)
        ref = ref_scale * torch.randn(space.num_rows, vocab, generator=g, dtype=torch.float64)
        reward = torch.rand(space.tokens.shape[0], generator=g, dtype=torch.float64)
        return cls(space, ref, reward)

    def optimum(self, beta: float) -> torch.Tensor:
        """pi*(y) = ref(y) exp(r(y)/beta) / Z over the sequences: [N]."""
        log = T.token_logp(self.ref_logits, self.space).sum(-1) + self.reward / beta
        return torch.softmax(log, 0)


def reverse_kl(p: torch.Tensor, q: torch.Tensor) -> float:
    """KL(p || q) of two distributions over the sequences (0 log 0 = 0)."""
    keep = p > 0
    return float((p[keep] * (p[keep].log() - q[keep].log())).sum())


@dataclass(frozen=True)
class Trajectory:
    """One training run on the toy: where it ended and how it got there."""

    configuration: str
    lag: int
    samples: int | None          # None: exact expectation
    steps: int
    final_logits: torch.Tensor
    kl_to_optimum: float         # KL(pi_end || pi*)
    reward: float                # E_pi_end[r]
    kl_to_ref: float             # KL(pi_end || ref), the distance the sweeps report
    top_mass: float              # the largest probability of one sequence (1: deterministic)
    last_update: float           # |logits_T - logits_{T-1}|: 0 at a fixed point
    max_grad_norm: float         # the largest gradient norm along the way
    finite: bool
    kl_to_optimum_curve: tuple[float, ...]  # KL(pi_t || pi*) every `record_every` steps
    kl_to_ref_curve: tuple[float, ...]


def _loss(logits: torch.Tensor, task: Task, cfg: Configuration, beta: float,
          mu_logits: torch.Tensor, index: torch.Tensor, weight: torch.Tensor,
          tis_cap: float, exact: bool) -> torch.Tensor:
    """klrl's loss on the batch `index` (sequence indices) with weights `weight` (mu's
    probabilities when exact, 1/n per sample otherwise)."""
    sp = task.space
    lp = T.token_logp(logits, sp)[index]
    mu = T.token_logp(mu_logits, sp)[index]
    ref = T.token_logp(task.ref_logits, sp)[index]
    mask = sp.mask[index]
    r = task.reward[index]

    def baseline(values: torch.Tensor) -> torch.Tensor:
        if exact:  # E_mu[values]: the many-sample limit of the leave-one-out mean
            return (weight * values).sum().expand_as(values)
        n = values.shape[0]
        return (values.sum() - values) / (n - 1)

    rho = torch.exp(lp - mu).detach().clamp(max=tis_cap)
    advantage = r - baseline(r)
    task_term = -(advantage[:, None] * rho * lp * mask).sum(-1)
    total = task_term
    if cfg.estimator is not None and beta > 0:
        seq_k = torch.where(mask, estimate(lp.detach(), ref, cfg.estimator), 0.0).sum(-1)
        kl = surrogate(lp, ref, mask, estimator=cfg.estimator, placement=cfg.placement,
                       importance=cfg.importance, behaviour_logp=mu,
                       baseline=baseline(seq_k).detach())
        total = total + beta * kl
    return (weight * total).sum()


def train(task: Task, cfg: Configuration, beta: float, lag: int, steps: int, lr: float,
          samples: int | None = None, seed: int = 0, tis_cap: float = 2.0,
          record_every: int = 10) -> Trajectory:
    """Train from the reference for `steps` plain gradient steps of size `lr` on the logits.
    `samples` None: the exact expectation under mu every step; n >= 2: n sequences drawn
    from mu (seeded by `seed`)."""
    if lag < 0 or steps < 1 or lr <= 0 or (samples is not None and samples < 2):
        raise ValueError("need lag >= 0, steps >= 1, lr > 0 and samples None or >= 2")
    g = torch.Generator().manual_seed(seed)
    star = task.optimum(beta) if beta > 0 else None
    ref_p = T.sequence_prob(task.ref_logits, task.space)
    n_seq = task.space.tokens.shape[0]
    history = [task.ref_logits.clone()]
    logits = history[0]
    max_grad, last_update, finite = 0.0, math.nan, True
    to_star, to_ref = [], []
    for t in range(steps):
        mu_logits = history[max(0, len(history) - 1 - lag)]
        mu_p = T.sequence_prob(mu_logits, task.space)
        if samples is None:
            index, weight = torch.arange(n_seq), mu_p
        else:
            index = torch.multinomial(mu_p, samples, replacement=True, generator=g)
            weight = torch.full((samples,), 1.0 / samples, dtype=mu_p.dtype)
        x = logits.detach().clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(
            _loss(x, task, cfg, beta, mu_logits, index, weight, tis_cap, samples is None), x)
        norm = float(grad.norm())
        if not math.isfinite(norm):
            finite = False
            break
        max_grad = max(max_grad, norm)
        logits = logits - lr * grad
        last_update = lr * norm
        history = history[-lag:] + [logits] if lag else [logits]
        if t % record_every == 0 or t == steps - 1:
            p = T.sequence_prob(logits, task.space)
            to_star.append(reverse_kl(p, star) if star is not None else math.nan)
            to_ref.append(reverse_kl(p, ref_p))
    p = T.sequence_prob(logits, task.space)
    return Trajectory(cfg.name, lag, samples, steps, logits.detach(),
                      reverse_kl(p, star) if star is not None else math.nan,
                      float(p @ task.reward), reverse_kl(p, ref_p), float(p.max()), last_update,
                      max_grad,
                      finite, tuple(to_star), tuple(to_ref))


def stationarity(task: Task, logits: torch.Tensor, beta: float) -> dict[str, float]:
    """How far `logits` are from each objective's stationary point, as the norm of its
    on-policy gradient there, from quantities independent of kl.surrogate (kl.toy's exact
    sequence and token-level KLs): "reverse" grad E_pi[r] - beta grad KL(pi||ref) (0 at pi*),
    "forward" grad E_pi[r] - beta grad_token KL(ref||pi) (0 at K3-in-the-loss's fixed point),
    "none" grad E_pi[r] (0 only at a deterministic policy's limit)."""
    sp, ref = task.space, task.ref_logits
    reward = T.grad_of(lambda x: T.sequence_prob(x, sp) @ task.reward, logits)
    reverse = T.grad_of(lambda x: T.sequence_kl(x, ref, sp), logits)
    forward = T.grad_of(lambda x: T.token_kl(x, ref, sp, "forward"), logits)
    return {"reverse": float((reward - beta * reverse).norm()),
            "forward": float((reward - beta * forward).norm()),
            "none": float(reward.norm())}


def ends_at(traj: Trajectory, task: Task, beta: float, tol: float = 1e-3) -> str:
    """Where a run went: "diverged" (a non-finite step), "pi*" (KL to it below `tol` and the
    reverse objective stationary), "forward-KL optimum" (the forward objective stationary),
    "collapsed onto one sequence" (over 0.99 of the mass on a sequence that is not the best),
    "toward the unregularised optimum" (no fixed point: further from the reference than pi*
    and with more reward, as the no-KL control), else "elsewhere"."""
    if not traj.finite:
        return "diverged"
    station = stationarity(task, traj.final_logits, beta)
    if traj.kl_to_optimum < tol and station["reverse"] < tol:
        return "pi*"
    if station["forward"] < tol:
        return "forward-KL optimum"
    p = T.sequence_prob(traj.final_logits, task.space)
    if traj.top_mass > 0.99 and int(p.argmax()) != int(task.reward.argmax()):
        return "collapsed onto one sequence"
    star = task.optimum(beta)
    ref = T.sequence_prob(task.ref_logits, task.space)
    if traj.reward > float(star @ task.reward) and traj.kl_to_ref > reverse_kl(star, ref):
        return "toward the unregularised optimum"
    return "elsewhere"


def sweep(task: Task, beta: float, lags: Sequence[int], steps: int, lr: float,
          configurations: Sequence[Configuration] = CONFIGURATIONS,
          samples: int | None = None, seed: int = 0) -> list[Trajectory]:
    """Every configuration at every lag."""
    return [train(task, cfg, beta, lag, steps, lr, samples, seed)
            for cfg in configurations for lag in lags]
