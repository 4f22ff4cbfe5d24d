"""Pydantic configuration of the training task (`TaskConfig`) and of its evaluation
(`EvalSet`, `EvalConfig`): the `task:` and `eval:` sections of a TrainConfig.

They live here, beside the tasks they name, so that the rollout worker (actors/) takes them
typed without importing cluster/; cluster.config.train_config composes them into TrainConfig.

Validation builds the named tasks (cheap: no data is loaded before a split is drawn), so an
unknown task, option or split fails here, before any process starts, not in a rollout worker.
Task names are checked against rewards.registry (the one list of tasks). A plug-in task
("package.module:TaskClass") is user code: validation checks the spec's form only, and
`check_plugins` imports it and makes the same checks where the run runs (preflight), as for a
plug-in scorer (rewards/plugin.py says why).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from rewards.environment import check_environment_name
from rewards.environment import make_environment
from rewards.pass_at_k import default_ks
from rewards.dataset_rows import counting_rows
from rewards.records import Task
from rewards.registry import (
    PLUGIN_FORM,
    TASKS,
    build_task,
    check_contract,
    check_task_name,
    get_task,
    is_plugin,
    task_class,
)

StopString = Annotated[str, Field(min_length=1, max_length=1000)]


# How a check builds a task: build_named's signature (name field, name, options field, options).
Build = Callable[[str, str, str, dict], Task]

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class OverlongConfig(_Strict):
    """What a long or truncated response costs (DAPO's recipe; rewards/shaping.py). Off by
    default: the task reward as the scorer gave it, every sample trained on."""

    buffer: int = Field(0, ge=0, le=1_000_000, description="The last this many tokens of "
                        "rollout.max_new_tokens are penalised: a response of length |y| loses "
                        "penalty x (|y| - (max_new_tokens - buffer)) / buffer of reward there, "
                        "the whole penalty at the budget (DAPO's soft overlong punishment); 0: "
                        "off. Must be below rollout.max_new_tokens.")
    penalty: float = Field(1.0, gt=0.0, le=100.0, description="The largest length penalty, "
                           "reached at the budget (DAPO: 1, the size of a 0/1 task reward).")
    mask_truncated: bool = Field(False, description="Truncated responses (finish_reason "
                                 "'length') get no task gradient: their task advantage is set "
                                 "to 0 after the group baselines are computed (their reward "
                                 "still enters their group's baselines). Their KL term stays: "
                                 "with kl.placement loss, or reward with kl.kl_in_advantage "
                                 "separate, a truncated sample is still pulled toward the "
                                 "reference; a KL reward folded into the advantage would be "
                                 "masked with it, so that combination is refused.")


class EnvironmentPoolConfig(_Strict):
    """Where the environment runs (actors/environment_pool.py; docs/multi-turn.md). Off by
    default (0 actors): on threads of the rollout worker, which costs nothing to start and
    suits a tool of microseconds (the calculator; a Ray round trip would cost more than the
    step). On: each rollout worker starts its own pool of environment actors (Ray actors
    beside it, killed with it), so a tool that computes for long does not compete with the
    engine in the worker's process and a hung one is killed and replaced (its samples
    dropped and counted), where a thread would be left running."""

    actors_per_worker: int = Field(0, ge=0, le=256, description="Environment actors each "
                                   "rollout worker starts; its episodes are dealt to them in "
                                   "turn and stay on theirs. 0: the environment runs on "
                                   "threads of the worker.")
    cpus_per_actor: float = Field(1.0, ge=0.0, le=256, description="Ray CPUs each environment "
                                  "actor reserves (counted in the run's CPU request; 0: "
                                  "none, it shares the node's).")
    concurrency: int = Field(16, ge=1, le=1024, description="Steps (or resets) one environment "
                             "actor runs at once, each on a thread of its own; beyond "
                             "actors_per_worker x concurrency a generate call's episodes "
                             "wait their turn, within turn_timeout_s.")

    @property
    def enabled(self) -> bool:
        return self.actors_per_worker > 0


class EnvironmentConfig(_Strict):
    """A multi-turn environment that answers the policy's turns (rewards/environment.py;
    docs/multi-turn.md). Off by default (name null): one prompt, one completion, scored by the
    task's scorer. On, the environment's reward replaces the scorer's, and
    rollout.max_new_tokens is the budget of the whole episode after the prompt (the policy's
    turns and the environment's replies together)."""

    name: str | None = Field(None, min_length=1, description="The environment: 'calculator' "
                             "(rewards/calculator.py) or a plug-in 'package.module:Class' (a "
                             "rewards.environment.Environment subclass importable by the run "
                             "and its Ray workers); null: single-turn.")
    options: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of "
                                    "the environment's class, given to each sample's instance.")
    max_turns: int = Field(4, ge=1, le=256, description="Policy turns per episode at most; an "
                           "episode the environment has not ended by then is cut (finish "
                           "reason 'turns'; one that fills rollout.max_new_tokens: "
                           "'length').")
    max_tokens_per_turn: int = Field(64, ge=1, le=1_000_000, description="Tokens one policy "
                                     "turn may sample (the environment then sees the turn with "
                                     "finish reason 'length' and decides). At most "
                                     "rollout.max_new_tokens.")
    turn_timeout_s: float = Field(10.0, gt=0, le=3600, description="Seconds the environment may "
                                  "take to reset or answer one turn; past it the sample is "
                                  "dropped and counted (env/failures). On a thread of the "
                                  "rollout worker, one that hangs keeps that thread; in an "
                                  "environment actor (pool), the actor is replaced.")
    max_failure_share: float = Field(0.1, ge=0.0, le=1.0, description="Share of the run's "
                                     "samples the environment may fail (raise, time out, reply "
                                     "garbage) before the run stops with an error naming it; "
                                     "each failed sample's prompt group is dropped from its "
                                     "batch.")
    pool: EnvironmentPoolConfig = Field(default_factory=EnvironmentPoolConfig,
                                        description="Environment actors beside the rollout "
                                        "workers, or threads of the workers (the default).")

    @field_validator("name")
    @classmethod
    def _known_environment(cls, name: str | None) -> str | None:
        if name is not None:
            check_environment_name(name)
        return name

    @model_validator(mode="after")
    def _builds(self) -> EnvironmentConfig:
        # A shipped environment is built here (cheap); a plug-in at the door, where it runs.
        if self.name is not None and not is_plugin(self.name):
            make_environment(self.name, self.options)
        return self

    @property
    def enabled(self) -> bool:
        return self.name is not None


class TaskConfig(_Strict):
    """The training task: a prompt source and a verifiable scorer (rewards/), and how its
    prompts are put to the model (chat template, system prompt, stop strings). Training and
    evaluation render prompts the same way (actors.prompting)."""

    name: str = Field("arithmetic", min_length=1, description=f"Task: one of rewards/ ("
                      f"{', '.join(TASKS)}; one without a train split, such as mmlu, only "
                      f"evaluates) or a plug-in '{PLUGIN_FORM}' (a rewards.Task subclass in "
                      "your own package, importable by the run and its Ray workers).")
    options: dict[str, Any] = Field(default_factory=dict, description="Keyword options for "
                                    "rewards.get_task (e.g. path=..., dataset=..., columns=... "
                                    "to rename dataset columns to the task's).")
    reward: str | None = Field(None, pattern=r"^[\w.]+:\w+$", description="Plug-in scorer "
                               "'package.module:function' replacing the task's own.")
    scorer_timeout_s: float = Field(5.0, gt=0, le=600, description="Per-item scoring timeout; "
                                    "a scorer that exceeds it scores 0 and is counted.")
    scorer_workers: int = Field(1, ge=1, le=64,
                                description="Processes in each worker's scoring pool.")
    train_split: str = Field("train", min_length=1,
                             description="Split the training prompts come from.")
    max_malformed_fraction: float = Field(
        0.0, ge=0.0, le=1.0, description="Share of a local dataset file's rows that may be "
        "malformed (not JSON, a column missing, a value of the wrong type) before the run is "
        "refused at the start; each file the run reads (training split and evaluation sets) "
        "is checked. 0: none may be; 1: any, so long as one row is usable. Malformed rows "
        "within it are skipped, and the count is said on the terminal. Hub datasets are read "
        "by the run itself: their malformed rows are skipped and counted in train.log.")
    chat_template: Literal["auto", "none"] = Field(
        "auto", description="auto: the prompt is a user message rendered with the tokenizer's "
        "chat template when it has one (Instruct models), else raw text; none: always raw text.")
    system_prompt: str | None = Field(None, min_length=1, max_length=100_000, description=
                                      "System message before each prompt (needs a chat "
                                      "template); null: none.")
    overlong: OverlongConfig = Field(default_factory=OverlongConfig, description="Length "
                                     "shaping of the reward and masking of truncated responses "
                                     "(DAPO); off by default.")
    stop: list[StopString] = Field(default_factory=list, max_length=64, description="Stop "
                                   "strings: a completion ends after the first one it generates "
                                   "(finish_reason 'stop'; the string is not part of the scored "
                                   "text).")
    environment: EnvironmentConfig = Field(default_factory=EnvironmentConfig, description=
                                           "A multi-turn environment answering the policy's "
                                           "turns (docs/multi-turn.md); off by default.")

    @field_validator("name")
    @classmethod
    def _known_task(cls, name: str) -> str:
        check_task_name(name)  # one line: did you mean, the known tasks, the plug-in form
        return name

    @field_validator("options")
    @classmethod
    def _task_takes_the_options(cls, options: dict, info: ValidationInfo) -> dict:
        if (name := info.data.get("name")) is not None and not is_plugin(name):
            get_task(name, **options)  # ValueError naming the unknown option
        return options

    @field_validator("train_split")
    @classmethod
    def _task_has_the_split(cls, split: str, info: ValidationInfo) -> str:
        name, options = info.data.get("name"), info.data.get("options")
        if name is not None and options is not None and not is_plugin(name):
            get_task(name, **options).check_split(split)
        return split

    def check_plugin(self, build: Build | None = None) -> None:
        """A plug-in task's checks, which validation leaves to the machine that runs it:
        import it, build it with `options` (with `build`, a command's one builder: `Build`),
        check it has `train_split`. ValueError naming the field (task.name, task.options or
        task.train_split). Nothing to do for a task of rewards/, which validation has
        checked."""
        if is_plugin(self.name):
            task = (build or build_named)("task.name", self.name, "task.options", self.options)
            try:
                task.check_split(self.train_split)
            except ValueError as e:
                raise ValueError(f"task.train_split: {e}") from None

    @model_validator(mode="after")
    def _check_prompting(self) -> TaskConfig:
        if self.system_prompt is not None and self.chat_template == "none":
            raise ValueError("task.system_prompt needs a chat template; set "
                             "task.chat_template=auto or drop the system prompt")
        return self


def build_named(name_field: str, name: str, options_field: str, options: dict) -> Task:
    """get_task(name, **options), its ValueError prefixed with the field at fault. A command
    that checks one task several ways passes one memoised builder of this signature (`Build`)
    to each check, so that the task is built once."""
    try:
        cls = task_class(name)
    except ValueError as e:
        raise ValueError(f"{name_field}: {e}") from None
    try:
        task = build_task(cls, name, options)
    except ValueError as e:
        raise ValueError(f"{options_field}: {e}") from None
    try:
        check_contract(task, name)
    except ValueError as e:
        raise ValueError(f"{name_field}: {e}") from None
    return task


class EvalSet(_Strict):
    """One evaluation set: a task's split (by default the training task's)."""

    task: str | None = Field(None, min_length=1, description="Task to evaluate on, named as "
                             "task.name is; null: the training task with its options.")
    options: dict[str, Any] = Field(default_factory=dict, description="rewards.get_task options "
                                    "(ignored when task is null).")
    split: str = Field(..., min_length=1, description="Split name of that task.")

    @field_validator("task")
    @classmethod
    def _known_task(cls, name: str | None) -> str | None:
        if name is not None:
            check_task_name(name)
        return name

    def resolve(self, training: TaskConfig) -> EvalSet:
        """This set with the training task filled in when `task` is null."""
        if self.task is not None:
            return self
        return EvalSet(task=training.name, options=dict(training.options), split=self.split)


# The evaluation sets a run can have, in the order they are evaluated, logged and reported
# (eval/<name>/accuracy): one home for the names, which EvalConfig's fields must match.
# The evaluation sets a run can name (EvalConfig's fields, in this order).
EvalSetName = Literal["in_domain", "out_of_domain", "far_out_of_domain", "retained"]
EVAL_SETS: tuple[str, ...] = get_args(EvalSetName)


class EvalConfig(_Strict):
    """Greedy pass@1 and sampled accuracy, in- and out-of-domain, every `eval_every` steps.

    The problems and the sampling seeds come from `seed`, not from the run's seed, so runs
    that differ only in their seed are evaluated on the same problems.
    """

    in_domain: EvalSet = Field(default_factory=lambda: EvalSet(split="in_domain"),
                               description="In-domain set (logged as eval/in_domain/accuracy).")
    out_of_domain: EvalSet | None = Field(
        default_factory=lambda: EvalSet(split="out_of_domain"),
        description="Out-of-domain set (eval/out_of_domain/accuracy); null: none.")
    far_out_of_domain: EvalSet | None = Field(
        None, description="A second, further out-of-domain set (eval/far_out_of_domain/"
        "accuracy), e.g. one the model cannot solve before or after training, kept beside a "
        "nearer out_of_domain set where a generalisation gap can show; null: none.")
    retained: EvalSet | None = Field(
        None, description="A capability the model had before training that the task never "
        "rewards (eval/retained/accuracy): what RL makes the model forget, as the paper's MMLU "
        "sets measure it after math RL, e.g. {split: retained} with `model.embedded: "
        "arith-retain` (docs/model.md); null: none.")
    num_problems: int = Field(200, ge=1, le=100_000, description="Problems per set per evaluation.")
    samples: int = Field(4, ge=0, le=1024, description="Samples per problem (at `temperature`) for "
                         "eval/<set>/sampled_accuracy (the quantity RL optimises); 0: greedy only.")
    pass_k: list[int] | None = Field(None, max_length=16, description="The k of "
                                     "eval/<set>/pass@k, each at most `samples` (unbiased from "
                                     "the samples per problem: rewards/pass_at_k.py); null: 1, "
                                     "2, 4, ... up to `samples`, and `samples` itself; []: none. "
                                     "avg@k is eval/<set>/sampled_accuracy for every k.")
    max_new_tokens: int | None = Field(None, ge=1, le=1_000_000, description="Completion budget "
                                       "of evaluation (eval/<set>/truncated counts completions "
                                       "it cuts); null: rollout.max_new_tokens, the training "
                                       "budget.")
    temperature: float = Field(1.0, gt=0.0, le=100.0, description="Temperature of the sampled "
                               "evaluation (the greedy one is temperature 0).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus mass of the sampled "
                         "evaluation; 1.0 = off.")
    top_k: int = Field(-1, ge=-1, le=10_000_000, description="Top-k of the sampled evaluation; "
                       "-1 (or 0) = off.")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Fixes the evaluated problems and the "
                      "sampling seeds, independently of the run's seed.")

    @model_validator(mode="after")
    def _pass_k_within_samples(self) -> EvalConfig:
        if self.pass_k:
            bad = [k for k in self.pass_k if not 1 <= k <= self.samples]
            if bad:
                raise ValueError(
                    f"eval.pass_k {bad}: each k is between 1 and eval.samples ({self.samples}), "
                    "the samples per problem it is estimated from; raise eval.samples or drop "
                    "those k")
            if len(set(self.pass_k)) < len(self.pass_k):
                raise ValueError(f"eval.pass_k {self.pass_k} names a k twice")
        return self

    def ks(self) -> list[int]:
        """The k pass@k is logged at (pass_k, or its default for `samples`)."""
        return sorted(self.pass_k) if self.pass_k is not None else default_ks(self.samples)

    def check_sets(self, training: TaskConfig, plugins: bool = False,
                   build: Build | None = None) -> None:
        """Raise ValueError, naming `eval.<set>.task`, `eval.<set>.options`,
        `eval.<set>.split` or `eval.num_problems`, when a set's task does not take its options,
        has no such split, or holds fewer distinct problems than each evaluation asks.
        Sets of plug-in tasks are checked only with `plugins` (that imports them: see
        `check_plugins`). build: the command's builder (`Build`), if it has one."""
        for name, s in self.sets(training).items():
            if is_plugin(s.task) and not plugins:
                continue
            task = (build or build_named)(f"eval.{name}.task", s.task, f"eval.{name}.options",
                                          s.options)
            try:
                task.check_split(s.split)
            except ValueError as e:
                other = (f"; or evaluate another task (eval.{name}.task, e.g. mmlu) or none "
                         f"(eval.{name}=null)" if name != "in_domain" else "")
                raise ValueError(f"eval.{name}.split: {e}{other}") from None
            try:
                task.check_count(s.split, self.num_problems)
            except ValueError as e:  # an evaluation would fail at step 0, stack started
                raise ValueError(f"eval.num_problems: {e} (eval.{name}); ask for at most "
                                 "that many") from None

    def sets(self, training: TaskConfig) -> dict[str, EvalSet]:
        """The configured sets by name (EVAL_SETS order), tasks resolved."""
        named = ((name, getattr(self, name)) for name in EVAL_SETS)
        return {name: s.resolve(training) for name, s in named if s is not None}


def check_plugins(task: TaskConfig, evaluation: EvalConfig, build: Build | None = None) -> None:
    """Import every plug-in task a run names (task.name, eval.<set>.task) and make the checks
    that validation makes for the tasks of rewards/: options, train split, evaluation splits.
    ValueError naming the field. Where the run runs, before anything starts
    (cluster/train/door/), as `rewards.load_scorer` checks a plug-in scorer. build: the
    command's builder (`Build`), if it has one."""
    task.check_plugin(build)
    evaluation.check_sets(task, plugins=True, build=build)


def check_local_datasets(task: TaskConfig, evaluation: EvalConfig,
                         build: Build | None = None) -> list[str]:
    """Read every local dataset file the run will use (the training split and each evaluation
    set's) as the run will, so that a missing file, an empty one, one whose rows all lack a
    column the task needs, or one with more malformed rows than task.max_malformed_fraction
    allows is a ValueError naming the field before anything starts. Returns one line per file
    with malformed rows under that share (skipped: the caller says so on the terminal). Hub
    datasets are left to the run (reading them means downloading them); plug-in tasks too
    (their sources are their own). build: the command's builder (`Build`), if it has one."""
    uses = [("task.options", task.name, task.options, task.train_split)]
    uses += [(f"eval.{name}.options", s.task, s.options, s.split)
             for name, s in evaluation.sets(task).items()]
    notes = []
    for field, name, options, split in uses:
        if is_plugin(name):
            continue
        built = (build or build_named)(field.replace("options", "task"), name, field, options)
        notes += check_task_datasets(field, built, [split], task.max_malformed_fraction)
    return notes


def check_task_datasets(field: str, built: Task, splits: list[str],
                        max_malformed_fraction: float,
                        knob: str = "task.max_malformed_fraction") -> list[str]:
    """The local dataset files a built task reads for `splits`: there, not empty, rows in the
    schema, malformed rows within `max_malformed_fraction` (ValueError naming `field` and the
    fix otherwise; `knob` is the setting that raises the share). Returns a line for each file
    with malformed rows it accepts. The one rule for `klrl train` (check_local_datasets) and
    `klrl eval`."""
    notes = []
    for split in splits:
        if not any(source.is_local for source in _sources(built, split)):
            continue
        with counting_rows() as counts:
            try:
                built.problems(split, n=1)
            except FileNotFoundError as e:
                raise ValueError(f"{field} (split {split}): {e}; give an existing .jsonl, .json "
                                 "or .parquet file") from None
            except (ValueError, OSError) as e:  # MalformedRows: empty, or no row in the schema
                raise ValueError(f"{field} (split {split}): {e}") from None
        for count in counts:
            if not count.malformed:
                continue
            said = (f"{field} (split {split}): {count.label}: {count.malformed} of {count.rows} "
                    f"rows malformed (first: {count.first_error})")
            if count.fraction > max_malformed_fraction:
                enough = math.ceil(count.fraction * 100) / 100
                raise ValueError(f"{said}; fix them, or let them be skipped: {knob}={enough:g} "
                                 f"(now {max_malformed_fraction:g})")
            notes.append(f"{said}: skipped ({knob}={max_malformed_fraction:g})")
    return notes


def _sources(task: Task, split: str) -> list:
    """The DatasetSources a built task reads `split` from (none for a generated split)."""
    sources = getattr(task, "sources", None)
    if isinstance(sources, dict):
        return [sources[split]] if split in sources else []
    if isinstance(sources, list):  # mmlu: (source, subject) pairs, read for every split
        return [pair[0] if isinstance(pair, tuple) else pair for pair in sources]
    return []
