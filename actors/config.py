"""Pydantic configuration of the rollout workers (`RolloutConfig`) and of the weight sync
from the learner to them (`SyncConfig`).

Who reads what: `actors.rollout_worker.RolloutWorker` reads the sampling, engine and
thread fields; `cluster/` reads `num_workers`, `prompts_per_step` and the Ray resources
(`num_cpus_per_worker`, `num_gpus_per_worker`) when it places and feeds the workers;
`actors.weight_sync` and the learner read `SyncConfig`.

The engine fields are checked here as far as they can be without vLLM (the GPU rule of
tensor parallelism, what vLLM's scheduler would refuse at start-up, engine_kwargs keys that
klrl sets itself); whether an engine_kwargs key exists in the installed vLLM needs vLLM and is
checked before a run starts by `actors.engine.unknown_engine_args`
(cluster/train/door/preflight.py).
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from actors.generation import GenerationMode, StaleKv, generation_mode
from actors.weight_sync.traits import TransportName, describe

# vLLM 0.32's default max_num_seqs of an offline engine (`LLM`): 256 on CPU and on most GPUs,
# 1024 on GPUs with 70 GiB or more (H100, H200, B200), which the config cannot know. vLLM
# refuses max_num_batched_tokens below max_num_seqs, so a max_num_batched_tokens below the
# default needs max_num_seqs too: the config refuses what every device refuses (below 256).
VLLM_DEFAULT_MAX_NUM_SEQS = 256

# `engine_kwargs` keys that klrl sets itself, each with the option to use instead (or why klrl
# fixes it). A key here in engine_kwargs would either clash with klrl's own value or silently
# break an invariant (behaviour log-probs, weight reload, one engine = the worker's GPUs).
ENGINE_KWARGS_SET_BY_KLRL: dict[str, str] = {
    "model": "use model.path",
    "tokenizer": "the engine uses model.path's tokenizer, as the learner does",
    "revision": "use model.revision",
    "tokenizer_revision": "use model.revision (the tokenizer follows the model, as the "
                          "learner's does)",
    "trust_remote_code": "use model.trust_remote_code",
    "seed": "use seed",
    "dtype": "use rollout.dtype",
    "max_model_len": "use rollout.max_model_len",
    "enforce_eager": "use rollout.enforce_eager",
    "gpu_memory_utilization": "use rollout.gpu_memory_utilization",
    "tensor_parallel_size": "use rollout.tensor_parallel_size",
    "distributed_executor_backend": "klrl runs tensor-parallel ranks with 'mp' inside the "
                                    "worker's actor; use rollout.tensor_parallel_size",
    "pipeline_parallel_size": "a rollout worker is one engine on its own GPUs; use "
                              "rollout.tensor_parallel_size, or more rollout.num_workers",
    "data_parallel_size": "a rollout worker is one engine; use rollout.num_workers",
    "max_num_seqs": "use rollout.max_num_seqs",
    "max_num_batched_tokens": "use rollout.max_num_batched_tokens",
    "enable_prefix_caching": "use rollout.enable_prefix_caching",
    "logprobs_mode": "klrl needs processed_logprobs, the log-probs of the distribution "
                     "actually sampled, which every importance ratio divides by",
    "worker_extension_cls": "klrl's weight reload is that extension",
    "weight_transfer_config": "use sync.transport",
}


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
    gpu_memory_utilization: float = Field(0.5, gt=0.0, le=1.0, description="Share of the whole "
                                          "GPU's memory this engine may take (weights, "
                                          "activations, KV cache); ignored on CPU. vLLM counts "
                                          "it per engine against the GPU's total and refuses to "
                                          "start with less free: on a GPU of the engine's own "
                                          "raise it (0.85-0.9; 0.5 leaves half the GPU unused), "
                                          "on a shared one keep every engine's share plus the "
                                          "learner's memory under the whole (docs/gpu.md).")
    num_cpus_per_worker: float = Field(1.0, gt=0.0, le=1024.0, description="Ray CPUs reserved "
                                       "per worker.")
    threads_per_worker: int | None = Field(None, ge=1, le=1024, description="torch/OpenMP "
                                           "threads of each worker's engine. null: at max_lag 0 "
                                           "the run's reserved CPUs shared among the workers "
                                           "(generation and training alternate, so each phase "
                                           "can use every core); at max_lag >= 1 its own "
                                           "num_cpus_per_worker, rounded down, at least 1.")
    num_gpus_per_worker: float = Field(0.0, ge=0.0, le=64.0, description="Ray GPUs per worker: "
                                       "0 on CPU, 1 for one engine per GPU, a fraction to share a "
                                       "GPU with the learner (not with sync.transport nccl; "
                                       "required by cuda_ipc).")
    enforce_eager: bool | None = Field(None, description="Disable CUDA graphs / torch.compile. "
                                       "null: True on CPU (no compile start-up cost), False on "
                                       "GPU.")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="Weight and compute dtype of the vLLM engine (vLLM's `dtype`): float32, "
        "bfloat16 or float16. null: learner.dtype, so that sampler and learner compute in the same "
        "precision (vLLM's own 'auto' loads a float32 checkpoint as bfloat16 on GPU, which spreads "
        "the learner/sampler ratios at max_lag 0 to 0.82-1.18; see docs/gpu.md). float16: "
        "GPUs without bfloat16. On GPUs bfloat16 (with learner.dtype bfloat16) is the fast "
        "choice: float32 gives up FlashAttention 3 and bf16 tensor cores for exactness.")
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="vLLM tensor parallelism "
                                      "inside one worker: its engine shards the model over this "
                                      "many GPUs. GPU only (1 on CPU); above 1, "
                                      "num_gpus_per_worker must equal it (one whole GPU per rank).")
    max_num_seqs: int | None = Field(None, ge=1, le=1_000_000, description="Most sequences the "
                                     "engine decodes at once (vLLM's max_num_seqs); more wait "
                                     "their turn. null: vLLM's default (256 on CPU and most "
                                     "GPUs, 1024 on 70+ GiB GPUs).")
    max_num_batched_tokens: int | None = Field(
        None, ge=1, le=10_000_000, description="Most tokens (prompt + decode) in one engine "
        "step (vLLM's max_num_batched_tokens); at least max_num_seqs, and on CPU at least "
        "max_model_len (klrl turns chunked prefill off there). null: vLLM's default.")
    enable_prefix_caching: bool = Field(True, description="Reuse the KV cache of prompt "
                                        "prefixes already computed (vLLM's automatic prefix "
                                        "caching; the samples of one prompt share its blocks). "
                                        "The cache is reset after every weight load, so it never "
                                        "serves KV of older weights.")
    in_flight_updates: bool = Field(False, description="Workers generate continuously (new "
                                    "requests join the running batch as others finish) and take "
                                    "each weight update between two engine steps while requests "
                                    "are in flight: none is dropped or restarted. Each response "
                                    "token then carries the policy version that sampled it, and "
                                    "the oldest token's version is the sample's policy_version. "
                                    "Off: a worker generates a whole batch with one version.")
    stale_kv: StaleKv = Field(
        "recompute", description="What happens to the KV cache of the requests in flight at a "
        "weight update (with in_flight_updates only). recompute: every running request is "
        "preempted and its prefix recomputed with the new weights, so each token is sampled by "
        "exactly one policy version (the exact choice). keep: the prefix's KV computed by the "
        "old weights stays, and later tokens are sampled by the new weights over that cache; "
        "their log-probs are still exactly what sampled them. keep needs "
        "enable_prefix_caching false, so that no new request reuses KV of older weights.")
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="More keyword arguments for vllm.LLM (vLLM's "
        "EngineArgs, e.g. {kv_cache_dtype: fp8, block_size: 32}), passed unchanged. Keys klrl "
        "sets from other options are refused, naming that option; unknown keys are refused "
        "before the run starts.")

    @field_validator("engine_kwargs")
    @classmethod
    def _no_klrl_keys(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        if clash := [k for k in kwargs if k in ENGINE_KWARGS_SET_BY_KLRL]:
            raise ValueError("; ".join(f"{k!r} is set by klrl: {ENGINE_KWARGS_SET_BY_KLRL[k]}"
                                       for k in clash))
        return kwargs

    @model_validator(mode="after")
    def _engine_rules(self) -> RolloutConfig:
        tp, gpus = self.tensor_parallel_size, self.num_gpus_per_worker
        # The GPU rule of tensor parallelism: each rank is one whole GPU of the worker's Ray
        # request (vLLM's mp executor runs the ranks on the GPUs Ray gave the actor), so
        # a worker with tp > 1 asks for exactly tp GPUs; a fraction serves one rank only.
        if tp > 1 and gpus == 0:
            raise ValueError(f"rollout.tensor_parallel_size={tp} needs GPUs: on CPU "
                             "(rollout.num_gpus_per_worker=0) an engine runs one rank; use 1, "
                             "and more rollout.num_workers to use more cores")
        if (tp > 1 or gpus > 1) and gpus != tp:
            raise ValueError(f"rollout.num_gpus_per_worker ({gpus:g}) must equal "
                             f"rollout.tensor_parallel_size ({tp}) when either is above 1: each "
                             "tensor-parallel rank takes one whole GPU of its worker")
        cpu = gpus == 0
        seqs, tokens = self.max_num_seqs, self.max_num_batched_tokens
        if tokens is not None:
            if seqs is not None and tokens < seqs:
                raise ValueError(f"rollout.max_num_batched_tokens ({tokens}) must be at least "
                                 f"rollout.max_num_seqs ({seqs}) (vLLM refuses less)")
            if seqs is None and tokens < VLLM_DEFAULT_MAX_NUM_SEQS:
                raise ValueError(f"rollout.max_num_batched_tokens ({tokens}) is below vLLM's "
                                 f"default max_num_seqs ({VLLM_DEFAULT_MAX_NUM_SEQS}"
                                 f"{' on CPU' if cpu else '; 1024 on GPUs of 70 GiB or more'})"
                                 f", which vLLM refuses: set rollout.max_num_seqs <= {tokens} too")
            chunked = self.engine_kwargs.get("enable_chunked_prefill", not cpu)
            if not chunked and tokens < self.max_model_len:
                raise ValueError(f"rollout.max_num_batched_tokens ({tokens}) must be at least "
                                 f"rollout.max_model_len ({self.max_model_len}) without chunked "
                                 "prefill (off on CPU): a prompt is prefilled in one step")
        # The generation mode's rules (stale_kv, and what continuous generation needs of the
        # engine) are the mode's (actors/generation/).
        self.generation.check(enable_prefix_caching=self.enable_prefix_caching,
                              engine_kwargs=self.engine_kwargs)
        if cpu and self.engine_kwargs.get("enable_chunked_prefill"):
            raise ValueError("rollout.engine_kwargs.enable_chunked_prefill=true is refused on CPU "
                             "(rollout.num_gpus_per_worker=0): vLLM-cpu 0.32 crashes on a seeded "
                             "request whose prompt is split, and every klrl request is seeded")
        return self

    def resolved(self, learner_dtype: str, threads: int) -> RolloutConfig:
        """This config as a run's rollout workers get it: `dtype` null becomes the learner's
        dtype, and the threads are `threads` (TrainConfig's rule, which keeps a set
        threads_per_worker). The one place these are resolved (`TrainConfig.worker_rollout`)."""
        return self.model_copy(update={"dtype": self.dtype or learner_dtype,
                                       "threads_per_worker": threads})

    @property
    def threads(self) -> int:
        """The engine's torch/OpenMP threads: threads_per_worker once resolved, else the
        Ray CPUs reserved (rounded down, at least 1)."""
        return self.threads_per_worker or max(1, int(self.num_cpus_per_worker))

    @property
    def generation(self) -> GenerationMode:
        """The generation mode in_flight_updates picks, with stale_kv (actors/generation/):
        everything that differs between modes asks it."""
        return generation_mode(self.in_flight_updates, self.stale_kv)

    @property
    def vllm_top_k(self) -> int:
        """top_k as vLLM 0.32's SamplingParams wants it (0 = off)."""
        return max(0, self.top_k)


class SyncConfig(BaseModel):
    """Weight sync from learner rank 0 to the rollout workers: which transport
    (actors/weight_sync/, whose traits.py gives the names and their descriptions, without
    torch) and its settings. The rules that span other sections (GPUs, learner ranks, LoRA) are each
    transport's `check`, which TrainConfig calls."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    transport: TransportName = Field("shm", description=describe())
    timeout_s: float = Field(300.0, gt=0.0, le=86_400.0, description="A worker's weight load "
                             "(fetch + reload) that takes longer raises TimeoutError; so does a "
                             "controller waiting on it, counted from when the load could start. "
                             "A worker that then does not answer a probe (frozen) is replaced "
                             "instead, as a hung one (one restart).")
    shm_dir: str = Field("/dev/shm", min_length=1, description="Directory for the shm transport's "
                         "files (a tmpfs: /dev/shm on Linux). Each run writes klrl-<run_id>/ in "
                         "it and keeps only the newest two versions.")
