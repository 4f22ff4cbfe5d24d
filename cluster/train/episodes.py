"""The controller's book of multi-turn episodes (task.environment): which samples a broken
environment cost, when the run must stop over them, and the step's episode metrics.

A sample the environment failed (`Rollout.env_failure`: it raised, timed out or replied
garbage) is never trained on and never scored 0 in silence: its whole prompt group leaves the
batch (the group's baselines need every sample, and equal groups keep the learner's shards
whole), each failure is counted and said with its reason, and once the run's failed share
passes task.environment.max_failure_share the run stops with `EnvironmentFailing`, naming the
environment.
"""
from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Sequence

from actors.records import Rollout
from rewards.config import EnvironmentConfig


class EnvironmentFailing(RuntimeError):
    """The environment failed more of the run's samples than task.environment allows."""


class EpisodeBook:
    """Counts the run's samples and the environment's failures across steps."""

    def __init__(self, cfg: EnvironmentConfig):
        self.cfg = cfg
        self.samples = self.failures = 0

    def restore(self, samples: int, failures: int) -> None:
        """Continue a run's counts (a checkpoint's: ControllerState.env_samples, env_failures)."""
        self.samples, self.failures = samples, failures

    def take(self, rollouts: Sequence[Rollout], warn=None) -> tuple[list[Rollout], dict]:
        """The rollouts to train on (every group with a failed sample left out) and the step's
        env/ metrics. warn(text): where a failure's line goes besides stderr (the run log's
        warnings). Raises EnvironmentFailing past the allowed share."""
        failed = [r for r in rollouts if r.env_failure is not None]
        self.samples += len(rollouts)
        self.failures += len(failed)
        if failed:
            reasons = Counter(r.env_failure.split(":", 1)[0] for r in failed)
            first = failed[0]
            line = (f"environment {self.cfg.name!r} failed {len(failed)} of {len(rollouts)} "
                    f"samples ({dict(reasons)}; first: {first.problem.uid}: "
                    f"{first.env_failure}); their prompt groups are left out of the batch")
            print(f"warning: {line}", file=sys.stderr, flush=True)
            if warn is not None:
                warn(line)
        share = self.failures / self.samples if self.samples else 0.0
        if share > self.cfg.max_failure_share:
            raise EnvironmentFailing(
                f"environment {self.cfg.name!r} failed {self.failures} of the run's "
                f"{self.samples} samples ({share:.1%}), above task.environment."
                f"max_failure_share ({self.cfg.max_failure_share:g}); last failure: "
                f"{failed[-1].env_failure if failed else 'none this step'}. Fix the "
                "environment, or raise turn_timeout_s if it is only slow")
        bad_groups = {r.group_id for r in failed}
        kept = [r for r in rollouts if r.group_id not in bad_groups]
        return kept, episode_metrics(rollouts) | {
            "env/failures": float(len(failed)), "env/failures_total": float(self.failures),
            "env/failure_share": share, "env/dropped_samples": float(len(rollouts) - len(kept))}


def episode_metrics(rollouts: Sequence[Rollout]) -> dict[str, float]:
    """Means over a step's episodes: turns, environment replies (tool calls) and the share of
    samples with at least one (env/tool_call_rate), seconds in the environment, policy tokens
    per sample, the shares cut by the turn limit and by the token budget, and each of the
    environment's own info numbers (env/info/<key>, summed per episode)."""
    n = len(rollouts)
    if not n:
        return {}
    out = {
        "env/turns_mean": sum(r.turns for r in rollouts) / n,
        "env/replies_mean": sum(r.env_replies for r in rollouts) / n,
        "env/tool_call_rate": sum(r.env_replies > 0 for r in rollouts) / n,
        "env/seconds_mean": sum(r.env_seconds for r in rollouts) / n,
        "env/policy_tokens_mean": sum(r.num_policy_tokens for r in rollouts) / n,
        "env/truncated_turns_frac": sum(r.finish_reason == "turns" for r in rollouts) / n,
        "env/truncated_length_frac": sum(r.finish_reason == "length" for r in rollouts) / n,
    }
    keys = sorted({k for r in rollouts for k in r.env_info})
    return out | {f"env/info/{k}": sum(r.env_info.get(k, 0.0) for r in rollouts) / n
                  for k in keys}
