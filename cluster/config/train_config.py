"""`TrainConfig`: everything `klrl train` reads, validated before anything starts.

Sub-configs live with the code that reads them (kl.KLConfig, kl.AdvantageConfig,
actors.config.RolloutConfig/SyncConfig, learner.config.LearnerConfig,
rewards.config.TaskConfig/EvalSet/EvalConfig); this module composes them and checks the
constraints that span several of them.
"""
from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from actors.config import RolloutConfig, SyncConfig
from actors.weight_sync.traits import Placement, transport_traits
from cluster.config.dynamic_sampling import DynamicSamplingConfig
from cluster.config.loader import ConfigError, load_config, top_keys
from cluster.config.names import DirName
from cluster.config.sections import (
    DataConfig,
    FaultConfig,
    LoggingConfig,
    ModelConfig,
    RayConfig,
    _Strict,
)
from kl.config import AdvantageConfig, KLConfig, check_compatible
from kl.traits import IMPORTANCE_TRAITS
from learner.config import DEFAULT_TOKEN_BUDGET, LearnerConfig
from learner.lr_schedules import STEADY, lr_schedule
from learner.task_term_traits import TASK_TERM_TRAITS
from rewards.config import EvalConfig, TaskConfig


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
