"""The learning-rate schedule: linear warm-up, then constant, linear or cosine decay.

`lr_factor(k)` is the multiplier of `learner.lr` at the k-th *applied* optimizer step (k = 0,
1, ...; a refused non-finite step does not advance it, since DeepSpeed skips the scheduler
then). With W = warmup_steps, T = the run's optimizer steps (total_steps x epochs x
mini_batches) and m = min_lr_ratio (each schedule's decay is its entry in
learner/lr_schedules.py's table):

    k < W                     (k + 1) / (W + 1)                    linear warm-up
    k >= W, p = (k - W) / (T - 1 - W) clamped to [0, 1]:
        constant              1
        linear                1 - (1 - m) p
        cosine                m + (1 - m) (1 + cos(pi p)) / 2

so step W uses lr and step T - 1, the run's last, uses m x lr (when T - 1 > W; a run without
a step after warm-up never decays). Steps past T - 1 keep m x lr.

Resume: the schedule is a torch LambdaLR whose state (`last_epoch`, the applied-step count)
DeepSpeed checkpoints with the engine, so a resumed run continues it exactly. The factor is
a plain function of (k, config, T) and is rebuilt at start-up, never restored: LambdaLR
saves the attributes of a callable *object* and would bring back an old T, so `make_scheduler`
hands it a closure. A run resumed with a larger total_steps therefore decays toward its new
last step from where it is (with a decaying schedule the LR jumps up at the resume).
"""
from __future__ import annotations

import torch

from learner.config import LearnerConfig
from learner.lr_schedules import lr_schedule


def lr_factor(k: int, cfg: LearnerConfig, total_steps: int | None) -> float:
    """Multiplier of cfg.lr at applied optimizer step k (module docstring)."""
    warmup = cfg.warmup_steps
    if k < warmup:
        return (k + 1) / (warmup + 1)
    form = lr_schedule(cfg.lr_schedule)  # its entry says whether and how it decays
    if not form.decays:
        return 1.0
    if total_steps is None:
        raise ValueError(f"learner.lr_schedule={cfg.lr_schedule} needs the run's number of "
                         "optimizer steps (total_optimizer_steps)")
    span = total_steps - 1 - warmup
    p = min(1.0, max(0.0, (k - warmup) / span)) if span > 0 else 0.0
    return form.decay(p, cfg.min_lr_ratio)


def make_scheduler(cfg: LearnerConfig, total_steps: int | None):
    """The `lr_scheduler` callable deepspeed.initialize takes: optimizer -> LambdaLR."""
    if lr_schedule(cfg.lr_schedule).decays and total_steps is None:
        raise ValueError(f"learner.lr_schedule={cfg.lr_schedule} needs total_optimizer_steps "
                         "(cluster/train/launch.py passes total_steps x updates_per_batch)")

    def schedule(optimizer):
        def factor(k: int) -> float:  # a function, not an object: see the module docstring
            return lr_factor(k, cfg, total_steps)
        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    return schedule
