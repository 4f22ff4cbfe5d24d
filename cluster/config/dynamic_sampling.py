"""`dynamic_sampling`: DAPO's dynamic sampling, the config side (cluster/train/dynamic_sampling.py
does it; docs/long-responses.md says what it costs and what it biases)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from kl.traits import ADVANTAGE_ESTIMATOR_TRAITS
from kl.config import AdvantageConfig


class DynamicSamplingConfig(BaseModel):
    """Drop the prompt groups whose samples all got the same task reward (the scorer's, before
    overlong shaping: for a 0/1 task, its accuracy) and train on groups drawn from the next
    batches in their place, so that every step trains a full batch of groups with spread."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(False, description="Drop zero-spread groups and refill the step's "
                          "batch from the stream (DAPO). The replacements are generated at "
                          "the current weights, so their lag stays within max_lag; groups "
                          "beyond the batch are discarded (a resumed run replays exactly). "
                          "Needs a group baseline and rollout.samples_per_prompt >= 2.")
    max_batches_per_step: int = Field(4, ge=1, le=1000, description="Global batches a step "
                                      "may draw, the first included: the most generation one "
                                      "step can cost. When they hold fewer groups with spread "
                                      "than a batch, the step is completed with zero-spread "
                                      "groups (logged as dynamic_sampling/filled_zero_spread).")

    def check(self, advantage: AdvantageConfig, samples_per_prompt: int) -> None:
        """ValueError where dropping zero-spread groups means nothing: without a group
        baseline their advantage is not 0 (kl.advantage's table says which estimators
        subtract one), and a group of one sample has no spread to measure."""
        if not self.enabled:
            return
        if samples_per_prompt < 2:
            raise ValueError(f"dynamic_sampling.enabled with rollout.samples_per_prompt="
                             f"{samples_per_prompt}: a group of one sample has no spread to "
                             "drop it for; raise samples_per_prompt or disable it")
        if not ADVANTAGE_ESTIMATOR_TRAITS[advantage.estimator].centres:
            ok = [n for n, s in ADVANTAGE_ESTIMATOR_TRAITS.items() if s.centres]
            raise ValueError(f"dynamic_sampling.enabled with advantage.estimator="
                             f"{advantage.estimator}: without a group baseline a zero-spread "
                             "group's advantage is its reward, not 0, so dropping it changes "
                             f"the objective; use one of {', '.join(ok)}, or disable it")
