"""In-flight weight updates on a GPU (marked gpu; NOT run yet: no GPU has been lent since it
was written). vLLM 0.26 runs dense models on its Model Runner V2 there (seeded Gumbel sampling
keyed by seed and position; a preempted request re-sent as a new one), which the CPU tests of
tests/test_continuous.py never reach. One rollout worker on the tiny model, fp32, generating
continuously; an update to far-away weights lands through the shm transport while its requests
run. The test fails unless requests really were in flight at the update (samples whose tokens
span both versions, each preempted by it: `stale_kv: recompute`) and unless every token carries
the log-prob of the version it is tagged with, against HF transformers on the whole prefix, to
the GPU's fp32 numerics (docs/gpu.md: about 0.02), where the two versions differ by far more,
and unless the engine ran on Model Runner V2."""
from __future__ import annotations

import pytest
import torch
from test_continuous import (
    BUDGET,
    N,
    TASK,
    _logprobs,
    _perturbed,
    _Probe,
    _spanning,
    _stop,
    _update_in_flight,
)
from test_weight_sync import GPU_FP32_TOL, load_hf

from actors.config import RolloutConfig, SyncConfig

ray = pytest.importorskip("ray")

VERSIONS_APART = 0.2  # the two versions' log-probs differ by more on some later token


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_an_update_lands_in_flight_and_every_token_keeps_its_versions_log_prob(
        ray_cluster, tiny_model_dir, tmp_path):
    import rewards

    cfg = RolloutConfig(samples_per_prompt=N, max_new_tokens=BUDGET, max_model_len=512,
                        in_flight_updates=True, num_gpus_per_worker=0.5,
                        gpu_memory_utilization=0.3, dtype="float32")
    sync = SyncConfig(transport="shm", timeout_s=60, shm_dir=str(tmp_path))
    worker = ray.remote(concurrency_groups={"generate": 2})(_Probe).options(
        num_gpus=0.5).remote(str(tiny_model_dir), cfg, sync, TASK, worker_index=1)
    problems = rewards.get_task("arithmetic").problems("train", 2, seed=3)
    models = {0: load_hf(tiny_model_dir), 1: _perturbed(tiny_model_dir, seed=2)}
    try:
        batch = _update_in_flight(worker, problems, 12, models[1], 1, tmp_path)
        stats = ray.get(worker.engine_stats.remote())
        facts = ray.get(worker.engine_facts.remote())
    finally:
        _stop(worker)
    # what this test is for: Model Runner V2 (vllm/v1/worker/gpu/), which vLLM 0.26 was read
    # to pick for dense models on a GPU; where it did not, the test says so rather than pass
    assert all(f["use_v2_model_runner"] or ".v1.worker.gpu." in (f["model_runner"] or "")
               for f in facts), facts
    spanning = _spanning(batch, 0, 1)  # fails where nothing was in flight at the update
    assert stats["updates"] == 1 and stats["preempted"] >= len(spanning), stats
    assert len(spanning) <= batch.preempted <= len(batch.rollouts)  # what the run logs
    for r in batch.rollouts:
        tagged = torch.tensor(r.token_versions)
        want = torch.where(tagged == 0, _logprobs(models[0], r), _logprobs(models[1], r))
        got = torch.tensor(r.behaviour_logprobs)
        assert (got - want).abs().max().item() < GPU_FP32_TOL, r.token_versions
    # The check can fail: on the later tokens of a spanning sample the versions differ by far
    # more than the tolerance, so a token tagged with the wrong version would show.
    apart = max((_logprobs(models[0], r) - _logprobs(models[1], r))[
        torch.tensor(r.token_versions) == 1].abs().max().item() for r in spanning)
    assert apart > VERSIONS_APART
