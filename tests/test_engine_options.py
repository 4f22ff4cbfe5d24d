"""The rollout engine options (rollout.tensor_parallel_size, max_num_seqs,
max_num_batched_tokens, enable_prefix_caching, engine_kwargs; model.revision and
trust_remote_code): each bad input is refused before anything starts with one line naming
the field and the fix, and what the engine is built with. The live engine with these options
is tested in tests/test_rollout_worker.py (one engine start); tensor parallelism needs two
GPUs (`test_tensor_parallel_worker_gpu`, marked gpu)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from actors.config import RolloutConfig, SyncConfig
from actors.engine import llm_kwargs
from actors.rollout_worker import engine_options
from cluster.config.loader import ConfigError, load_config
from cluster.config.train_config import TrainConfig

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.yaml"
GPU = ["learner.num_gpus_per_rank=1"]


@pytest.mark.parametrize("overrides, message", [
    (["rollout.tensor_parallel_size=2"],
     "rollout.tensor_parallel_size=2 needs GPUs: on CPU (rollout.num_gpus_per_worker=0)"),
    (GPU + ["rollout.tensor_parallel_size=2", "rollout.num_gpus_per_worker=1"],
     "rollout.num_gpus_per_worker (1) must equal rollout.tensor_parallel_size (2)"),
    (GPU + ["rollout.num_gpus_per_worker=2"],
     "rollout.num_gpus_per_worker (2) must equal rollout.tensor_parallel_size (1)"),
    (GPU + ["rollout.tensor_parallel_size=2", "rollout.num_gpus_per_worker=0.5"],
     "rollout.num_gpus_per_worker (0.5) must equal rollout.tensor_parallel_size (2)"),
    (["rollout.tensor_parallel_size=0"], "rollout.tensor_parallel_size: Input should be greater"),
    (["rollout.max_num_seqs=0"], "rollout.max_num_seqs: Input should be greater"),
    (["rollout.max_num_batched_tokens=200"],
     ("below vLLM's default max_num_seqs (256 on CPU), which vLLM refuses: set "
      "rollout.max_num_seqs <= 200 too")),
    (GPU + ["rollout.num_gpus_per_worker=1", "rollout.max_num_batched_tokens=200"],
     "below vLLM's default max_num_seqs (256; 1024 on GPUs of 70 GiB or more)"),
    (["rollout.max_num_seqs=64", "rollout.max_num_batched_tokens=32"],
     "rollout.max_num_batched_tokens (32) must be at least rollout.max_num_seqs (64)"),
    (["rollout.max_num_seqs=8", "rollout.max_num_batched_tokens=256"],
     ("rollout.max_num_batched_tokens (256) must be at least rollout.max_model_len (512) "
      "without chunked prefill (off on CPU)")),
    (GPU + ["rollout.num_gpus_per_worker=1", "rollout.max_num_seqs=8",
            "rollout.max_num_batched_tokens=256",
            "rollout.engine_kwargs.enable_chunked_prefill=false"],
     "must be at least rollout.max_model_len (512)"),
    (["rollout.engine_kwargs.enable_chunked_prefill=true"],
     "rollout.engine_kwargs.enable_chunked_prefill=true is refused on CPU"),
    (["rollout.engine_kwargs.max_num_seqs=4"],
     "rollout.engine_kwargs: 'max_num_seqs' is set by klrl: use rollout.max_num_seqs"),
    (["rollout.engine_kwargs.seed=1", "rollout.engine_kwargs.revision=main"],
     "'seed' is set by klrl: use seed; 'revision' is set by klrl: use model.revision"),
    (["rollout.engine_kwargs.logprobs_mode=raw_logprobs"],
     "'logprobs_mode' is set by klrl: klrl needs processed_logprobs"),
    (["rollout.engine_kwargs.distributed_executor_backend=ray"],
     "use rollout.tensor_parallel_size"),
])
def test_bad_engine_options_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(TrainConfig, TINY, overrides)
    lines = str(e.value).splitlines()
    assert len(lines) == 2 and message in lines[1], str(e.value)
    assert "(from the override" in lines[1]


def test_good_engine_options_load_and_reach_the_engine_arguments():
    """What a worker's engine is built with (`engine_options` -> `llm_kwargs`, pure), on CPU
    and on GPU: tensor parallelism with the mp executor, null options left to vLLM, chunked
    prefill off on CPU only, engine_kwargs passed unchanged."""
    gpu = load_config(TrainConfig, TINY, GPU + [
        "rollout.tensor_parallel_size=2", "rollout.num_gpus_per_worker=2",
        "rollout.max_num_seqs=64", "rollout.max_num_batched_tokens=128",
        "rollout.enable_prefix_caching=false", "rollout.engine_kwargs.kv_cache_dtype=fp8",
        "model.revision=v2", "model.trust_remote_code=true"])
    options = engine_options(gpu.worker_rollout, gpu.sync, gpu.seed, revision=gpu.model.revision,
                             trust_remote_code=gpu.model.trust_remote_code)
    options.pop("cpu_kvcache_gib")  # make_llm sets it as an environment variable
    kwargs = llm_kwargs("Org/model", cpu=False, **options)
    assert {k: kwargs[k] for k in ("tensor_parallel_size", "distributed_executor_backend",
                                   "max_num_seqs", "max_num_batched_tokens",
                                   "enable_prefix_caching", "kv_cache_dtype", "revision",
                                   "trust_remote_code", "logprobs_mode")} == {
        "tensor_parallel_size": 2, "distributed_executor_backend": "mp", "max_num_seqs": 64,
        "max_num_batched_tokens": 128, "enable_prefix_caching": False, "kv_cache_dtype": "fp8",
        "revision": "v2", "trust_remote_code": True, "logprobs_mode": "processed_logprobs"}
    assert "enable_chunked_prefill" not in kwargs  # vLLM's default on GPU

    cpu = load_config(TrainConfig, TINY, [])
    options = engine_options(cpu.worker_rollout, cpu.sync, cpu.seed)
    options.pop("cpu_kvcache_gib")
    kwargs = llm_kwargs("model", cpu=True, **options)
    assert kwargs["enable_chunked_prefill"] is False and kwargs["enable_prefix_caching"] is True
    for left_to_vllm in ("tensor_parallel_size", "distributed_executor_backend", "max_num_seqs",
                         "max_num_batched_tokens", "revision", "trust_remote_code"):
        assert left_to_vllm not in kwargs


def test_a_setting_the_generation_mode_also_sets_reaches_the_engine_once():
    """In-flight updates set async_scheduling false themselves; the user writing the same in
    engine_kwargs (the natural knob on a GPU) gave the engine the key twice, a TypeError when
    the worker started. It is one key, the mode's value, and a contradicting value is refused
    at load."""
    cfg = load_config(TrainConfig, TINY, [
        "max_lag=1", "rollout.in_flight_updates=true",
        "rollout.engine_kwargs.async_scheduling=false",
        "rollout.engine_kwargs.kv_cache_dtype=auto"])
    options = engine_options(cfg.worker_rollout, cfg.sync, cfg.seed)
    options.pop("cpu_kvcache_gib")
    kwargs = llm_kwargs("model", cpu=True, **options)
    assert kwargs["async_scheduling"] is False and kwargs["kv_cache_dtype"] == "auto"
    with pytest.raises(ConfigError, match="async_scheduling=true is refused"):
        load_config(TrainConfig, TINY, ["max_lag=1", "rollout.in_flight_updates=true",
                                        "rollout.engine_kwargs.async_scheduling=true"])


def test_unknown_engine_kwargs_are_refused_before_the_run_starts():
    """A key the installed vLLM's engine does not take fails the pre-flight (before Ray,
    the tiny model or any engine), with the closest key; known keys pass."""
    from cluster.train.door.preflight import check_environment

    cfg = load_config(TrainConfig, TINY, ["rollout.engine_kwargs.max_num_seq=3",
                                          "rollout.engine_kwargs.block_size=32",
                                          "rollout.engine_kwargs.zzz_not_an_option=1"])
    with pytest.raises(ConfigError) as e:
        check_environment(cfg)
    message = str(e.value)
    assert len(message.splitlines()) == 1
    assert message.startswith("rollout.engine_kwargs: 'max_num_seq' is not an argument of vLLM ")
    assert "(did you mean 'max_num_seqs'?)" in message
    assert "'zzz_not_an_option' is not an argument" in message and "block_size" not in message
    check_environment(load_config(TrainConfig, TINY, ["rollout.engine_kwargs.block_size=32"]))


def test_tensor_parallel_with_nccl_sync_is_refused_before_start():
    """The NCCL weight-transfer group has one rank per worker: the config refuses a
    tensor-parallel worker with sync.transport=nccl (no GPU needed to see it)."""
    overrides = ["rollout.tensor_parallel_size=2", "rollout.num_gpus_per_worker=2",
                 "learner.num_gpus_per_rank=1", "learner.dtype=bfloat16", "sync.transport=nccl"]
    with pytest.raises(ConfigError, match="sync.transport=nccl supports "
                                          "rollout.tensor_parallel_size=1 only"):
        load_config(TrainConfig, TINY, overrides)
    load_config(TrainConfig, TINY, [*overrides[:-1], "sync.transport=object_store"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA GPUs")
def test_tensor_parallel_worker_gpu(tiny_model_dir, tmp_path):
    """GPU only, not run on CPU machines: a worker with tensor_parallel_size 2 holds two
    GPUs (one per rank, vLLM's mp executor inside the actor), samples with the HF
    log-probs (fp32 on both sides: within the ~2% engine/learner mismatch the README's GPU
    section measured), and a weight load reaches both ranks."""
    import ray
    from transformers import AutoModelForCausalLM

    import rewards
    from actors.rollout_worker import RolloutWorker
    from test_weight_sync import publisher
    from rewards.config import TaskConfig

    def hf(seed=None):
        model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
        if seed is not None:  # a (fake) learner step: every parameter moved by seeded noise
            g = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.05 * p.abs().mean() * torch.randn(p.shape, generator=g))
        return model.eval()

    def worst_error(model, batch):
        worst = 0.0
        for r in batch.rollouts:
            with torch.no_grad():
                logits = model(torch.tensor([r.prompt_ids + r.response_ids])).logits[0]
            p = len(r.prompt_ids)
            lp = logits[p - 1: p - 1 + len(r.response_ids)].float().log_softmax(-1)
            ref = lp.gather(1, torch.tensor(r.response_ids)[:, None])[:, 0]
            worst = max(worst, (ref - torch.tensor(r.behaviour_logprobs)).abs().max().item())
        return worst

    started = ray.is_initialized()
    if not started:
        ray.init(include_dashboard=False, log_to_driver=False)
    cfg = RolloutConfig(samples_per_prompt=2, max_new_tokens=8, max_model_len=128,
                        tensor_parallel_size=2, num_gpus_per_worker=2,
                        gpu_memory_utilization=0.3, dtype="float32")
    w = ray.remote(RolloutWorker).options(num_gpus=2).remote(
        str(tiny_model_dir), cfg, SyncConfig(), TaskConfig())
    try:
        from test_rollout_worker import engine_settings

        settings = engine_settings(w, ["tensor_parallel_size", "distributed_executor_backend"])
        assert settings == {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
        assert len(set(ray.get(w.cuda_device_uuids.remote()))) == 2  # two GPUs, one per rank
        problems = rewards.get_task("arithmetic").problems("train", 4, seed=1)
        batch = ray.get(w.generate.remote(problems, list(range(4)), 3))
        assert worst_error(hf(), batch) < 0.05
        target = hf(seed=7)
        update = publisher(tmp_path, "tp-gpu").publish(target.state_dict(), 1, "shm")
        assert ray.get(w.load_weights.remote(update)) == 1
        assert worst_error(target, ray.get(w.generate.remote(problems, list(range(4)), 3))) < 0.05
    finally:
        ray.kill(w)
        if not started:
            ray.shutdown()
