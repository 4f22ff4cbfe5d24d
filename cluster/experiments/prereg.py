"""The pre-registration a confirmatory report follows (docs/sweeps/preregistration.yaml): which
claims it tests at which beta, lag and seeds, with which rules (`Rules`: the family-wise alpha,
the equivalence margin of an accuracy, the break-rate bound, the failure definition, the
final-checkpoint evaluation and the threshold-sensitivity variants), and the error rates those
rules have at that design (`Design`, simulated by tests/test_stats.py).

`Rules()` are also the rules of an exploratory report (no pre-registration): one home for each
threshold. The file is committed before the runs it governs start; `file_commit` names the
commit that last changed it, which the report prints beside the dates the runs started.
"""
from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cluster.config.loader import REPO_ROOT, ConfigError
from cluster.experiments.runs import InstabilityRule
from rewards.config import EvalSetName

CLAIMS = ("k1_reward_best", "k1_loss_unstable", "k3_loss_stable_worse_ood",
          "kl_stabilises_async", "k3_reward_breaks", "prefix_repairs")
ClaimId = Literal["k1_reward_best", "k1_loss_unstable", "k3_loss_stable_worse_ood",
                  "kl_stabilises_async", "k3_reward_breaks", "prefix_repairs"]
# The configurations whose breaks per-decision weights are expected to repair (exploratory:
# the two that broke at beta 0.3, max_lag 8), as "<estimator>-<placement>".
REPAIRED = ("k1-loss", "k3-reward")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FailureRule(_Strict):
    """What counts as a broken run, for every claim alike: a collapse of the greedy accuracy
    on `sets` (the last evaluation counts when `collapse_min_evals` is 1), a KL blow-up
    (drift), or a non-finite step."""

    sets: list[EvalSetName] = Field(
        default_factory=lambda: ["in_domain"], min_length=1, description="Evaluation sets "
        "whose greedy accuracy's collapse breaks a run (in-domain: the trained skill, far above "
        "the collapse level in a stable run).")
    thresholds: InstabilityRule = Field(
        default_factory=lambda: InstabilityRule(collapse_min_evals=1), description="Collapse "
        "and drift thresholds (docs/sweeps.md, Instability flags).")


class Variant(_Strict):
    """A change of the failure thresholds under which every verdict is recomputed: a verdict
    that differs under one is fragile."""

    name: str = Field(..., min_length=1, max_length=80, description="How the report names it.")
    changes: dict[str, Any] = Field(..., min_length=1, description="InstabilityRule fields "
                                    "and their values under this variant.")

    @field_validator("changes")
    @classmethod
    def _known_fields(cls, changes: dict) -> dict:
        InstabilityRule(**changes)  # a typo or a bad value fails here, naming the field
        return changes


def _default_variants() -> list[Variant]:
    return [Variant(name="drift threshold x2", changes={"kl_growth": 40.0}),
            Variant(name="drift threshold /2", changes={"kl_growth": 10.0}),
            Variant(name="collapse over two evaluations", changes={"collapse_min_evals": 2})]


class Rules(_Strict):
    """The decision rules of the findings (docs/sweeps.md, Findings)."""

    alpha: float = Field(0.05, gt=0, lt=0.5, description="Family-wise error rate of the "
                         "verdicts of one sweep: Holm's correction across its claims, for "
                         "'reproduced' and for 'contradicted' each.")
    accuracy_margin: float = Field(0.02, gt=0, lt=1, description="Equivalence margin of an "
                                   "accuracy: a lead shown to be smaller than this contradicts "
                                   "a claim that one configuration is ahead.")
    break_rate: float = Field(0.5, gt=0, lt=1, description="A configuration 'breaks' when its "
                              "break rate is shown above this, is 'stable' when shown below.")
    final_problems: int = Field(1000, ge=1, le=100_000, description="Problems per evaluation "
                                "set of the final checkpoint's evaluation (final_eval.json), "
                                "the accuracy every claim compares.")
    final_eval_seed: int = Field(1, ge=0, le=2**31 - 1, description="Fixes those problems: "
                                 "the same in every run, so configurations are compared on "
                                 "the same problems.")
    final_sets: list[EvalSetName] = Field(
        default_factory=lambda: ["in_domain", "out_of_domain"], min_length=1,
        description="The evaluation sets of the final checkpoint's evaluation (those the "
        "claims compare; a set the runs do not evaluate is left out).")
    failure: FailureRule = Field(default_factory=FailureRule, description="The failure "
                                 "definition of every claim.")
    sensitivity: list[Variant] = Field(default_factory=_default_variants, max_length=10,
                                       description="Threshold variants of the sensitivity "
                                       "table.")


class ClaimSpec(_Strict):
    """One confirmatory claim: a claim of findings.py at one async lag."""

    claim: ClaimId
    max_lag: int = Field(..., ge=0, le=10_000)


class SweepPlan(_Strict):
    """The claims one sweep tests: one Holm family."""

    claims: list[ClaimSpec] = Field(..., min_length=1, max_length=50)
    repaired: list[str] = Field(default_factory=lambda: list(REPAIRED), description="The "
                                "configurations prefix_repairs covers (<estimator>-<placement>).")


class Design(_Strict):
    """The error rates of the rules at this design, stated before the runs; each is simulated
    (seeded, thousands of draws) by tests/test_stats.py, which fails when one is off by more
    than the Monte-Carlo error. Rates are per claim, at the first Holm step (alpha / claims:
    the level every claim is tested at, at worst)."""

    seed_sd: float = Field(..., gt=0, description="Assumed seed-to-seed sd of a final accuracy "
                           "(for the power to contradict).")
    welch_false_positive: float = Field(..., ge=0, le=1, description="One Welch comparison, no "
                                        "difference, unequal variances (sd 1 and 3).")
    welch_power_2sd: float = Field(..., ge=0, le=1, description="One Welch comparison, a lead "
                                   "of 2 seed-sd.")
    best_false_positive: float = Field(..., ge=0, le=1, description="'K1 in the reward is "
                                       "best' reproduced when all four configurations are alike.")
    best_power_3sd: float = Field(..., ge=0, le=1, description="... reproduced when it leads "
                                  "each other by 3 seed-sd on both sets.")
    best_false_contradiction: float = Field(..., ge=0, le=1, description="... contradicted "
                                            "when it leads each by exactly the margin.")
    best_contradiction_power: float = Field(..., ge=0, le=1, description="... contradicted "
                                            "when all four are alike (sd: seed_sd).")
    fisher_false_positive: float = Field(..., ge=0, le=1, description="'A breaks more than "
                                         "B' reproduced when both break at rate 0.5.")
    fisher_power_90_vs_0: float = Field(..., ge=0, le=1, description="... reproduced at "
                                        "break rates 0.9 and 0.")
    binomial_false_contradiction: float = Field(..., ge=0, le=1, description="'A breaks' "
                                                "contradicted when A's break rate is 0.5.")
    binomial_contradiction_power_10: float = Field(..., ge=0, le=1, description="... "
                                                   "contradicted at break rate 0.1.")
    holm_family_wise: float = Field(..., ge=0, le=1, description="Any claim of the family "
                                    "reproduced when none holds (independent tests).")


class Preregistration(_Strict):
    """docs/sweeps/preregistration.yaml."""

    title: str = Field(..., min_length=1)
    beta: float = Field(..., gt=0, description="kl.beta of every claim's configurations.")
    seeds: list[int] = Field(..., min_length=2, description="The runs' seeds; runs with other "
                             "seeds are left out of the findings.")
    exploratory: str = Field(..., min_length=1, description="Which earlier evidence chose "
                             "these settings, and is therefore exploratory.")
    rules: Rules = Field(default_factory=Rules)
    sweeps: dict[str, SweepPlan] = Field(..., min_length=1, description="Sweep name -> its "
                                         "claims.")
    design: Design

    @model_validator(mode="after")
    def _distinct_seeds(self) -> Preregistration:
        if len(set(self.seeds)) < len(self.seeds):
            raise ValueError(f"seeds lists a seed twice: {self.seeds}")
        return self


def resolve(path: str | Path) -> Path:
    path = Path(path)
    return path if path.is_absolute() else REPO_ROOT / path


def load_preregistration(path: str | Path) -> Preregistration:
    """The validated pre-registration; ConfigError naming the file and the field."""
    full = resolve(path)
    if not full.is_file():
        raise ConfigError(f"report.preregistration: {full} not found")
    try:
        return Preregistration.model_validate(yaml.safe_load(full.read_text()))
    except ValueError as exc:
        raise ConfigError(f"{full}: {exc}") from None


def file_commit(path: str | Path) -> dict[str, str | bool | None]:
    """{"commit", "date" (ISO), "modified"}: the commit that last changed the file, and whether
    the working tree differs from it (None values outside a git checkout)."""
    full = resolve(path)

    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], cwd=full.parent, capture_output=True,
                                  text=True, timeout=10, check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    last = git("log", "-1", "--format=%H %cI", "--", full.name)
    status = git("status", "--porcelain", "--", full.name)
    commit, date = last.split() if last else (None, None)
    return {"commit": commit, "date": date,
            "modified": None if status is None else bool(status) or commit is None}
