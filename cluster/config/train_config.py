"""`TrainConfig`: everything `klrl train` reads, validated before anything starts.

Sub-configs live with the code that reads them (kl.KLConfig, kl.AdvantageConfig,
actors.config.RolloutConfig/SyncConfig, learner.config.LearnerConfig,
rewards.config.TaskConfig/EvalSet/EvalConfig); this module composes them and checks the
constraints that span several of them.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from actors.config import RolloutConfig, SyncConfig
from actors.weight_sync.traits import Placement, transport_traits
from cluster.config.dynamic_sampling import DynamicSamplingConfig
from cluster.config.loader import ConfigError, load_config, top_keys
from cluster.config.names import DirName
from kl.config import AdvantageConfig, KLConfig, check_compatible
from kl.traits import IMPORTANCE_TRAITS
from learner.config import DEFAULT_TOKEN_BUDGET, LearnerConfig
from learner.lr_schedules import STEADY, lr_schedule
from learner.task_term_traits import TASK_TERM_TRAITS
from rewards.config import EvalConfig, TaskConfig
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


class TrainConfig(_Strict):
    """One training run. Keys used by scripts and docs: max_lag, total_steps, seed, kl.*,
    eval_every, checkpoint_every, run_name, output_dir."""

    run_name: DirName | None = Field(None, description="Run directory name under output_dir: "
                                     "letters, digits, '_', '-', '.', not '.' or '..' "
                                     "(cluster/config/names.py); null: derived from the KL "
                                     "config and a timestamp.")
    output_dir: str = Field("runs", min_length=1, description="Parent of run directories.")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Seed for prompts, sampling and init.")
    total_steps: int = Field(100, ge=1, le=10_000_000, description="Optimizer steps to take.")
    max_lag: int = Field(0, ge=0, le=1000, description="Max policy versions between the weights "
                         "that generated a rollout and the learner training on it (0 = on-policy).")
    eval_every: int = Field(20, ge=0, le=10_000_000, description="Evaluate every k steps (and at "
                            "the start and end); 0: only at the start and end.")
    checkpoint_every: int = Field(0, ge=0, le=10_000_000, description="Checkpoint (for "
                                  "`klrl train --resume`) every k steps, and at the end; 0: only "
                                  "when the run is stopped early (signal, worker restarts used "
                                  "up, NaN limit).")
    keep_checkpoints: int = Field(2, ge=1, le=1000, description="Complete checkpoints kept "
                                  "under RUN_DIR/checkpoints (older ones are deleted).")
    hf_every: int = Field(0, ge=0, le=10_000_000, description="Export the policy in Hugging "
                          "Face format (as final/) to RUN_DIR/hf/step_N/ every k steps; 0: only "
                          "final/ at the end.")
    keep_hf: int | None = Field(None, ge=1, le=100_000, description="Newest hf/step_N exports "
                                "kept (older ones are deleted); null: all. Needs hf_every > 0.")
    max_consecutive_nonfinite: int = Field(3, ge=1, le=10_000, description="Stop the run after "
                                           "this many consecutive refused (NaN/inf) steps.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Policy model.")
    task: TaskConfig = Field(default_factory=TaskConfig, description="Training task.")
    data: DataConfig = Field(default_factory=DataConfig, description="Training prompt stream.")
    kl: KLConfig = Field(default_factory=KLConfig, description="KL penalty.")
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig,
                                       description="Task advantage.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Rollout workers.")
    learner: LearnerConfig = Field(default_factory=LearnerConfig, description="Learner ranks.")
    sync: SyncConfig = Field(default_factory=SyncConfig, description="Weight sync.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Evaluation.")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Logging.")
    faults: FaultConfig = Field(default_factory=FaultConfig, description="Fault tolerance.")
    dynamic_sampling: DynamicSamplingConfig = Field(
        default_factory=DynamicSamplingConfig, description="Drop prompt groups without task "
        "reward spread and refill the batch from the stream (DAPO; docs/long-responses.md).")
    ray: RayConfig = Field(default_factory=RayConfig, description="Ray cluster.")

    @model_validator(mode="after")
    def _cross_checks(self) -> TrainConfig:
        prompts, ranks = self.rollout.prompts_per_step, self.learner.num_ranks
        if prompts % ranks:
            raise ValueError(f"rollout.prompts_per_step ({prompts}) must be divisible by "
                             f"learner.num_ranks ({ranks}): each rank trains on whole prompt "
                             "groups")
        if prompts % self.rollout.num_workers:
            raise ValueError(f"rollout.prompts_per_step ({prompts}) must be divisible by "
                             f"rollout.num_workers ({self.rollout.num_workers})")
        # The estimator's table entry (kl.advantage) is the one home of its minimum group size.
        self.advantage.check_group_size(self.rollout.samples_per_prompt,
                                        "rollout.samples_per_prompt")
        check_compatible(self.kl, self.advantage)  # the kl x advantage rules' one home
        self.dynamic_sampling.check(self.advantage, self.rollout.samples_per_prompt)
        self._check_truncated_sampling()
        self._check_overlong()
        # The generation mode's refusals (in-flight updates: max_lag 0, LoRA) are the mode's.
        self.rollout.generation.check_run(max_lag=self.max_lag, lora=self.learner.lora is not None,
                                          multi_turn=self.task.environment.enabled)
        self._check_environment()
        self.eval.check_sets(self.task)  # every evaluated task has its split
        self.data.check(self.task, self.rollout)
        per_rank = prompts // ranks
        if per_rank % self.learner.mini_batches:
            raise ValueError(f"the {per_rank} prompts per learner rank (rollout.prompts_per_step "
                             f"/ learner.num_ranks) must be divisible by learner.mini_batches "
                             f"({self.learner.mini_batches}): each mini-batch holds whole prompt "
                             "groups, the same number on every rank")
        if self.keep_hf is not None and not self.hf_every:
            raise ValueError(f"keep_hf={self.keep_hf} has no effect with hf_every=0 (no "
                             "periodic exports): set hf_every, or drop keep_hf")
        budget = self.eval.max_new_tokens
        if budget is not None and budget >= self.rollout.max_model_len:
            raise ValueError(f"eval.max_new_tokens ({budget}) must be below rollout.max_model_len "
                             f"({self.rollout.max_model_len}): evaluation runs on the rollout "
                             "engines, whose context holds prompt and completion")
        lc, r = self.learner, self.rollout
        transport_traits(self.sync.transport).check(Placement(  # the transport's rules' one home
            learner_ranks=lc.num_ranks, learner_gpus=lc.num_gpus_per_rank,
            num_workers=r.num_workers, worker_gpus=r.num_gpus_per_worker,
            tensor_parallel_size=r.tensor_parallel_size, lora=lc.lora is not None))
        restarts = self.faults.max_worker_restarts
        if restarts and (why := transport_traits(self.sync.transport).why_no_replacement()):
            raise ValueError(
                f"faults.max_worker_restarts={restarts} with sync.transport="
                f"{self.sync.transport}: {why}, so no worker restart could happen. Set "
                "faults.max_worker_restarts=0 (a worker fault then stops the run with its "
                "checkpoint, and `klrl train --resume RUN_DIR` continues it), or use a transport "
                "under which a replaced worker is re-synced: sync.transport: cuda_ipc (workers "
                "on the learner's GPU), shm (one node) or object_store")
        last_step = self.total_steps * self.learner.updates_per_batch
        # The decay runs from step warmup_steps to the last step, total - 1: it needs one step.
        if (lr_schedule(self.learner.lr_schedule).decays
                and self.learner.warmup_steps >= last_step - 1):
            raise ValueError(f"learner.lr_schedule={self.learner.lr_schedule} decays after "
                             f"warm-up, but learner.warmup_steps ({self.learner.warmup_steps}) "
                             f"leaves none of the run's {last_step} optimizer steps to decay "
                             f"over: lower warmup_steps or use lr_schedule {'/'.join(STEADY)}")
        return self

    def _check_overlong(self) -> None:
        """task.overlong's lengths must fit the budget, and masking a truncated sample's task
        term must not silently drop its KL reward (folded into the same advantage)."""
        shaping, budget = self.task.overlong, self.rollout.max_new_tokens
        if shaping.buffer >= budget:
            raise ValueError(f"task.overlong.buffer ({shaping.buffer}) must be below "
                             f"rollout.max_new_tokens ({budget}): it is the last part of that "
                             "budget where the length penalty grows")
        if shaping.mask_truncated and self.kl.folds_into_advantage:
            raise ValueError(
                f"task.overlong.mask_truncated with kl.kl_in_advantage="
                f"{self.kl.kl_in_advantage} (the KL reward folded into the advantage) would "
                "mask a truncated sample's KL reward with its task term: set "
                "kl.kl_in_advantage=separate, where the KL term stays, or drop the mask")

    def _check_truncated_sampling(self) -> None:
        """rollout.top_k / top_p sample a truncated mu with no mass where pi has some: no
        ratio pi/mu recovers pi from it (E_mu[pi/mu f] = E_pi[f on the kept tokens]), so every
        importance correction would claim an exactness it does not have. Refused; the
        regularised policy is then the learner's untruncated pi, estimated from truncated
        samples without correction (docs/kl.md, sampling)."""
        r = self.rollout
        if r.vllm_top_k == 0 and r.top_p >= 1.0:
            return
        what = " and ".join(([f"rollout.top_k={r.top_k}"] if r.vllm_top_k else [])
                            + ([f"rollout.top_p={r.top_p:g}"] if r.top_p < 1.0 else []))
        if IMPORTANCE_TRAITS[self.kl.importance].reweights:
            raise ValueError(f"kl.importance={self.kl.importance} with {what}: truncated "
                             "sampling gives the sampler no mass where the policy has some, "
                             "and no importance ratio recovers the policy from it; use "
                             "kl.importance=none, or sample without top_k / top_p")
        if TASK_TERM_TRAITS[self.learner.task_off_policy].uses_ratio:
            raise ValueError(f"learner.task_off_policy={self.learner.task_off_policy} with "
                             f"{what}: its ratios pi/mu are the kept mass of each truncated "
                             "distribution (below 1 even on-policy), not an importance "
                             "correction; use learner.task_off_policy=none, or sample "
                             "without top_k / top_p")

    @property
    def reserved_cpus(self) -> float:
        """Ray CPUs the run reserves: its rollout workers, its learner ranks and its
        environment actors (task.environment.pool)."""
        r, lc = self.rollout, self.learner
        return (r.num_workers * r.num_cpus_per_worker + lc.num_ranks * lc.num_cpus_per_rank
                + self.environment_cpus)

    @property
    def environment_cpus(self) -> float:
        """Ray CPUs of the environment actors (task.environment.pool), every worker's."""
        env = self.task.environment
        if not (env.enabled and env.pool.enabled):
            return 0.0
        return self.rollout.num_workers * env.pool.actors_per_worker * env.pool.cpus_per_actor

    @property
    def learner_may_share_a_gpu(self) -> bool:
        """Whether Ray may put a learner rank on a GPU a rollout worker's engine uses: both
        request a fraction of a GPU and the two fractions fit in one (Ray packs them), or the
        learner is on a GPU and the worker requests none (Ray 2.60 does not hide the node's
        GPUs from it, so a CUDA engine starts on one anyway). The run's start order reads it
        (cluster/train/launch.py, `start_engines_and_learner`)."""
        learner, worker = self.learner.num_gpus_per_rank, self.rollout.num_gpus_per_worker
        if learner == 0:
            return False
        return worker == 0 or (learner < 1 and worker < 1 and learner + worker <= 1 + 1e-9)

    def _all_cpus_among(self, parts: int) -> int:
        """The thread rule's share (rollout.threads_per_worker, learner.threads_per_rank when
        null): every CPU the run reserves, among `parts`. At max_lag 0 generation and training
        alternate, so the parts of each phase share them all. At max_lag >= 1 the phases
        overlap: the workers keep their own reservation (`worker_rollout`), and the learner
        ranks, training being the costlier phase on CPU, still share every CPU, waiting
        passively so that the workers get the cores whenever training leaves them
        (`rank_learner`): with OpenMP's default spinning, or with the workers on every core too,
        the shared cores gain nothing. docs/bench.md has the measurements. The environment
        actors' CPUs are theirs, not the engines' or the ranks'."""
        return max(1, int((self.reserved_cpus - self.environment_cpus) / parts))

    @property
    def worker_rollout(self) -> RolloutConfig:
        """`rollout` as the rollout workers get it: its dtype resolved against learner.dtype,
        its threads by the thread rule (`RolloutConfig.resolved`)."""
        r = self.rollout
        threads = r.threads_per_worker or (
            self._all_cpus_among(r.num_workers) if self.max_lag == 0 else r.threads)
        return r.resolved(self.learner.dtype, threads)

    @property
    def rank_learner(self) -> LearnerConfig:
        """`learner` as the learner ranks get it: threads_per_rank by the thread rule and
        omp_wait_policy resolved (`_all_cpus_among`), token_budget resolved (null:
        DEFAULT_TOKEN_BUDGET or the longest allowed sequence, 0 beside micro_batch_size)."""
        lc = self.learner
        threads = lc.threads_per_rank or self._all_cpus_among(lc.num_ranks)
        wait = lc.omp_wait_policy or (
            "passive" if self.max_lag >= 1 and threads > lc.num_cpus_per_rank else "default")
        budget = lc.token_budget
        if budget is None:
            budget = 0 if lc.micro_batch_size else max(DEFAULT_TOKEN_BUDGET,
                                                       self.longest_sequence)
        return lc.model_copy(update={"threads_per_rank": threads, "omp_wait_policy": wait,
                                     "token_budget": budget})

    @property
    def longest_sequence(self) -> int:
        """The longest prompt + response a rollout can make: data.max_prompt_length +
        rollout.max_new_tokens where the prompt limit is set (within the engine's context),
        else the engine's context, rollout.max_model_len."""
        limit, r = self.data.max_prompt_length, self.rollout
        return (min(limit + r.max_new_tokens, r.max_model_len) if limit is not None
                else r.max_model_len)

    def _check_environment(self) -> None:
        """Limits a multi-turn episode (task.environment) can keep: a turn's budget within the
        episode's (rollout.max_new_tokens), which the context check below fits in the
        engine's context; and no option that reads a sample as one completion."""
        env, r = self.task.environment, self.rollout
        if not env.enabled:
            return
        if env.max_tokens_per_turn > r.max_new_tokens:
            raise ValueError(f"task.environment.max_tokens_per_turn ({env.max_tokens_per_turn}) "
                             f"must be at most rollout.max_new_tokens ({r.max_new_tokens}), the "
                             "whole episode's budget after the prompt (the policy's turns and "
                             "the environment's replies): lower one or raise the other")
        if self.task.reward:
            raise ValueError(f"task.reward ({self.task.reward}) with task.environment "
                             f"({env.name}): the environment gives the episode's reward; drop "
                             "one of them")

    @model_validator(mode="after")
    def _completion_fits_the_context(self) -> TrainConfig:
        """The engine's context (rollout.max_model_len) holds prompt and completion, so the
        completion budget must leave room for a prompt of at least one token; vLLM would
        otherwise cut every completion at the context, not at max_new_tokens."""
        r = self.rollout
        if r.max_new_tokens >= r.max_model_len:
            raise ValueError(f"rollout.max_new_tokens ({r.max_new_tokens}) must be below "
                             f"rollout.max_model_len ({r.max_model_len}), the engine's context, "
                             "which holds the prompt too: lower one or raise the other")
        return self

    @model_validator(mode="after")
    def _token_budget_holds_a_sequence(self) -> TrainConfig:
        """learner.token_budget must hold the longest sequence a rollout can make: a longer
        one would overrun the memory the budget promises (the learner puts it in a micro-batch
        of its own rather than drop it)."""
        budget, limit = self.learner.token_budget, self.data.max_prompt_length
        longest = self.longest_sequence
        if budget and budget < longest:
            said = ("data.max_prompt_length + rollout.max_new_tokens" if limit is not None
                    and longest < self.rollout.max_model_len else "rollout.max_model_len")
            raise ValueError(f"learner.token_budget ({budget}) is below the longest sequence a "
                             f"rollout can make ({longest}, {said}): raise it to at least "
                             f"{longest}, or lower {said.split(' + ')[-1]}")
        return self


# The keys every sweep file has (cluster/sweeps/sweep.py's SweepConfig requires them) and
# no training config: a file with both, refused as a training config, is named a sweep file.
SWEEP_FILE_KEYS = frozenset({"train_config", "grid"})


def load_train_config(path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:
    """The TrainConfig of a YAML file (None: the defaults) with `key=value` overrides. A sweep
    file given instead is refused as one, with the command that runs it."""
    try:
        return load_config(TrainConfig, path, overrides)
    except ConfigError:
        if path is not None and SWEEP_FILE_KEYS <= top_keys(path):
            raise ConfigError(
                f"{path} is a sweep file (it has {' and '.join(sorted(SWEEP_FILE_KEYS))}), not "
                f"a training config: run it with `klrl sweep {path}` (on a Ray cluster with "
                f"--address URL; on SLURM `klrl slurm {path} --sweep`), or give the training "
                "config it names in train_config") from None
        raise
