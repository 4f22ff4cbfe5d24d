"""What each learner.task_off_policy is, without torch: its names (`TaskOffPolicy`) and one
traits entry per name (`TASK_TERM_TRAITS`), which the configs (LearnerConfig, TrainConfig)
read to validate. What each term computes is learner.task_terms.TASK_TERMS, whose entries hold
these traits (their one home) and read them from here, so loading a config imports no torch.

Adding a task term: its name in `TaskOffPolicy` and its traits here, its formula in
learner.task_terms (each table checks at import that it keys exactly the Literal's names).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kl.registry import literal_names

TaskOffPolicy = Literal["none", "tis", "ppo_clip", "icepop", "mis", "seq_mask_geo",
                        "seq_mask_prod"]


@dataclass(frozen=True)
class TaskTermTraits:
    """What one learner.task_off_policy is.

    uses_ratio: it forms the ratios pi/mu, so they must be importance ratios (no truncated
        sampling: cluster.config.train_config refuses top_k / top_p with it).
    masks: it drops tokens or samples outside [learner.mask_low, learner.mask_high] (the only
        entries those two fields act on: LearnerConfig refuses them moved for any other).
    """

    uses_ratio: bool
    masks: bool = False


TASK_TERM_TRAITS: dict[str, TaskTermTraits] = {
    "none": TaskTermTraits(uses_ratio=False),
    "tis": TaskTermTraits(uses_ratio=True),
    "ppo_clip": TaskTermTraits(uses_ratio=True),
    "icepop": TaskTermTraits(uses_ratio=True, masks=True),
    "mis": TaskTermTraits(uses_ratio=True, masks=True),
    "seq_mask_geo": TaskTermTraits(uses_ratio=True, masks=True),
    "seq_mask_prod": TaskTermTraits(uses_ratio=True, masks=True),
}
TASK_OFF_POLICIES: tuple[str, ...] = literal_names(
    TaskOffPolicy, TASK_TERM_TRAITS, table_name="learner.task_term_traits.TASK_TERM_TRAITS",
    literal_name="TaskOffPolicy", kind="task off-policy handlings")
# The ones that mask (drop tokens or samples outside [mask_low, mask_high]).
MASKING_TERMS: tuple[str, ...] = tuple(n for n, t in TASK_TERM_TRAITS.items() if t.masks)
