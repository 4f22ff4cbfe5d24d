"""The sections of a run's config that no other package owns: the model (`model:`), the
prompt stream (`data:`), logging, faults and Ray's resources. `TrainConfig`
(cluster/config/train_config.py) composes them with the sections that live beside the code
that reads them.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from actors.config import RolloutConfig
from rewards.config import TaskConfig
from rewards.records import Task
from rewards.registry import get_task, is_plugin

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# The embedded tiny models a null model.path can mean; cluster/tiny/model.py's RECIPES holds one
# recipe per name (tests/test_tiny_model.py checks the two agree).
EmbeddedModel = Literal["arith", "arith-retain"]


class ModelConfig(_Strict):
    """The policy model, the reference the KL penalty pulls toward, and how both are loaded
    (by the learner ranks with transformers and by the rollout engines with vLLM)."""

    path: str | None = Field(None, min_length=1, description="Hugging Face model directory (or hub "
                             "name on a cluster). null: the embedded tiny arithmetic model named "
                             "by `embedded`, built once by `klrl init-model` and cached.")
    embedded: EmbeddedModel = Field("arith", description="Which embedded tiny model a null `path` "
                                    "means: `arith` (the default, taught the task's addition "
                                    "and subtraction) or `arith-retain` (also taught the "
                                    "multiplication facts of the arithmetic task's `retained` "
                                    "split, which no rewarded split holds, so that `eval.retained` "
                                    "measures forgetting; docs/model.md). Refused beside a `path`.")
    ref_path: str | None = Field(None, min_length=1, description="Reference model of the KL "
                                 "penalty, when it is not the initial policy (e.g. an SFT model "
                                 "while the policy starts from another checkpoint): a Hugging "
                                 "Face model directory or hub name with the policy's tokenizer. "
                                 "null: the policy's own starting weights.")
    revision: str | None = Field(None, min_length=1, max_length=200, description="Hub revision "
                                 "(branch, tag or commit) of `path` and `ref_path`, for the "
                                 "learner and the rollout engines alike; null: the default "
                                 "branch. Ignored for local directories.")
    trust_remote_code: bool = Field(False, description="Let transformers and vLLM run the "
                                    "model's own Python code (models whose architecture is not "
                                    "in transformers). Off by default: that code runs on every "
                                    "node.")

    @model_validator(mode="after")
    def _embedded_only_without_path(self) -> ModelConfig:
        # Another embedded model beside a path is refused; the default beside one is what every
        # run's saved config.yaml holds (all fields written), and must load again.
        if self.path is not None and self.embedded != "arith":
            raise ValueError("model.embedded names an embedded model, which model.path replaces: "
                             "set one of them")
        return self


class DataConfig(_Strict):
    """How the training prompt stream (cluster/train/prompts.py) reads the task's train split:
    a prompt length filter, and epochs over a finite split (a dataset)."""

    max_prompt_length: int | None = Field(
        None, ge=1, le=10_000_000, description="Longest training prompt in tokens, as the "
        "rollout workers render it (chat template and system prompt included, the policy's "
        "tokenizer); longer ones are dropped before generation and counted "
        "(data/prompts_filtered). null: no limit.")
    shuffle: bool = Field(True, description="Each epoch of a dataset split goes through its "
                          "rows in a new order, seeded by (seed, epoch); false: in file order, "
                          "every epoch. A generated task (no rows, no order) refuses false.")
    epochs: int | None = Field(None, ge=1, le=1_000_000, description="Passes over a dataset "
                               "split: the run ends when they are used up (the last, fewer than "
                               "a batch, prompts unused) or at total_steps, whichever comes "
                               "first. null: total_steps alone ends it. A generated task (no "
                               "end) refuses it.")

    def check(self, task: TaskConfig, rollout: RolloutConfig) -> None:
        """ValueError, naming the field, for a data option the training task cannot take or a
        prompt limit the engine's context cannot hold. A plug-in task is not imported here
        (configs load where it may not be installed): pre-flight calls `check_task` for it."""
        if not is_plugin(task.name):
            self.check_task(task)
        limit = self.max_prompt_length
        if limit is not None and limit + rollout.max_new_tokens > rollout.max_model_len:
            raise ValueError(
                f"data.max_prompt_length ({limit}) + rollout.max_new_tokens "
                f"({rollout.max_new_tokens}) must fit in rollout.max_model_len "
                f"({rollout.max_model_len}), the engine's context: lower one or raise "
                "rollout.max_model_len")

    def check_task(self, task: TaskConfig, built: Task | None = None) -> None:
        """ValueError when data.epochs or data.shuffle=false is set for a generated split.
        built: the task, when the caller has built it already (the door)."""
        given = ([("data.epochs", self.epochs)] if self.epochs is not None else []) + (
            [] if self.shuffle else [("data.shuffle", "false")])
        if given and not (built or get_task(task.name, **task.options)).is_finite(
                task.train_split):
            field, value = given[0]
            raise ValueError(
                f"{field}={value}: task {task.name!r} split {task.train_split!r} is generated "
                "(drawn at random without end), so it has no epochs and no file order; drop "
                f"{field}, or train on a dataset split (see task.options)")


class LoggingConfig(_Strict):
    """wandb and the local run directory."""

    wandb_mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="null: the WANDB_MODE environment variable, else offline (no account "
        "needed).")
    wandb_project: str = Field("klrl", min_length=1, description="wandb project.")
    wandb_entity: str | None = Field(None, pattern=r"^[\w\-]+$", max_length=128,
                                     description="wandb team or user the run is logged under; "
                                     "null: wandb's default entity (that of the API key).")
    wandb_group: str | None = Field(None, description="wandb group (sweeps set it).")
    wandb_name: str | None = Field(None, min_length=1, max_length=128, description="Display "
                                   "name of the wandb run; null: the run directory's name. A "
                                   "resumed run keeps its wandb run (by id) whatever its name.")
    tags: list[str] = Field(default_factory=list, description="wandb tags.")
    samples_every: int = Field(20, ge=0, le=10_000_000, description="Every k steps, append "
                               "sample generations of that step's batch to RUN_DIR/samples.jsonl "
                               "and wandb's `samples` table (docs/logging.md); "
                               "0: never.")
    samples_per_log: int = Field(8, ge=1, le=10_000, description="Rows per samples table: the "
                                 "first rollouts of the step's batch, whole prompt groups in "
                                 "order (fewer if the batch holds fewer).")
    no_signal_steps: int = Field(20, ge=0, le=10_000_000, description="Warn, in the run's log "
                                 "and in wandb, once the task advantage has been zero for this "
                                 "many steps in a row (every reward 0, or every prompt group's "
                                 "rewards equal: nothing to learn under a group baseline), with "
                                 "what to check; 0: never.")


class FaultConfig(_Strict):
    """How the controller rides out faults of rollout workers and learner ranks (see
    docs/checkpoints.md, "what survives what"). Every wait on a part has a deadline derived
    from the run's own measured times (cluster/train/deadlines.py): `hang_multiple` x the
    median of the recent waits of its kind, at least `hang_floor_s` (`hang_startup_s` for the
    first `hang_startup_waits`), at most the part's ceiling. When it passes, a part that does
    not answer (or, in a train step, has made no progress within the deadline) is hung; a
    live one is waited on up to the ceiling. A rollout worker's engine is watched apart from
    that: one step under way past `engine_stall_s` is a wedged worker."""

    max_worker_restarts: int = Field(3, ge=0, le=10_000, description="Rollout-worker restarts "
                                     "allowed over the whole run (a worker that dies or hangs is "
                                     "replaced and re-synced); one more failure stops the run with "
                                     "a checkpoint.")
    max_learner_restarts: int = Field(2, ge=0, le=1000, description="Learner restarts allowed "
                                      "over the whole run: a rank that dies, hangs or fails a "
                                      "call tears the learner group down, and the run goes on "
                                      "from its last complete checkpoint (from step 0 without "
                                      "one) with a new group and re-synced rollout workers. One "
                                      "more failure stops the run. Low because at max_lag 0 a "
                                      "replay is exact: a fault the data causes (an OOM on one "
                                      "long batch) recurs on every replay.")
    hang_multiple: float = Field(5.0, ge=1.5, le=1000, description="A wait's deadline is this "
                                 "multiple of the median duration of the recent waits of its "
                                 "kind (train step, weight publish, checkpoint, generate, "
                                 "evaluate, ...), measured in this run. When it passes, a part "
                                 "that does not answer, or a learner rank that made no progress "
                                 "within it, is hung.")
    hang_floor_s: float = Field(60.0, gt=0, le=86_400, description="No deadline is shorter "
                                "(short steps: a pause of the machine, a garbage collection).")
    hang_startup_s: float = Field(600.0, gt=0, le=86_400, description="The deadline of a kind "
                                  "of wait before hang_startup_waits of it are measured: "
                                  "start-up (engines, learner set-up) and the first steps.")
    hang_startup_waits: int = Field(3, ge=1, le=1000, description="Waits of a kind measured "
                                    "before their median sets its deadline.")
    engine_stall_s: float = Field(300.0, ge=1, le=86_400, description="A rollout worker whose "
                                  "engine has been in one step this long during a generate or "
                                  "evaluate call is hung (wedged), although its process answers: "
                                  "replaced as a frozen one is. A healthy step takes milliseconds "
                                  "to seconds (a long prefill); 5 minutes is far above any, and "
                                  "catches a wedge long before generate_timeout_s.")
    generate_timeout_s: float = Field(3600.0, gt=0, le=86_400, description="Ceiling of a "
                                      "rollout worker's deadlines: a generation or evaluation "
                                      "request (or a worker start) that takes longer, live or "
                                      "not, counts as hung: the worker is killed and replaced.")
    learner_timeout_s: float = Field(3600.0, gt=0, le=86_400, description="Ceiling of the "
                                     "learner's deadlines (set-up, train step, weight publish, "
                                     "checkpoint): a call that takes longer, live or not, "
                                     "is hung (a learner restart). Also the process group's "
                                     "timeout, so a stuck collective raises in the ranks.")


# Resources Ray defines itself, and the options that request them (None: klrl does not).
_BUILTIN_RESOURCES = {
    "CPU": "rollout.num_cpus_per_worker / learner.num_cpus_per_rank",
    "GPU": "rollout.num_gpus_per_worker / learner.num_gpus_per_rank",
    "memory": None,
    "object_store_memory": None,
}


class RayConfig(_Strict):
    """How to reach Ray, and which nodes the actors may run on. RAY_ADDRESS in the environment
    overrides `address`."""

    address: str | None = Field(None, description="Existing cluster address (e.g. 'auto'); null "
                                "starts a local cluster.")
    num_cpus: int | None = Field(None, ge=1, le=100_000, description="Logical CPUs of a local "
                                 "cluster (null: what the actors request, at least the machine's).")
    worker_resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources each rollout worker requests, "
        "e.g. {node2: 1}: workers then run only on nodes started with `ray start "
        "--resources='{\"node2\": 1}'`. {}: none (placed by CPUs and GPUs alone). Checked "
        "against the cluster's nodes when the run starts.")
    learner_resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources each learner rank requests, e.g. "
        "{head: 1} to keep the learner on the head node; as ray.worker_resources.")

    @field_validator("worker_resources", "learner_resources")
    @classmethod
    def _custom_resources(cls, value: dict[str, float]) -> dict[str, float]:
        # Ray's own rules for a resource request, checked here so that a typo fails at load
        # time rather than when the first actor is created.
        for name, amount in value.items():
            if name in _BUILTIN_RESOURCES:
                option = _BUILTIN_RESOURCES[name]
                raise ValueError(f"{name!r} is one of Ray's own resources, not a custom one"
                                 + (f": request it with {option}" if option else
                                    " (klrl does not request it)"))
            if not name.strip():
                raise ValueError("a resource needs a name")
            if not 0 < amount <= 1_000_000:
                raise ValueError(f"{name}={amount:g}: a request must be above 0 (and at most 1e6)")
            if amount > 1 and not float(amount).is_integer():
                raise ValueError(f"{name}={amount:g}: Ray takes fractions only below 1; "
                                 "above 1 a request must be a whole number")
        return value
