"""Pydantic configuration of the rollout workers (`RolloutConfig`) and of the weight sync
from the learner to them (`SyncConfig`).

Who reads what: `actors.rollout_worker.RolloutWorker` reads the sampling, engine and
thread fields; `cluster/` reads `num_workers`, `prompts_per_step` and the Ray resources
(`num_cpus_per_worker`, `num_gpus_per_worker`) when it places and feeds the workers;
`actors.weight_sync` and the learner read `SyncConfig`.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class RolloutConfig(BaseModel):
    """Rollout workers: one Ray actor and one vLLM engine each.

    Sampling defaults are what unbiased RL needs: temperature 1 without top-k/top-p, so the
    sampler's distribution is the policy itself. Any other setting changes the behaviour
    policy mu; the workers then return the log-probs of the distribution actually sampled
    (vLLM's processed log-probs: logits / temperature, top-k/top-p masked, renormalised), and
    those are what every importance ratio divides by.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_workers: int = Field(1, ge=1, le=4096, description="Rollout workers (Ray actors, one "
                             "vLLM engine each). Each generates prompts_per_step / num_workers "
                             "prompts per step.")
    samples_per_prompt: int = Field(8, ge=1, le=4096, description="n: samples per prompt, one "
                                    "group for the group baselines (RLOO/GRPO need n >= 2).")
    prompts_per_step: int = Field(16, ge=1, le=1_000_000, description="Prompts in one global "
                                  "batch (one optimizer step): samples_per_prompt x this rollouts.")
    max_new_tokens: int = Field(64, ge=1, le=1_000_000, description="Longest response; longer ones "
                                "stop with finish_reason 'length'.")
    temperature: float = Field(1.0, gt=0.0, le=100.0, description="Sampling temperature. 1 samples "
                               "the policy itself; other values make the behaviour policy the "
                               "tempered one (its log-probs are returned).")
    top_k: int = Field(-1, ge=-1, le=10_000_000, description="Sample among the k most likely "
                       "tokens; -1 (or 0) = off. When on, the behaviour log-probs are those of "
                       "the renormalised top-k distribution.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass; 1.0 = off. When "
                         "on, the behaviour log-probs are those of the renormalised nucleus.")
    max_model_len: int = Field(512, ge=8, le=10_000_000, description="Context length of the engine "
                               "(prompt + response); at most the model's max_position_embeddings.")
    cpu_kv_cache_gib: float = Field(1.0, gt=0.0, le=4096.0, description="KV cache GiB on CPU "
                                    "(sets VLLM_CPU_KVCACHE_SPACE in the worker); ignored on GPU.")
    gpu_memory_utilization: float = Field(0.5, gt=0.0, le=1.0, description="Share of the GPU's "
                                          "memory the engine may take (weights + KV cache); "
                                          "ignored on CPU. Leave room for a learner on the same GPU.")
    num_cpus_per_worker: float = Field(1.0, gt=0.0, le=1024.0, description="Ray CPUs reserved "
                                       "per worker; also its torch/OpenMP thread count (rounded "
                                       "down, at least 1).")
    num_gpus_per_worker: float = Field(0.0, ge=0.0, le=64.0, description="Ray GPUs per worker: "
                                       "0 on CPU, 1 for one engine per GPU, a fraction to share a "
                                       "GPU with the learner (not with sync.transport nccl).")
    enforce_eager: bool | None = Field(None, description="Disable CUDA graphs / torch.compile. "
                                       "null: True on CPU (no compile start-up cost), False on GPU.")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="Weight and compute dtype of the vLLM engine (vLLM's `dtype`): float32, "
        "bfloat16 or float16. null: learner.dtype, so that sampler and learner compute in the same "
        "precision (vLLM's own 'auto' loads a float32 checkpoint as bfloat16 on GPU, which spreads "
        "the learner/sampler ratios at max_lag 0 to 0.82-1.18; see GPU in the README). float16: "
        "GPUs without bfloat16.")

    def resolved(self, learner_dtype: str) -> RolloutConfig:
        """This config as a run's rollout workers get it: `dtype` null becomes the learner's
        dtype. The one place that default is resolved (`TrainConfig.worker_rollout`)."""
        if self.dtype is not None:
            return self
        return self.model_copy(update={"dtype": learner_dtype})

    @property
    def vllm_top_k(self) -> int:
        """top_k as vLLM 0.32's SamplingParams wants it (0 = off)."""
        return max(0, self.top_k)


class SyncConfig(BaseModel):
    """Weight sync from learner rank 0 to the rollout workers (see actors/weight_sync.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    transport: Literal["shm", "object_store", "nccl"] = Field(
        "shm", description="shm: a safetensors file in shm_dir (learner and workers on one node). "
        "object_store: the safetensors bytes in Ray's object store (any nodes, CPU or GPU). "
        "nccl: GPU only, a broadcast through vLLM's NCCL weight-transfer engine; learner rank 0 "
        "and every worker need a GPU of their own.")
    timeout_s: float = Field(300.0, gt=0.0, le=86_400.0, description="A worker's weight load "
                             "(fetch + reload) that takes longer raises TimeoutError; so does a "
                             "controller waiting on it.")
    shm_dir: str = Field("/dev/shm", min_length=1, description="Directory for the shm transport's "
                         "files (a tmpfs: /dev/shm on Linux). Each run writes klrl-<run_id>/ in "
                         "it and keeps only the newest two versions.")
