"""Rollouts -> `TrainBatch`: task advantages over the global batch, then right-padding.

This runs in the driver, between the two sides: it reads `actors.records.Rollout` fields and
produces the tensors learner/ trains on. It lives in cluster/ because learner/ may not import
actors/ (docs/layout.md), so `TrainBatch` itself only knows tensors.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

import kl
from cluster.train.staleness import token_versions
from learner.batch import TrainBatch
from rewards.shaping import overlong_penalty

if TYPE_CHECKING:
    from actors.records import Rollout
    from cluster.config.sections import ModelConfig
    from rewards.config import OverlongConfig


def train_batch(rollouts: Sequence[Rollout], advantage_cfg, pad_id: int,
                version: int | None = None, overlong: OverlongConfig | None = None,
                budget: int | None = None) -> TrainBatch:
    """The batch the controller trains on: task advantages over these rollouts (the whole
    global batch) by `advantage_cfg` (kl.AdvantageConfig), then `pad_rollouts`; `version`: the
    policy version the learner holds (each token's lag is counted from it). With `overlong`
    (task.overlong) and the generation `budget` (rollout.max_new_tokens): each reward gets its
    length penalty before the advantages (shaped_rewards), and with mask_truncated a truncated
    sample's advantage is then set to 0. The loss sums tokens over a constant number of
    sequences (learner/loss.py), so a zero advantage is exactly a masked task term; the KL
    term is computed from the log-probs and never reads it (TrainConfig refuses a KL reward
    folded into the advantage beside the mask)."""
    rewards = torch.tensor(shaped_rewards(rollouts, overlong, budget), dtype=torch.float64)
    group_ids = torch.tensor([r.group_id for r in rollouts])
    adv = kl.compute_advantages(rewards, group_ids, estimator=advantage_cfg.estimator,
                                normalize=advantage_cfg.normalize, eps=advantage_cfg.eps)
    if overlong is not None and overlong.mask_truncated:
        truncated = torch.tensor([r.finish_reason == "length" for r in rollouts])
        adv = torch.where(truncated, torch.zeros_like(adv), adv)
    return pad_rollouts(rollouts, adv, pad_id=pad_id, version=version, rewards=rewards)


def shaped_rewards(rollouts: Sequence[Rollout], overlong: OverlongConfig | None,
                   budget: int | None) -> list[float]:
    """Each rollout's task reward plus its length penalty (rewards.shaping; none without a
    buffer)."""
    if overlong is None or not overlong.buffer:
        return [r.reward for r in rollouts]
    if budget is None:
        raise ValueError("a length penalty needs the generation budget (rollout.max_new_tokens)")
    return [r.reward + overlong_penalty(len(r.response_ids), budget, overlong.buffer,
                                        overlong.penalty) for r in rollouts]


def shaping_metrics(rollouts: Sequence[Rollout], overlong: OverlongConfig,
                    budget: int) -> dict[str, float]:
    """The step's truncation share, and with task.overlong on, the mean length penalty and
    how many samples the mask took out of the task term."""
    truncated = sum(r.finish_reason == "length" for r in rollouts)
    out = {"rollout/truncated_frac": truncated / len(rollouts)}
    if overlong.buffer:
        raw = [r.reward for r in rollouts]
        shaped = shaped_rewards(rollouts, overlong, budget)
        out["reward/overlong_penalty"] = (sum(shaped) - sum(raw)) / len(rollouts)
    if overlong.mask_truncated:
        out["task/masked_truncated"] = float(truncated)
    return out


def pad_rollouts(rollouts: Sequence[Rollout], advantages, pad_id: int,
                 version: int | None = None, rewards=None) -> TrainBatch:
    """Right-pad prompt + response of each rollout; a multi-turn rollout's environment tokens
    (`Rollout.policy_mask` False) are attended and out of response_mask, with behaviour
    log-prob and lag 0 there. `advantages` is [B] (any float dtype,
    tensor or sequence), aligned with `rollouts`. With `version` (the learner's), each response
    token's lag behind it (`token_lags`; staleness.token_versions says which version sampled
    the token), else no token_lags."""
    if not rollouts:
        raise ValueError("a TrainBatch needs at least one rollout")
    adv = torch.as_tensor(advantages, dtype=torch.float32).reshape(-1)
    if adv.shape[0] != len(rollouts):
        raise ValueError(f"{adv.shape[0]} advantages for {len(rollouts)} rollouts")
    B = len(rollouts)
    L = max(len(r.prompt_ids) + len(r.response_ids) for r in rollouts)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, L), dtype=torch.long)
    response_mask = torch.zeros((B, L), dtype=torch.bool)
    behaviour_logp = torch.zeros((B, L), dtype=torch.float32)
    token_lags = torch.zeros((B, L), dtype=torch.long) if version is not None else None
    for i, r in enumerate(rollouts):
        if not r.prompt_ids:
            raise ValueError(f"rollout {i} has an empty prompt")
        p, n = len(r.prompt_ids), len(r.response_ids)
        input_ids[i, : p + n] = torch.tensor(list(r.prompt_ids) + list(r.response_ids))
        attention_mask[i, : p + n] = 1
        # Multi-turn: the environment's tokens are attended but not trained, so they are out
        # of response_mask, which every loss term, KL estimator and importance weight reads.
        policy = (torch.ones(n, dtype=torch.bool) if r.policy_mask is None
                  else torch.tensor(r.policy_mask, dtype=torch.bool).reshape(n))
        response_mask[i, p : p + n] = policy
        if policy.any():
            row = torch.arange(p, p + n)[policy]
            behaviour_logp[i, row] = torch.tensor(r.behaviour_logprobs, dtype=torch.float32)
            if token_lags is not None:
                token_lags[i, row] = version - torch.tensor(token_versions(r))
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        behaviour_logp=behaviour_logp,
        # the rewards the advantages came from (shaped ones included): a KL reward folded
        # into the advantage (learner/loss.py group_stats) recomputes them from these
        rewards=(torch.tensor([r.reward for r in rollouts]) if rewards is None
                 else torch.as_tensor(rewards)).to(torch.float32),
        advantages=adv,
        group_ids=torch.tensor([r.group_id for r in rollouts], dtype=torch.long),
        token_lags=token_lags,
    )


def policy_tokenizer(model_dir, model: ModelConfig | None = None):
    """The policy's tokenizer in the controller (pad id, prompt lengths, sample texts), loaded
    as the learner loads it (learner.loading), at `model`'s revision and trust_remote_code."""
    from learner.loading import ModelFiles, load_tokenizer

    return load_tokenizer(ModelFiles(
        policy=str(model_dir), revision=model.revision if model else None,
        trust_remote_code=model.trust_remote_code if model else False))


def pad_token_id(tokenizer) -> int:
    """The id `pad_rollouts` pads with: the tokenizer's pad token, else its EOS token."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
