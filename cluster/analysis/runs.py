"""The runs a report reads and the instability rules it applies to each of them.

A run directory holds config.yaml, metrics.jsonl, final/ once finished and, after the final
checkpoint's evaluation (sweeps/final_eval.py), final_eval.json; `load_run` reads them, and nothing
else, so a report works on a sweep that is still running.

Instability (per run; thresholds are `InstabilityRule` fields, documented in docs/sweeps.md):
- accuracy collapse: an eval accuracy falls below `collapse_fraction` x its best earlier value
  (once that best is at least `collapse_min_peak`) and stays below at every later evaluation,
  at least `collapse_min_evals` evaluations in all.
- KL blow-up: the KL metric's trailing median over `smooth` steps exceeds `kl_growth` x its
  early level (median of the first `kl_early_fraction` of steps, at least `kl_floor`), or
  exceeds `kl_max` when set.
- non-finite: a step the learner refused (NaN/inf gradient) or any logged NaN/inf value.
- reward collapse: the training batch's mean reward (`reward_metric`), as a trailing mean over
  `smooth` steps, falls below `collapse_fraction` x its best earlier value (once that is at
  least `collapse_min_peak`) and stays below to the end, over at least `smooth` steps.
- gradient-norm blow-up: the gradient norm before clipping (`grad_metric`), as a trailing median
  over `smooth` steps, exceeds `grad_growth` x its early level (median of the first
  `kl_early_fraction` of steps).

A KL blow-up is a distance, not an instability: a run that moves far from the reference while
its accuracy, reward and gradients stay sound has drifted, and the findings' failure definition
(prereg.FailureRule) counts it only where it lists "kl_drift".
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from cluster.analysis.labels import SET_LABELS, configuration_labels, flatten
from cluster.train.run_log import has_metrics, is_finished, read_config, read_metrics
from rewards.config import EVAL_SETS

FINAL_EVAL_FILE = "final_eval.json"  # in a run directory: cluster/sweeps/final_eval.py writes it
BASE_EVAL_FILE = "base_eval.json"  # in a sweep directory: the starting model, the same way
# (metric, label): greedy pass@1 first, then sampled accuracy (temperature 1).
ACCURACY_KEYS = [(f"eval/{name}/{key}", SET_LABELS[name] + suffix)
                 for key, suffix in (("accuracy", ""), ("sampled_accuracy", " sampled"))
                 for name in EVAL_SETS]


class InstabilityRule(BaseModel):
    """When a run's accuracy has collapsed or its KL blown up: the report's flags
    (`ReportConfig`) and the pre-registered failure definition of the findings."""

    model_config = ConfigDict(extra="forbid")

    collapse_fraction: float = Field(0.5, gt=0, lt=1, description="Accuracy collapse: an eval "
                                     "accuracy below this fraction of its best earlier value "
                                     "that stays below it until the end of the run.")
    collapse_min_peak: float = Field(0.05, ge=0, le=1, description="An accuracy collapse counts "
                                     "only once the best earlier accuracy reached this (falls "
                                     "from near zero are noise).")
    collapse_min_evals: int = Field(2, ge=1, le=1000, description="An accuracy collapse counts "
                                    "only when at least this many evaluations (the first low "
                                    "one included) are below the level: a single low final "
                                    "evaluation is as likely noise (100 problems: +/-0.03) as a "
                                    "collapse.")
    kl_metric: str = Field("kl/pi_ref", min_length=1, description="KL metric watched for "
                           "blow-ups: the batch's importance-corrected per-sequence K1 estimate "
                           "of KL(pi||ref) (the K3 estimate's exp(-delta) has a heavy tail: in "
                           "stable runs single batches spike to 5-10x its usual value).")
    kl_growth: float = Field(20.0, gt=1, le=1e9, description="KL blow-up: the smoothed KL "
                             "exceeds this factor times its early level.")
    kl_floor: float = Field(0.05, gt=0, le=1e6, description="The early level is at least this "
                            "(nats per sequence): the KL starts at 0 (policy == reference), and "
                            "growing from 0 is what training does.")
    kl_early_fraction: float = Field(0.1, gt=0, le=1, description="The early level is the median "
                                     "KL over this fraction of the run's first steps (at least "
                                     "`smooth` steps).")
    kl_max: float | None = Field(None, gt=0, le=1e9, description="KL blow-up also when the "
                                 "smoothed KL exceeds this (nats per sequence); null: no "
                                 "absolute limit.")
    grad_metric: str = Field("grad/norm", min_length=1, description="Gradient-norm metric "
                             "watched for blow-ups (the learner's norm before clipping).")
    grad_growth: float = Field(20.0, gt=1, le=1e12, description="Gradient-norm blow-up: its "
                               "smoothed value exceeds this factor times its early level (in "
                               "the confirmation's stable runs the 5-step median stayed within "
                               "3x of its start; K3 in the reward at max_lag 8 rose 100-1e6x).")
    reward_metric: str = Field("reward/mean", min_length=1, description="Training-batch reward "
                               "watched for a collapse.")
    smooth: int = Field(5, ge=1, le=10_000, description="Window in steps: trailing median of "
                        "the KL test, and centred moving average of the per-step curves in "
                        "the plots (1: raw values; in the plots at most a fifth of the longest "
                        "run's steps, and odd: an even window is drawn one step shorter).")


@dataclass
class RunData:
    """One run directory as the report sees it."""

    name: str
    dir: Path
    config: dict[str, Any]    # the resolved TrainConfig, flattened to dotted keys
    rows: dict[int, dict]     # step -> metrics; a step logged twice (replayed after a resume)
                              # keeps the later row
    finished: bool            # final/config.json exists
    final_eval: dict | None = None  # final_eval.json: the final checkpoint's evaluation

    def series(self, key: str, x: str = "step") -> tuple[list[float], list[float]]:
        """Where `key` was logged and its values (NaN for a non-finite value). x "step": the
        training step; "policy_version": the version of the weights that sampled the step's
        batch (`rollout/policy_version`; the step itself for rows without one, such as the
        step-0 evaluation), so that runs at different lags line up on the data they used."""
        def where(step: int, row: dict) -> float:
            return row.get("rollout/policy_version", step) if x == "policy_version" else step

        pts = [(where(s, row), _number(row[key])) for s, row in sorted(self.rows.items())
               if key in row]
        pts = [(s, v) for s, v in pts if v is not None]
        return [s for s, _ in pts], [v for _, v in pts]

    @property
    def last_step(self) -> int:
        return max(self.rows, default=0)

    @property
    def evaluated_sets(self) -> list[str]:
        """The evaluation sets the run's config names (a set left null is not evaluated)."""
        return [name for name in EVAL_SETS
                if any(key.startswith(f"eval.{name}.") for key in self.config)]


@dataclass(frozen=True)
class Flag:
    """One instability of one run, at the step where it was detected."""

    run: str
    kind: str      # "accuracy collapse", "KL blow-up", "non-finite"
    step: int
    detail: str


def _number(value: Any) -> float | None:
    """A metric value as a float: run_log writes NaN/inf as the strings 'nan'/'inf'."""
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def load_run(run_dir: Path) -> RunData:
    rows: dict[int, dict] = {}
    for row in read_metrics(run_dir):
        rows[row["step"]] = rows.get(row["step"], {}) | row
    final = run_dir / FINAL_EVAL_FILE
    return RunData(run_dir.name, run_dir, flatten(read_config(run_dir)), rows,
                   is_finished(run_dir), json.loads(final.read_text()) if final.is_file() else None)


def find_runs(path: Path) -> list[RunData]:
    """DIR itself when it is a run directory, else the run directories directly inside it."""
    path = Path(path)
    if has_metrics(path):
        return [load_run(path)]
    return [load_run(p) for p in sorted(path.iterdir()) if has_metrics(p)]


def group_runs(runs: list[RunData]) -> dict[str, list[RunData]]:
    """Configuration label (e.g. `k1-reward-lag2`) -> its runs (runs without a config.yaml:
    their directory's name for a single run, else `all runs`)."""
    groups: dict[str, list[RunData]] = {}
    for run, label in zip(runs, configuration_labels(runs)):
        groups.setdefault(label or (run.name if len(runs) == 1 else "all runs"), []).append(run)
    return dict(sorted(groups.items()))


# ---- instability flags ----------------------------------------------------------------------


def accuracy_collapse(steps: list[int], values: list[float], cfg: InstabilityRule,
                      problems: int | None = None) -> tuple[int, str] | None:
    """First eval step j with acc_j < fraction x max(acc_<j) (max >= min_peak) such that every
    later eval stays below that level too and at least `collapse_min_evals` evals (j
    included) are below it; (step, explanation) or None. With `problems` (per evaluation),
    the explanation counts the problems solved, so a fall near zero reads as the few problems
    it is."""
    for j in range(1, len(values) - cfg.collapse_min_evals + 1):
        earlier = [v for v in values[:j] if math.isfinite(v)]
        if not earlier:
            continue
        best = max(earlier)
        level = cfg.collapse_fraction * best
        if best >= cfg.collapse_min_peak and math.isfinite(values[j]) \
                and all(v < level for v in values[j:] if math.isfinite(v)):
            best_step = steps[values.index(best)]
            solved = (f"; {round(best * problems)} -> {round(values[j] * problems)} of "
                      f"{problems} problems") if problems else ""
            return steps[j], (f"{values[j]:.3f} < {cfg.collapse_fraction:g} x best {best:.3f} "
                              f"(step {best_step}{solved}), below at every later evaluation "
                              f"(last {values[-1]:.3f})")
    return None


def kl_blowup(steps: list[int], values: list[float],
              cfg: InstabilityRule) -> tuple[int, str] | None:
    """First step where the trailing median KL exceeds kl_growth x the early level (or kl_max)."""
    finite = [(s, v) for s, v in zip(steps, values) if math.isfinite(v) and s > 0]
    if not finite:
        return None
    kl = [v for _, v in finite]
    early_n = max(cfg.smooth, math.ceil(cfg.kl_early_fraction * len(kl)))
    early = max(statistics.median(kl[:early_n]), cfg.kl_floor)
    for i, (step, _) in enumerate(finite):
        smoothed = statistics.median(kl[max(0, i + 1 - cfg.smooth):i + 1])
        if smoothed > cfg.kl_growth * early:
            return step, (f"{cfg.kl_metric} median of {cfg.smooth} steps {smoothed:.3g} > "
                          f"{cfg.kl_growth:g} x early level {early:.3g}")
        if cfg.kl_max is not None and smoothed > cfg.kl_max:
            return step, (f"{cfg.kl_metric} median of {cfg.smooth} steps {smoothed:.3g} > "
                          f"kl_max {cfg.kl_max:g}")
    return None


def grad_blowup(steps: list[int], values: list[float],
                cfg: InstabilityRule) -> tuple[int, str] | None:
    """First step where the trailing median gradient norm exceeds grad_growth x its early
    level (the median of the first kl_early_fraction of steps, at least `smooth` of them)."""
    finite = [(s, v) for s, v in zip(steps, values) if math.isfinite(v) and s > 0]
    if not finite:
        return None
    norms = [v for _, v in finite]
    early_n = max(cfg.smooth, math.ceil(cfg.kl_early_fraction * len(norms)))
    early = statistics.median(norms[:early_n])
    if early <= 0:
        return None
    for i, (step, _) in enumerate(finite):
        smoothed = statistics.median(norms[max(0, i + 1 - cfg.smooth):i + 1])
        if smoothed > cfg.grad_growth * early:
            return step, (f"{cfg.grad_metric} median of {cfg.smooth} steps {smoothed:.3g} > "
                          f"{cfg.grad_growth:g} x early level {early:.3g}")
    return None


def reward_collapse(steps: list[int], values: list[float],
                    cfg: InstabilityRule) -> tuple[int, str] | None:
    """First step where the trailing mean reward over `smooth` steps falls below
    collapse_fraction x its best earlier value and stays below to the end, at least `smooth`
    steps in all (accuracy_collapse's rule on the smoothed per-step series)."""
    pts = [(s, v) for s, v in zip(steps, values) if math.isfinite(v)]
    if len(pts) <= cfg.smooth:
        return None
    vals = [v for _, v in pts]
    smoothed = [statistics.fmean(vals[i + 1 - cfg.smooth:i + 1])
                for i in range(cfg.smooth - 1, len(vals))]
    hit = accuracy_collapse([s for s, _ in pts][cfg.smooth - 1:], smoothed,
                            cfg.model_copy(update={"collapse_min_evals": cfg.smooth}))
    return (hit[0], f"{cfg.reward_metric} mean of {cfg.smooth} steps {hit[1]}") if hit else None


def nonfinite_steps(run: RunData) -> tuple[int, str] | None:
    """First step the learner refused (`nonfinite` = 1) or that logged a NaN/inf value."""
    bad = {}
    for step, row in sorted(run.rows.items()):
        keys = [k for k, v in row.items() if (n := _number(v)) is not None and not math.isfinite(n)]
        if row.get("nonfinite"):
            keys.insert(0, "refused step")
        if keys:
            bad[step] = keys
    if not bad:
        return None
    first = min(bad)
    return first, f"{len(bad)} step(s); first: {', '.join(bad[first][:4])}"


def instability_flags(run: RunData, cfg: InstabilityRule) -> list[Flag]:
    flags = []
    problems = run.config.get("eval.num_problems")  # per evaluation, every set
    for key, label in ACCURACY_KEYS:
        if hit := accuracy_collapse(*run.series(key), cfg,
                                    problems if isinstance(problems, int) else None):
            flags.append(Flag(run.name, f"accuracy collapse ({label})", *hit))
    if hit := reward_collapse(*run.series(cfg.reward_metric), cfg):
        flags.append(Flag(run.name, "reward collapse", *hit))
    if hit := grad_blowup(*run.series(cfg.grad_metric), cfg):
        flags.append(Flag(run.name, "gradient-norm blow-up", *hit))
    if hit := kl_blowup(*run.series(cfg.kl_metric), cfg):
        flags.append(Flag(run.name, "KL blow-up", *hit))
    if hit := nonfinite_steps(run):
        flags.append(Flag(run.name, "non-finite", *hit))
    return flags


# The faults a run logs (cluster/train/controller.py, learner_restarts.py): the counters that
# run up over a run (their last value counts) and the per-step counts (summed), with how a
# report names each.
FAULT_TOTALS = {"faults/learner_restarts": "learner restart(s)",
                "faults/learner_steps_lost": "step(s) redone",
                "faults/worker_restarts": "worker replacement(s)"}
FAULT_PER_STEP = {"faults/reissued_samples": "sample(s) reissued",
                  "faults/scoring_pool_errors": "scoring-pool error(s)"}


def run_faults(run: RunData) -> dict[str, int]:
    """What went wrong in a run and was healed, as the report names it -> how often (only the
    kinds that happened): a result from a run that lost its learner and redid steps is one a
    reader weighs differently."""
    out = {}
    for key, label in FAULT_TOTALS.items():
        if (values := [v for v in run.series(key)[1] if math.isfinite(v)]) and max(values):
            out[label] = int(max(values))
    for key, label in FAULT_PER_STEP.items():
        if total := int(sum(v for v in run.series(key)[1] if math.isfinite(v))):
            out[label] = total
    return out


def faults_text(faults: dict[str, int]) -> str:
    return ", ".join(f"{n} {label}" for label, n in faults.items())
