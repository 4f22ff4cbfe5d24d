"""The pre-registration a confirmatory report follows (docs/sweeps/preregistration.yaml): which
claims it tests at which beta, lag and seeds, with which rules (`Rules`: the family-wise alpha,
the equivalence margin of an accuracy, the break-rate bound, the failure definition, the
final-checkpoint evaluation and the threshold-sensitivity variants), and the error rates those
rules have at that design (`Design`, simulated by tests/test_stats.py).

`Rules()` are also the rules of an exploratory report (no pre-registration; `exploratory_rules`
adds the sets its runs evaluated): one home for each threshold. The file is committed before
the runs it governs start; `file_commit` names the commit that last changed what it fixes for
a sweep, which the report prints beside the date that sweep's first run started.
"""
from __future__ import annotations

import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cluster.config.loader import REPO_ROOT, ConfigError
from cluster.analysis.runs import InstabilityRule, RunData
from rewards.config import EVAL_SETS, EvalSetName

# The claims a pre-registration may name; cluster/analysis/findings.py's CLAIMS holds the
# test of each (checked there at import).
ClaimId = Literal["k1_reward_best", "k1_loss_unstable", "k3_loss_stable_worse_ood",
                  "kl_stabilises_async", "k3_reward_breaks", "prefix_repairs",
                  "k1_loss_regularises_nothing", "breaks_with_dose", "kl_keeps_retained",
                  "async_breaks_control", "kl_delays_breaks", "kl_beats_early_stopping",
                  "biased_loss_rises_with_beta"]
# What a researcher's own comparison may measure (cluster/analysis/comparisons.py reads each
# from a run's Measures): the final greedy accuracy and the area under the accuracy curve of an
# evaluation set, the KL to the reference at the end (raw or log), the mean lag.
COMPARED_MEASURES = (*(f"accuracy.{s}" for s in EVAL_SETS), *(f"auc.{s}" for s in EVAL_SETS),
                     "kl_end", "log_kl_end", "lag_mean")
ComparedMeasure = Literal[COMPARED_MEASURES]  # type: ignore[valid-type]
# The configurations whose breaks per-decision weights are expected to repair (exploratory:
# the two that broke at beta 0.3, max_lag 8), as "<estimator>-<placement>".
REPAIRED = ("k1-loss", "k3-reward")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# What can break a run (runs.py has each rule). "kl_drift" (a KL blow-up: a distance) is
# listed only by a definition that counts drift as failure, as the first pre-registration did.
FailureKind = Literal["accuracy_collapse", "reward_collapse", "nonfinite", "grad_blowup",
                      "kl_drift"]
INSTABILITY: tuple[FailureKind, ...] = ("accuracy_collapse", "reward_collapse", "nonfinite",
                                        "grad_blowup")


class FailureRule(_Strict):
    """What counts as a broken run, for every claim alike: instability, i.e. a collapse of the
    greedy accuracy on `sets` (the last evaluation counts when `collapse_min_evals` is 1) or of
    the training reward, a non-finite step, or a gradient-norm blow-up. The KL to the reference
    is a distance, analysed as a continuous outcome beside every accuracy; a KL blow-up breaks
    a run only when `kinds` lists "kl_drift"."""

    kinds: list[FailureKind] = Field(
        default_factory=lambda: list(INSTABILITY), min_length=1, description="The rules that "
        "break a run (runs.py). The first pre-registration (seeds 101-108) predates this field "
        "and was decided with accuracy_collapse, kl_drift and nonfinite.")
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
    changes: dict[str, Any] = Field(default_factory=dict, description="InstabilityRule fields "
                                    "and their values under this variant.")
    kinds: list[FailureKind] | None = Field(None, min_length=1, description="The failure "
                                            "kinds under this variant (null: the rule's).")

    @field_validator("changes")
    @classmethod
    def _known_fields(cls, changes: dict) -> dict:
        InstabilityRule(**changes)  # a typo or a bad value fails here, naming the field
        return changes

    @model_validator(mode="after")
    def _changes_something(self) -> Variant:
        if not self.changes and self.kinds is None:
            raise ValueError(f"variant {self.name!r} changes nothing (give changes or kinds)")
        return self


def _default_variants() -> list[Variant]:
    return [Variant(name="gradient threshold x2", changes={"grad_growth": 40.0}),
            Variant(name="gradient threshold /2", changes={"grad_growth": 10.0}),
            Variant(name="collapse over two evaluations", changes={"collapse_min_evals": 2}),
            Variant(name="drift counted as a break (the first rule)",
                    kinds=[*INSTABILITY, "kl_drift"])]


class Gates(_Strict):
    """When a claim can be decided at all (issue 63): a comparison of break rates is
    contradicted only where it was testable and the difference is shown below a margin, an
    accuracy comparison is decided only on a set that moved, and the KL equivalence margin is a
    share of what a working regulariser does. The first two pre-registrations had none of these
    (`Rules.gates` null); their reports show the verdicts as registered beside the verdicts
    under these gates, a change made after their runs."""

    break_difference: float = Field(0.5, gt=0, le=1, description="'X breaks more than Y' (a "
                                    "dose trend: the most against the least expected dose) is "
                                    "contradicted only when the comparison could have been "
                                    "reproduced at Holm's first level (Tarone) and the upper "
                                    "confidence bound of rate(X) - rate(Y) is shown below this.")
    retained_loss: float = Field(2.0, ge=1, le=50, description="A comparison on the retained "
                                 "set is decided only where the no-KL control at that lag lost "
                                 "at least this many accuracy margins of it against the base "
                                 "model (base_eval.json): otherwise nothing was forgotten, and "
                                 "no configuration can keep more of it.")
    placement_moved: float = Field(1.0, ge=0, le=50, description="A comparison between KL "
                                   "configurations on any other set is decided only where K1 in "
                                   "the reward and the no-KL control at that lag differ there by "
                                   "at least this many accuracy margins: otherwise the KL "
                                   "changed nothing there to place well or badly.")
    kl_margin_share: float = Field(0.5, gt=0, le=1, description="The KL equivalence margin, as "
                                   "a share of the paired log-KL effect of K1 in the reward "
                                   "against no KL at the same setting (a working regulariser's "
                                   "effect): 'the same distance' means within half of what a "
                                   "working regulariser does, not a fixed ratio.")


class Rules(_Strict):
    """The decision rules of the findings (docs/sweeps.md, Findings)."""

    alpha: float = Field(0.05, gt=0, lt=0.5, description="Family-wise error rate of the "
                         "verdicts of one sweep: Holm's correction across its claims, for "
                         "'reproduced' and for 'contradicted' each.")
    accuracy_margin: float = Field(0.02, gt=0, lt=1, description="Equivalence margin of an "
                                   "accuracy: a lead shown to be smaller than this contradicts "
                                   "a claim that one configuration is ahead.")
    kl_log_margin: float = Field(0.405, gt=0, le=5, description="Equivalence margin of the KL "
                                 "to the reference at the end, on the log scale (0.405: a "
                                 "ratio within 1.5x either way; K1 in the reward ends 2.6x "
                                 "closer than no KL at beta 0.3, so it is regularisation this "
                                 "margin can tell from none).")
    retained: str = Field("out_of_domain", min_length=1, max_length=80, description="The "
                          "evaluation set the claims about what training keeps compare ('best "
                          "in- and out-of-domain', 'worse out-of-domain'): the first "
                          "pre-registration's out_of_domain (a format transfer that training "
                          "improves); the second's `retained`, a capability the base model has "
                          "and the task never rewards, which can be forgotten.")
    break_rate: float = Field(0.5, gt=0, lt=1, description="A configuration 'breaks' when its "
                              "break rate is shown above this, is 'stable' when shown below.")
    final_problems: int = Field(1000, ge=1, le=100_000, description="Problems per evaluation "
                                "set of the final checkpoint's evaluation (final_eval.json), "
                                "the accuracy every claim compares.")
    final_eval_seed: int = Field(1, ge=0, le=2**31 - 1, description="Fixes those problems: "
                                 "the same in every run, so configurations are compared on "
                                 "the same problems.")
    final_sets: list[str] = Field(
        default_factory=lambda: ["in_domain", "out_of_domain"], min_length=1,
        description="The evaluation sets of the final checkpoint's evaluation (those the "
        "claims compare; a set the runs do not evaluate is left out).")
    gates: Gates | None = Field(None, description="Testability and measurability gates "
                                "(null: none, as the first two pre-registrations registered "
                                "their rules; kept to recompute their registered verdicts). "
                                "Exploratory reports and new pre-registrations use them.")
    failure: FailureRule = Field(default_factory=FailureRule, description="The failure "
                                 "definition of every claim.")
    sensitivity: list[Variant] = Field(default_factory=_default_variants, max_length=10,
                                       description="Threshold variants of the sensitivity "
                                       "table.")


def exploratory_rules(runs: Iterable[RunData]) -> Rules:
    """The rules of a report without a pre-registration: the defaults, with the final
    checkpoint evaluated on every set the runs evaluated, and the claims about what training
    keeps compared on `retained` where the runs evaluated it (a model with something to
    forget), else on out_of_domain as before."""
    evaluated = {name for run in runs for name in run.evaluated_sets}
    sets = [name for name in EVAL_SETS if name in evaluated] or Rules().final_sets
    return Rules(final_sets=sets, retained="retained" if "retained" in sets else Rules().retained,
                 gates=Gates())


class ClaimSpec(_Strict):
    """One confirmatory claim: a claim of findings.py (or dose.py) at one async lag."""

    claim: ClaimId
    max_lag: int = Field(..., ge=0, le=10_000, description="The lag of its configurations "
                         "(breaks_with_dose over beta: the lag every dose runs at).")
    beta: float | None = Field(None, gt=0, description="kl.beta of its configurations (null: "
                               "the pre-registration's).")
    configuration: str | None = Field(None, pattern=r"^(none-none|(k1|k2|k3)-(reward|loss|"
                                      r"reward\+loss)(-(token|sequence|prefix))?)$",
                                      description="breaks_with_dose: which configuration "
                                      "(<estimator>-<placement>[-<importance>]; none-none: no "
                                      "KL).")
    over: Literal["beta", "max_lag"] | None = Field(None, description="breaks_with_dose: the "
                                                    "dose.")
    doses: list[float] | None = Field(None, min_length=2, max_length=10, description="breaks_"
                                      "with_dose: its values (at least three); biased_loss_"
                                      "rises_with_beta: its betas (the smallest and largest "
                                      "are compared).")
    direction: Literal["rises", "falls"] = Field("rises", description="breaks_with_dose: "
                                                 "whether breaks rise or fall with the dose.")

    @model_validator(mode="after")
    def _dose_fields(self) -> ClaimSpec:
        if self.claim == "biased_loss_rises_with_beta":  # its doses are betas, nothing else
            if self.doses is None or self.configuration is not None or self.over is not None:
                raise ValueError(f"{self.claim}: give doses (its betas), and no configuration "
                                 "or over")
            return self
        dose = (self.configuration, self.over, self.doses)
        if (self.claim == "breaks_with_dose") != all(v is not None for v in dose):
            raise ValueError(f"{self.claim}: configuration, over and doses are given for "
                             "breaks_with_dose, and only for it")
        if self.claim == "breaks_with_dose" and len(self.doses) < 3:
            raise ValueError(f"breaks_with_dose: {len(self.doses)} doses; a trend needs three")
        return self


class Comparison(_Strict):
    """A researcher's own question: configuration A against configuration B on one measure,
    A's mean minus B's, paired by seed (a sweep file's `report.comparisons`, `klrl report
    --compare`, or fixed before the runs in a pre-registration's sweep plan)."""

    a: dict[str, Any] = Field(..., min_length=1, description="Config keys (dotted, as the "
                              "report labels them, e.g. kl.estimator, max_lag) and the values "
                              "that pick configuration A's runs; they must pick the runs of "
                              "one configuration (the seed aside).")
    b: dict[str, Any] = Field(..., min_length=1, description="The same for configuration B.")
    measure: ComparedMeasure = Field(..., description="What is compared: accuracy.<set> (the "
                                     "final greedy accuracy), auc.<set> (the area under its "
                                     "accuracy curve), kl_end or log_kl_end (the KL to the "
                                     "reference over the last 10 steps), lag_mean.")
    direction: Literal["greater", "less", "two-sided"] = Field(
        "two-sided", description="greater: the question is whether A's measure is above B's; "
        "less: below; two-sided: whether they differ either way.")
    name: str | None = Field(None, min_length=1, max_length=120, description="How the report "
                             "names it (default: A vs B on the measure).")

    @model_validator(mode="after")
    def _two_configurations(self) -> Comparison:
        if self.a == self.b:
            raise ValueError(f"a and b pick the same runs ({self.a}): name what differs")
        return self

    def same_question(self, other: Comparison) -> bool:
        """Whether `other` asks this question (its name aside): how a report knows that a
        pre-registration fixed it."""
        return (self.a, self.b, self.measure, self.direction) == \
            (other.a, other.b, other.measure, other.direction)


class SweepPlan(_Strict):
    """The claims and comparisons one sweep tests: the claims are one Holm family, the
    comparisons another."""

    claims: list[ClaimSpec] = Field(default_factory=list, max_length=50)
    comparisons: list[Comparison] = Field(default_factory=list, max_length=50, description=(
        "Comparisons fixed before the runs: a report that names the same question marks it "
        "pre-registered rather than exploratory."))
    total_steps: int | None = Field(None, ge=1, description="The runs' length, fixed here when "
                                    "it is part of what a claim tests (a control given the "
                                    "time to break); runs of another length are left out of "
                                    "the findings, and counted. null: the sweep file's.")
    repaired: list[str] = Field(default_factory=lambda: list(REPAIRED), description="The "
                                "configurations prefix_repairs covers (<estimator>-<placement>).")

    @model_validator(mode="after")
    def _something_tested(self) -> SweepPlan:
        if not self.claims and not self.comparisons:
            raise ValueError("a sweep plan needs at least one claim or comparison")
        return self


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
    # The second pre-registration's paired, dose and equivalence rules (null in the first).
    seed_block_sd: float | None = Field(None, gt=0, description="Assumed sd of the seed's "
                                        "effect shared by every configuration (the block the "
                                        "paired tests remove); seed_sd is then the residual.")
    kl_pair_sd: float | None = Field(None, gt=0, description="Assumed sd over seeds of the "
                                     "paired difference of log KL at the end.")
    paired_power_2sd: float | None = Field(None, ge=0, le=1, description="One paired comparison "
                                           "reproduced at a lead of 2 residual seed-sd.")
    equivalence_power: float | None = Field(None, ge=0, le=1, description="'K1 in the loss "
                                            "regularises nothing' reproduced when its log KL "
                                            "equals no KL's (sd: kl_pair_sd).")
    equivalence_false_positive: float | None = Field(None, ge=0, le=1, description="... "
                                                     "reproduced when the ratio is at the margin.")
    trend_false_positive: float | None = Field(None, ge=0, le=1, description="A dose trend "
                                               "reproduced at an equal break rate 0.3 over "
                                               "three doses.")
    trend_power: float | None = Field(None, ge=0, le=1, description="... reproduced at break "
                                      "rates 0, 0.5 and 1 over three doses.")


class Preregistration(_Strict):
    """docs/sweeps/preregistration.yaml (and preregistration_regimes.yaml)."""

    title: str = Field(..., min_length=1)
    model: str | None = Field(None, min_length=1, description="The model and how it is built "
                              "(null: the embedded default of the sweep files).")
    beta: float = Field(..., gt=0, description="kl.beta of every claim's configurations.")
    seeds: list[int] = Field(..., min_length=2, description="The runs' seeds; runs with other "
                             "seeds are left out of the findings.")
    exploratory: str = Field(..., min_length=1, description="Which earlier evidence chose "
                             "these settings, and is therefore exploratory.")
    rules: Rules = Field(default_factory=Rules)
    sweeps: dict[str, SweepPlan] = Field(..., min_length=1, description="Sweep name -> its "
                                         "claims.")
    design: Design

    def registered(self, sweep: str, seed: int | None, total_steps: int | None) -> bool:
        """Whether a run of `sweep` with this seed and length is one the findings use."""
        length = self.sweeps[sweep].total_steps
        return seed in self.seeds and (length is None or total_steps == length)

    @model_validator(mode="after")
    def _distinct_seeds(self) -> Preregistration:
        if len(set(self.seeds)) < len(self.seeds):
            raise ValueError(f"seeds lists a seed twice: {self.seeds}")
        return self


def rules_of(prereg: Preregistration | None, runs: Iterable[RunData]) -> Rules:
    """The rules a report (and `make results`' final evaluation) follows: the
    pre-registration's, or without one `exploratory_rules` for these runs."""
    return prereg.rules if prereg else exploratory_rules(runs)


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


def _git(cwd: Path, *args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                              timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def _governing(text: str | None, sweep: str) -> dict | None:
    """What a version of the file fixes for `sweep`: every parsed field, with `sweeps` cut to
    that sweep's plan (None when the version does not parse or has no plan for it). Comments
    and other sweeps' claims govern nothing here."""
    try:
        prereg = Preregistration.model_validate(yaml.safe_load(text or ""))
    except ValueError:
        return None
    if sweep not in prereg.sweeps:
        return None
    return prereg.model_dump() | {"sweeps": {sweep: prereg.sweeps[sweep].model_dump()}}


def file_commit(path: str | Path, sweep: str | None = None) -> dict[str, str | bool | None]:
    """{"commit", "date" (ISO), "modified", "file_commit", "file_date"}: the commit that last
    changed what the file fixes for `sweep` (its rules, seeds, design and that sweep's claims;
    the file's last commit when `sweep` is None), the file's own last commit, and whether the
    working tree's file differs from the committed one (None values outside a git checkout).

    One file may govern several sweeps that start at different times: an amendment to a later
    sweep's claims, made after an earlier sweep's first run, leaves the earlier one's findings
    pre-registered, and a change to anything they share does not."""
    full = resolve(path)
    log = _git(full.parent, "log", "--format=%H %cI", "--", full.name)
    status = _git(full.parent, "status", "--porcelain", "--", full.name)
    history = [line.split() for line in (log or "").splitlines() if line.strip()]
    info: dict[str, str | bool | None] = {
        "commit": None, "date": None, "file_commit": None, "file_date": None,
        "modified": None if status is None else bool(status) or not history}
    if not history:
        return info
    info["file_commit"], info["file_date"] = history[0]
    info["commit"], info["date"] = history[0]
    if sweep is None:
        return info
    prefix = (_git(full.parent, "rev-parse", "--show-prefix") or "").strip()
    versions = [(c, d, _governing(_git(full.parent, "show", f"{c}:{prefix}{full.name}"), sweep))
                for c, d in history]
    # Newest first: the last change is the oldest commit of the newest run that matches.
    for (commit, date, fixed), (_, _, before) in zip(versions, versions[1:] + [("", "", None)]):
        info["commit"], info["date"] = commit, date
        if fixed != before:
            break
    return info
