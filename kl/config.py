"""Pydantic configuration of the KL penalty and of the advantage estimator. Torch-free: the
rules read each setting's traits from kl.traits, so loading a config imports no torch."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kl.estimators import Estimator
from kl.traits import (
    IMPORTANCE_TRAITS,
    IMPORTANCES,
    KL_IN_ADVANTAGE_TRAITS,
    NORMALIZATION_TRAITS,
    PLACEMENT_FORMS,
    REWEIGHTING,
    AdvantageEstimator,
    Importance,
    KLInAdvantage,
    Normalization,
    Placement,
    check_group_size,
    check_normalization,
)

class KLConfig(BaseModel):
    """How the KL penalty toward the reference policy enters the update (see the table of
    docs/kl.md). Each setting's behaviour and rules are its table entry (kl.registry)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    estimator: Estimator = Field(
        "k1", description="Per-token estimator: k1 = delta, k2 = delta^2/2, "
        "k3 = exp(-delta)-1+delta.")
    placement: Placement = Field(
        "reward", description="KL as a per-token reward (score function), as a differentiated "
        "loss, or both.")
    importance: Importance = Field(
        "none", description="Off-policy correction of the KL term: none, per-token ratio, sequence "
        "weight W or per-decision prefix weights w_t (sequence/prefix are exact).")
    truncate: float | None = Field(
        None, gt=0, le=1e6, description="Cap C on the importance coefficient (bounded variance, "
        "bias only where a weight exceeds C). None: no cap. Needs importance != none.")
    beta: float = Field(0.1, ge=0.0, le=100.0,
                        description="KL coefficient; 0 disables the penalty.")
    kl_in_advantage: KLInAdvantage = Field(
        "separate", description="With the KL in the reward: 'separate' keeps the KL part of the "
        "advantage unnormalised with reward-to-go and a leave-one-out baseline (exactly beta "
        "times the KL gradient for every advantage estimator, on-policy and, with "
        "kl.importance prefix or sequence, off-policy); "
        "'normalized' folds it into each sample's sequence return r - beta K, normalised like "
        "a task reward and given to every token (verl-style; with a std the effective beta "
        "becomes beta/sigma per prompt); 'centered' is the paper authors' form: the sequence "
        "sum of the per-token estimate clamped to +-10, minus its group mean, times beta, "
        "subtracted from every token's advantage ((n-1)/n beta on-policy). Folded forms go "
        "through learner.task_off_policy: off-policy, tis weights and ppo_clip clips their "
        "KL part too, and a mask drops it with its token (the separate KL term is never "
        "masked).")

    @property
    def folds_into_advantage(self) -> bool:
        """Whether the KL reward is folded into the task advantage (a folding kl_in_advantage,
        with a reward placement and beta > 0) instead of going through kl.surrogate."""
        return (KL_IN_ADVANTAGE_TRAITS[self.kl_in_advantage].folds
                and PLACEMENT_FORMS[self.placement].reward and self.beta > 0)

    @model_validator(mode="after")
    def _consistent(self) -> KLConfig:
        correction = IMPORTANCE_TRAITS[self.importance]
        if self.truncate is not None and not correction.reweights:
            raise ValueError("kl.truncate caps an importance weight: set kl.importance "
                             f"({', '.join(REWEIGHTING)}) or remove kl.truncate")
        form = PLACEMENT_FORMS[self.placement]
        folds = KL_IN_ADVANTAGE_TRAITS[self.kl_in_advantage].folds
        separate = [n for n, f in KL_IN_ADVANTAGE_TRAITS.items() if not f.folds]
        reward_only = [n for n, f in PLACEMENT_FORMS.items() if f.reward and not f.loss]
        if folds and form.reward and form.loss:
            # A folded reward part is reshaped by the advantage (normalized: divided by each
            # group's std, so it does not even scale with beta on a prompt whose task reward is
            # constant) while the loss part keeps plain beta: their sum is no documented gradient.
            raise ValueError(f"kl.kl_in_advantage={self.kl_in_advantage} with kl.placement="
                             f"{self.placement} would fold the reward part into the advantage "
                             "(for normalized: scaled by each group's std) and leave the loss "
                             "part at plain beta, which is not the reward+loss gradient: use "
                             f"kl_in_advantage={'/'.join(separate)} (exact beta in both parts) "
                             f"or placement={'/'.join(reward_only)}")
        if folds and form.reward and correction.reweights:
            unweighted = [n for n in IMPORTANCES if not IMPORTANCE_TRAITS[n].reweights]
            raise ValueError(f"kl.importance={self.importance} does not reach a KL reward folded "
                             f"into the advantage (kl.kl_in_advantage={self.kl_in_advantage}; the "
                             "task term's learner.task_off_policy applies instead): use "
                             f"importance={'/'.join(unweighted)}, or kl_in_advantage="
                             f"{'/'.join(separate)} for an importance-corrected KL reward")
        return self


class AdvantageConfig(BaseModel):
    """Task advantage: baseline estimator and normalisation over groups of samples per prompt."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    estimator: AdvantageEstimator = Field(
        "rloo", description="rloo: leave-one-out mean; grpo: group mean and std; drgrpo: group "
        "mean only; reinforce: no baseline.")
    normalize: Normalization = Field(
        "group", description="Divide by the group std, the batch std, or nothing. grpo requires "
        "group and drgrpo requires none (that is what those names mean).")
    eps: float = Field(1e-6, gt=0, le=1.0, description="Added to the std before dividing.")

    @model_validator(mode="after")
    def _named_estimators_fix_normalisation(self) -> AdvantageConfig:
        check_normalization(self.estimator, self.normalize)  # the estimator's entry says which
        return self

    def check_group_size(self, samples_per_prompt: int, field: str) -> None:
        """Refuse groups of `samples_per_prompt` samples (the config field `field`) that the
        estimator cannot use; its table entry is the one home of the minimum and the reason."""
        check_group_size(self.estimator, samples_per_prompt, f"{field}={samples_per_prompt}")


def check_compatible(kl_cfg: KLConfig, adv_cfg: AdvantageConfig) -> None:
    """The rules that span the KL and the advantage configuration (their one home: TrainConfig
    and the learner's loss both call this). Raises ValueError naming the fix."""
    if kl_cfg.folds_into_advantage and not NORMALIZATION_TRAITS[adv_cfg.normalize].within_group:
        ok = [n for n, scale in NORMALIZATION_TRAITS.items() if scale.within_group]
        raise ValueError(f"kl.kl_in_advantage={kl_cfg.kl_in_advantage} folds the KL into the "
                         "advantage on each learner rank's shard of whole groups, where "
                         f"advantage.normalize={adv_cfg.normalize} would scale by the shard, "
                         f"not the batch: use advantage.normalize={' or '.join(ok)}")
