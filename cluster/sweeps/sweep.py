"""`klrl sweep`: a grid of `klrl train` runs, one normal run directory each, resumable.

A sweep file names a base train config, overrides shared by every run and a grid; the runs are
the grid's Cartesian product, named from their grid values (`k1-reward-lag2-s0`) under
`output_dir/<sweep name>/`. Whether each run is started, resumed, skipped as finished or
refused is the one rule every launcher asks (cluster/train/continuation.py). Every
configuration is validated before anything starts.

Invariant: a run directory counts as one of the sweep's runs (skipped as finished, resumed
when unfinished) only when the config it recorded has the meaning the sweep would give it now
(cluster/train/run_meaning.py); so does every other run in the sweep directory, the report's
input. Otherwise the sweep refuses (`changed_runs`), unless told to run them again
(`set_aside`): the sweep.yaml it writes never claims a setting its runs did not train with.

Running the runs is sweep_run.py's.
"""
from __future__ import annotations

import itertools
import json
import re
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cluster.config.loader import ConfigError, load_config, top_keys
from cluster.config.names import DirName
from cluster.config.train_config import SWEEP_FILE_KEYS, TrainConfig, load_train_config
from cluster.analysis.labels import flatten, value_token
from cluster.analysis.comparisons import GridPoint, check_grid
from cluster.analysis.report import ReportConfig
from cluster.launchers.base import RunRequest
from cluster.train.continuation import Action, Continuation, continuation
from cluster.train.run_log import config_path, read_config
from cluster.train.run_meaning import Change, meaning_changes

_KEY = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
# Set by the sweep for every run (its place and its wandb grouping; wandb_name stays null, so
# each wandb run is named by its grid point in the sweep's group), so a sweep file may not.
RESERVED_KEYS = ("run_name", "output_dir", "logging.wandb_group", "logging.wandb_name",
                 "logging.tags")


class SweepConfig(BaseModel):
    """A grid of training runs (configs/sweeps/*.yaml): the base train config, overrides shared
    by every run, and the grid whose Cartesian product gives the runs."""

    model_config = ConfigDict(extra="forbid")

    name: DirName = Field(..., max_length=100, description="Sweep name: its runs go under "
                          "output_dir/<name>/ and share it as their wandb group; a run name's "
                          "rule (letters, digits, '_', '-', '.', not '.' or '..').")
    train_config: str = Field(..., min_length=1, description="Base TrainConfig YAML, relative "
                              "to the sweep file (or absolute). On a cluster (--address) a file "
                              "outside this repository travels with each job, as with "
                              "`klrl submit`.")
    output_dir: str = Field("runs", min_length=1, description="Parent of the sweep directory. "
                            "With --address: an absolute path on storage that the cluster and "
                            "this machine share, so finished runs are seen and skipped.")
    overrides: dict[str, Any] = Field(default_factory=dict, description="`key.sub: value` "
                                      "applied to every run, over train_config (e.g. "
                                      "total_steps: 150).")
    grid: dict[str, Annotated[list[Any], Field(min_length=1, max_length=1000)]] = Field(
        ..., min_length=1, max_length=20, description="`key.sub: [values]`: one run per "
        "combination, in the order written (the last key varies fastest). `seed` is the key "
        "the report averages over; listed first, the runs go seed by seed across the grid and "
        "its controls, so that a sweep stopped partway has every configuration at the seeds "
        "it reached.")
    controls: list[dict[str, Annotated[list[Any], Field(min_length=1, max_length=1000)]]] = Field(
        default_factory=list, max_length=20, description="Variations of the grid whose runs join "
        "the sweep, in one directory and report: each maps keys to new value lists (replacing "
        "the grid's, or adding keys), e.g. the no-KL control {kl.beta: [0.0], kl.estimator: "
        "[k1], kl.placement: [reward]}. Keys they add name their runs "
        "(`k1-reward-lag8-s0-b0`); a run they share with the grid runs once.")
    parallel: int = Field(1, ge=1, le=1024, description="Runs at once: local processes (each "
                          "needs the CPUs its config reserves), or Ray jobs in flight with "
                          "--address.")
    poll_s: float = Field(2.0, gt=0, le=600, description="Seconds between checks of the running "
                          "runs (progress display and completion).")
    report: ReportConfig = Field(default_factory=ReportConfig, description="Options of the "
                                 "report written when the sweep ends (and by `klrl report`).")

    @field_validator("overrides", "grid", mode="before")
    @classmethod
    def _dotted_keys(cls, value: Any) -> Any:
        """`kl: {beta: [...]}` and `kl.beta: [...]` mean the same (CLI overrides such as
        grid.kl.beta=[0.05,0.1] arrive nested)."""
        return flatten(value) if isinstance(value, dict) else value

    @field_validator("controls", mode="before")
    @classmethod
    def _dotted_control_keys(cls, value: Any) -> Any:
        return [flatten(c) if isinstance(c, dict) else c for c in value] \
            if isinstance(value, list) else value

    @field_validator("overrides", "grid")
    @classmethod
    def _plain_keys(cls, value: dict) -> dict:
        for key in value:
            if not _KEY.match(key):
                raise ValueError(f"{key!r} is not a config key such as kl.beta or max_lag")
            if key in RESERVED_KEYS:
                raise ValueError(f"{key!r} is set by the sweep for each run (see docs/sweeps.md)")
        return value

    @field_validator("controls")
    @classmethod
    def _plain_control_keys(cls, controls: list) -> list:
        for control in controls:
            cls._plain_keys(control)
            cls._distinct_values(control)
        return controls

    @field_validator("grid")
    @classmethod
    def _distinct_values(cls, grid: dict) -> dict:
        for key, values in grid.items():
            if len({json.dumps(v, sort_keys=True) for v in values}) < len(values):
                raise ValueError(f"grid.{key} lists a value twice: {values}")
        return grid

    @model_validator(mode="after")
    def _grid_keys_not_overridden(self) -> SweepConfig:
        varied = set(self.grid).union(*self.controls)
        if both := sorted(varied & set(self.overrides)):
            raise ValueError(f"{both} both in grid (or controls) and in overrides: the grid "
                             "would silently win")
        return self

    def grids(self) -> list[dict[str, list[Any]]]:
        """The grid, then each control: the grid with the control's keys replaced or added."""
        return [self.grid, *({**self.grid, **control} for control in self.controls)]


@dataclass(frozen=True)
class RunSpec:
    """One grid point: its run name, the grid values that define it, and the `key=value`
    overrides of `klrl train` (over the sweep's train_config) that produce it."""

    index: int                # 1-based position in the sweep
    name: str
    values: dict[str, Any]    # grid key -> value
    overrides: tuple[str, ...]


def load_sweep(path: str | Path, overrides: list[str] = ()) -> SweepConfig:
    """Read and validate a sweep file; train_config comes back as an absolute path. A
    training config given instead is refused as one, with the command that runs it."""
    try:
        cfg = load_config(SweepConfig, path, overrides)
    except ConfigError:
        keys = top_keys(path)
        if not keys & SWEEP_FILE_KEYS and keys & (set(TrainConfig.model_fields) - {"name"}):
            raise ConfigError(
                f"{path} is a training config, not a sweep file: run it with `klrl train "
                f"{path}` (or `klrl submit`, or `klrl slurm {path}` without --sweep); a sweep "
                f"file names it (train_config: {path}) beside a grid of values") from None
        raise
    train_config = (Path(path).parent / cfg.train_config).resolve()
    if not train_config.is_file():
        raise ConfigError(f"{path}: train_config {cfg.train_config!r} not found ({train_config})")
    return cfg.model_copy(update={"train_config": str(train_config)})


def sweep_dir(cfg: SweepConfig) -> Path:
    return Path(cfg.output_dir) / cfg.name


def override_value(value: Any) -> str:
    """A value as the right-hand side of a `key=value` override (YAML; JSON where needed)."""
    if isinstance(value, str) and yaml.safe_load(value) == value and "," not in value:
        return value
    return json.dumps(value)


def expand(cfg: SweepConfig) -> list[RunSpec]:
    """The sweep's runs, in grid order: the grid, then each control; when `seed` is the grid's
    first key, seed by seed across the grid and its controls, so that a sweep stopped partway
    has every configuration at the seeds it reached (a paired design's blocks), not the
    grid's at every seed and the controls' at none. Raises ConfigError when two runs would
    share a name."""
    runs, seen = [], {}
    combos = [dict(zip(grid, combo)) for grid in cfg.grids()
              for combo in itertools.product(*grid.values())]
    if next(iter(cfg.grid)) == "seed":
        seeds = [json.dumps(v) for v in cfg.grid["seed"]]

        def block(values: dict) -> int:  # a control's own seeds go after the grid's
            seed = json.dumps(values.get("seed"))
            return seeds.index(seed) if seed in seeds else len(seeds)

        combos.sort(key=block)  # stable: within a seed, the grid first, then each control
    for values in combos:
        name = "-".join(value_token(k, v) for k, v in values.items())
        if name in seen:
            if seen[name] == values:  # a control's run that the grid (or a control) has
                continue
            raise ConfigError(f"grid points {seen[name]} and {values} would both be named {name!r}")
        seen[name] = values
        runs.append(_spec(cfg, len(runs) + 1, name, values))
    return runs


def _spec(cfg: SweepConfig, index: int, name: str, values: dict[str, Any]) -> RunSpec:
    shared = [f"{k}={override_value(v)}" for k, v in cfg.overrides.items()]
    tags = [f"{k}={v}"[:64] for k, v in values.items()]  # wandb caps a tag at 64 chars
    run_overrides = [*shared, *(f"{k}={override_value(v)}" for k, v in values.items()),
                     f"output_dir={sweep_dir(cfg)}", f"run_name={name}",
                     f"logging.wandb_group={cfg.name}", f"logging.tags={json.dumps(tags)}"]
    return RunSpec(index, name, values, tuple(run_overrides))


def validate_runs(cfg: SweepConfig, runs: list[RunSpec]) -> dict[str, Any]:
    """Every run's TrainConfig, validated before anything starts: name -> TrainConfig. A bad
    grid fails here, naming each bad grid point, rather than hours into the sweep."""
    configs, errors = {}, {}
    for run in runs:
        try:
            configs[run.name] = load_train_config(cfg.train_config, list(run.overrides))
        except ConfigError as exc:  # grid points that fail alike are listed once
            errors.setdefault(str(exc), []).append(run.name)
    if errors:
        raise ConfigError("invalid grid points:\n" + "\n".join(
            f"{', '.join(names) if len(names) < len(runs) else 'every grid point'}: {msg}"
            for msg, names in errors.items()))
    if cfg.report.comparisons:  # each names one configuration of this grid, or is refused now
        check_grid(cfg.report.comparisons, [
            GridPoint(flatten(configs[r.name].model_dump(mode="json")),
                      ",".join(f"{k}={v}" for k, v in r.values.items() if k != "seed"))
            for r in runs])
    return configs


def preflight_runs(cfg: SweepConfig, runs: list[RunSpec], configs: dict[str, Any],
                   rerun: frozenset[str] = frozenset()) -> None:
    """Each unfinished run's pre-flight (cluster/train/door/preflight.py: its model, plug-in scorer,
    wandb key, and for a run to resume its checkpoint's config) on this machine, before the
    first run starts: a mistake common to every run is one message, not N failed runs. The
    runs in `rerun` (about to be set aside and started anew) get the checks of their
    environment only: their directories are still there. Local sweeps only: on a cluster the
    jobs check themselves where they run."""
    from cluster.train.door.paths import resolve_paths
    from cluster.train.door.preflight import check_environment, preflight

    failures: dict[str, list[str]] = {}
    for run in runs:
        verdict = continuation(sweep_dir(cfg) / run.name)
        if verdict.action is Action.SKIP and run.name not in rerun:
            continue
        try:
            if run.name in rerun:
                check_environment(resolve_paths(configs[run.name]))
            elif verdict.action is Action.REFUSE:
                raise ConfigError(verdict.reason)
            else:
                preflight(configs[run.name], resume=verdict.action is Action.RESUME)
        except (ConfigError, FileExistsError) as exc:
            failures.setdefault(str(exc), []).append(run.name)
    if failures:
        raise ConfigError("runs that would fail before they start:\n" + "\n".join(
            f"  {', '.join(names) if len(names) < len(runs) else 'every run'}: {msg}"
            for msg, names in failures.items()))


# ---- runs recorded with other settings -----------------------------------------------------

SET_ASIDE_DIR = "replaced"  # SWEEP_DIR/replaced/<run>-<time>/: runs that --rerun moved away


@dataclass(frozen=True)
class ChangedRun:
    """A run directory in the sweep directory whose recorded config means something else than
    what the sweep would run for it now (`changes`), or that the sweep cannot judge (`why`)."""

    name: str
    state: str                 # the rule's RunState, or "not in the grid" (no grid point names it)
    changes: tuple[Change, ...] = ()
    why: str = ""

    def describe(self) -> str:
        return self.why or "; ".join(map(str, self.changes))


def changed_runs(cfg: SweepConfig, runs: list[RunSpec], configs: dict) -> list[ChangedRun]:
    """The run directories under the sweep directory that cannot count as its runs: a grid
    point's run whose recorded config.yaml differs in meaning from `configs[name]` (what the
    sweep runs now), and any other run there that differs from what the sweep would run for
    its recorded grid values (it would join the sweep's report under the sweep's settings).
    A directory without config.yaml never started: nothing is recorded to differ."""
    root = sweep_dir(cfg)
    if not root.is_dir():
        return []
    by_name = {run.name: run for run in runs}
    keys = list(dict.fromkeys(k for grid in cfg.grids() for k in grid))
    changed = []
    for run_dir in sorted(p for p in root.iterdir() if config_path(p).is_file()):
        saved, run = read_config(run_dir), by_name.get(run_dir.name)
        if run is not None:
            state, config = continuation(run_dir).state.value, configs[run.name]
        else:
            state = "not in the grid"
            try:
                config = _config_at(cfg, run_dir.name, _recorded_values(saved, keys))
            except ConfigError as exc:
                changed.append(ChangedRun(run_dir.name, state, why="its recorded grid values "
                                          f"are not a valid run of this sweep: {exc}"))
                continue
        if changes := meaning_changes(saved, _resolved(config)):
            changed.append(ChangedRun(run_dir.name, state, tuple(changes)))
    return changed


def _recorded_values(saved: dict, keys: list[str]) -> dict[str, Any]:
    recorded = flatten(TrainConfig().model_dump(mode="json")) | flatten(saved)
    return {k: recorded[k] for k in keys if k in recorded}


def _config_at(cfg: SweepConfig, name: str, values: dict[str, Any]):
    from cluster.config.train_config import load_train_config

    return load_train_config(cfg.train_config, list(_spec(cfg, 0, name, values).overrides))


def _resolved(config) -> dict:
    """A config as its run records it: its paths made absolute here, as `train()` does."""
    from cluster.train.door.paths import resolve_paths

    return resolve_paths(config).model_dump(mode="json")


def describe_changed(cfg: SweepConfig, changed: list[ChangedRun]) -> str:
    """The refusal: each run (grouped where the changes are the same) and the two ways on."""
    groups: dict[str, list[ChangedRun]] = {}
    for run in changed:
        groups.setdefault(run.describe(), []).append(run)
    lines = [f"  {', '.join(f'{r.name} ({r.state})' for r in group)}: {what}"
             for what, group in groups.items()]
    tokens = list(dict.fromkeys(value_token(c.key, c.new) for r in changed for c in r.changes
                                if isinstance(c.new, str | int | float | None)))
    apart = f"{cfg.name}-{'-'.join(tokens[:3])}" if tokens else f"{cfg.name}-2"
    return (f"sweep {cfg.name}: {len(changed)} run(s) in {sweep_dir(cfg)} were trained with other "
            "settings than the sweep gives them now, so they cannot count as its runs (a key "
            "that changes what a run trains or measures; docs/sweeps.md):\n" + "\n".join(lines)
            + f"\nEither run them again with the new settings, the old runs moved to "
            f"{sweep_dir(cfg) / SET_ASIDE_DIR}/: add --rerun; or keep both, the new settings in "
            f"a sweep directory of their own: add name={apart}")


def set_aside(cfg: SweepConfig, changed: list[ChangedRun]) -> list[Path]:
    """Move each changed run to SWEEP_DIR/replaced/<run>-<time>/ (kept, out of the report,
    which reads the sweep directory's own run directories); returns the new places."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = sweep_dir(cfg) / SET_ASIDE_DIR
    target.mkdir(parents=True, exist_ok=True)
    moved = []
    for run in changed:
        dest = target / f"{run.name}-{stamp}"
        (sweep_dir(cfg) / run.name).rename(dest)
        moved.append(dest)
    return moved


def unfinished_runs(root: Path, runs: list[RunSpec], leave_out: Collection[str] = ()
                    ) -> list[tuple[RunSpec, Continuation]]:
    """The runs a sweep call starts, resumes or reports refused, in the sweep's order, with the
    rule's verdict on each (cluster/train/continuation.py): every run in `root` not skipped as
    finished, but those named in `leave_out`."""
    return [(run, verdict) for run in runs if run.name not in leave_out
            and (verdict := continuation(root / run.name)).action is not Action.SKIP]


def run_request(cfg: SweepConfig, run: RunSpec, verdict: Continuation) -> RunRequest:
    """What a launcher starts for one run (cluster/launchers/), as the rule's verdict on its
    directory says (--resume or not)."""
    return RunRequest.for_run(run.name, cfg.train_config, run.overrides, verdict)


def train_command(cfg: SweepConfig, run: RunSpec, verdict: Continuation) -> list[str]:
    """`klrl train` arguments of one run (after `python -m cluster.cli`)."""
    return run_request(cfg, run, verdict).args()
