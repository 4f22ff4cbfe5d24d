"""Multi-turn episodes, token in and token out (issue 66, items 1-2): the environment
interface and its refusals, the episode loop on the real vLLM engine of the tiny model, and the
trained sequence checked against the sampled one token for token.

The engine tests share the session's `tiny_llm` and drive it through the batch-level driver the
rollout worker uses (actors/generation/batch.py), with the worker's own SamplingParams."""
from __future__ import annotations

import concurrent.futures
import math
from pathlib import Path

import pytest
import torch

from actors.config import RolloutConfig
from actors.engine import request_params
from actors.generation.batch import BatchDriver
from actors.multi_turn import EpisodeRunner
from actors.records import Rollout
from cluster.train.batching import pad_rollouts
from rewards import Problem, get_task
from rewards.calculator import CalculatorEnvironment, evaluate, score_calculator
from rewards.config import EnvironmentConfig
from rewards.environment import EnvStep, Turn, check_reply, environment_class
from rewards.environment import EnvFailure

from env_plugins import REPLY

BUDGET = 80
ROOT = Path(__file__).resolve().parents[1]


def _problems(k: int) -> list[Problem]:
    return [Problem(uid=f"t/{i}", task="t", split="train", prompt=f"{i}+{i}=", answer=str(2 * i))
            for i in range(k)]


def _run(llm, cfg: EnvironmentConfig, problems, *, n=2, seed=7, record=None, renderer=None,
         budget=BUDGET, runner=None):
    """The rollouts of one generate call with `cfg`'s environment on `llm`, and (in `record`)
    each engine call's token prompts and sampled ids. renderer: how prompts are rendered (a
    PromptRenderer, as the rollout worker's; None: raw text on the engine's tokenizer).
    runner: an EpisodeRunner of `cfg` to reuse (its environment pool); None: a new one."""
    tokenizer = llm.get_tokenizer() if renderer is None else renderer.tokenizer
    runner = runner or EpisodeRunner(cfg, tokenizer, budget)
    rollout_cfg = RolloutConfig(samples_per_prompt=n, max_new_tokens=budget)
    params = request_params(rollout_cfg, seed, 0, len(problems))
    prompts = ([{"prompt_token_ids": list(tokenizer(p.prompt)["input_ids"])} for p in problems]
               if renderer is None else renderer.prompts(problems))
    driver = _Recording(llm, concurrent.futures.ThreadPoolExecutor(1), version=0)
    driver.record = record
    return runner.run(driver, problems, list(range(len(problems))), prompts, params,
                      worker=0, version=0).rollouts


class _Recording(BatchDriver):
    """The batch-level driver the worker uses, keeping each call's token prompts and sampled
    ids (in `record`, when set)."""

    record: list | None = None

    def generate(self, prompts, params, *, min_version, serving):
        out = super().generate(prompts, params, min_version=min_version, serving=serving)
        if self.record is not None:
            self.record.append(([r["prompt_token_ids"] for r in prompts],
                                [[list(c.token_ids) for c in done] for done in out.completions]))
        return out


def _chatter(**kw) -> EnvironmentConfig:
    return EnvironmentConfig(**({"name": "env_plugins:Chatter", "max_turns": 4,
                                 "max_tokens_per_turn": 4} | kw))


@pytest.fixture(scope="module")
def chat_renderer(tiny_model_dir):
    """The tiny model's tokenizer with tests/test_chat_template.py's chat template and system
    prompt, rendering as the rollout worker does (same weights: `tiny_llm` runs its ids)."""
    from test_chat_template import SYSTEM, TEMPLATE
    from transformers import AutoTokenizer

    from actors.prompting import PromptRenderer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tok.chat_template = TEMPLATE
    return PromptRenderer(tok, chat_template="auto", system_prompt=SYSTEM)


@pytest.mark.parametrize("env", ["env_plugins:Chatter", "env_plugins:ChatterIds",
                                 "env_plugins:TemplateChatter"])
def test_the_trained_sequence_is_the_sampled_one_token_for_token(tiny_llm, tiny_model_dir,
                                                                  chat_renderer, env):
    """Every engine call is given exactly the ids so far (prompt, the policy's sampled ids, the
    environment's reply ids); the batch the learner trains holds those ids, with the reply
    tokens out of response_mask and the policy's log-probs where the policy sampled; and the
    model's own log-probs of the trained row equal the sampler's on every policy token, which a
    single changed token before it would break. TemplateChatter: prompts rendered with a chat
    template and system prompt, replies in the template's tool turns."""
    record: list = []
    chat = env.endswith("TemplateChatter")
    rollouts = _run(tiny_llm, _chatter(name=env), _problems(2), record=record,
                    renderer=chat_renderer if chat else None)
    assert len(rollouts) == 4 and len(record) == 3  # three turns, every episode alive
    tokenizer = tiny_llm.get_tokenizer()
    reply = ([5, 6, 7] if env.endswith("Ids")
             else tokenizer.encode("\n<|tool|><ok>\n<|assistant|>" if chat else REPLY,
                                   add_special_tokens=False))
    if chat:
        assert rollouts[0].prompt_ids == chat_renderer.token_ids(rollouts[0].problem.prompt)
        assert "<|system|>" in tokenizer.decode(rollouts[0].prompt_ids)
    for k, r in enumerate(rollouts):
        assert r.env_failure is None and r.finish_reason == "stop" and r.turns == 3
        assert r.env_replies == 2 and r.env_info == {"tool_call": 2.0}
        # rebuild the trajectory from what the engine was given and sampled
        expected, mask = [], []
        for turn, (sent, sampled) in enumerate(record):
            assert sent[k] == r.prompt_ids + expected  # token in: the exact prefix
            expected += sampled[k][0]
            mask += [True] * len(sampled[k][0])
            if turn < 2:
                expected += reply
                mask += [False] * len(reply)
        assert r.response_ids == expected and r.policy_mask == mask
        assert r.reward == float(len(record[2][1][k][0]))
    batch = pad_rollouts(rollouts, [0.0] * len(rollouts), pad_id=0, version=0)
    for i, r in enumerate(rollouts):
        p, n = len(r.prompt_ids), len(r.response_ids)
        assert batch.input_ids[i, : p + n].tolist() == r.prompt_ids + r.response_ids
        assert batch.response_mask[i, p: p + n].tolist() == r.policy_mask
        assert not batch.response_mask[i, :p].any() and not batch.response_mask[i, p + n:].any()
    _check_logprobs(tiny_model_dir, batch)


def _check_logprobs(model_dir, batch) -> None:
    """The HF model's log-probs of the trained rows equal the sampler's on policy tokens (fp32,
    the engine's dtype on CPU)."""
    from transformers import AutoModelForCausalLM

    from learner.loss import sequence_logprobs

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logp = sequence_logprobs(logits, batch.input_ids)
    m = batch.response_mask
    assert torch.allclose(logp[m], batch.behaviour_logp[m], atol=2e-3)
    assert (batch.behaviour_logp[~m] == 0).all()


def test_a_broken_environment_costs_its_sample_with_the_reason(tiny_llm):
    """An environment that raises, hangs past the turn timeout or answers garbage fails the
    samples of that problem, each with its reason; the other problem's episodes run on."""
    faults = {"/1": "raises", "/2": "hangs", "/3": "garbage"}
    cfg = _chatter(name="env_plugins:Faulty", options={"faults": faults}, turn_timeout_s=0.5)
    rollouts = _run(tiny_llm, cfg, _problems(4))
    good, bad = rollouts[:2], rollouts[2:]
    assert all(r.env_failure is None and r.finish_reason == "stop" for r in good)
    reasons = ["exception: RuntimeError: the tool crashed", "timeout: no answer within 0.5 s",
               "invalid_reply: step returned a dict, not an EnvStep"]
    assert [r.env_failure for r in bad] == [x for x in reasons for _ in range(2)]
    assert all(r.reward == 0 for r in bad)


def test_the_pool_replaces_a_hung_or_dead_actor_and_costs_only_its_samples(tiny_llm,
                                                                          ray_cluster):
    """task.environment.pool: episodes are dealt to two environment actors in turn (problem
    i, one sample each: actor i % 2). A call past the timeout costs its sample, and its
    actor is replaced, costing the samples whose environments were on it; an actor that dies
    costs its samples the same way; the replacements serve the next call."""
    faults = {"/1": "hangs", "/2": "raises", "/5": "exits"}
    cfg = _chatter(name="env_plugins:Faulty", options={"faults": faults}, turn_timeout_s=2,
                   pool={"actors_per_worker": 2, "cpus_per_actor": 0, "concurrency": 2})
    runner = EpisodeRunner(cfg, tiny_llm.get_tokenizer(), BUDGET)
    try:
        first = _run(tiny_llm, cfg, _problems(4), n=1, runner=runner)
        assert first[0].env_failure is None and first[0].finish_reason == "stop"
        assert first[1].env_failure == "timeout: no answer within 2 s"
        assert first[2].env_failure == "exception: RuntimeError: the tool crashed"
        assert first[3].env_failure.startswith("actor_lost: its environment actor was replaced")
        second = _run(tiny_llm, cfg, _problems(8)[4:], n=1, runner=runner)
        assert [r.env_failure is None for r in second] == [True, False, True, False]
        assert all(r.env_failure.startswith("actor_lost: its environment actor died")
                   for r in second[1::2]), [r.env_failure for r in second]
        third = _run(tiny_llm, cfg, _problems(10)[8:], n=1, runner=runner)
        assert all(r.env_failure is None and r.finish_reason == "stop" for r in third)
        assert runner.envs.replaced == 2 and all(r.env_seconds > 0 for r in third)
    finally:
        runner.shutdown()


def test_a_rollout_worker_runs_its_episodes_in_its_environment_pool(ray_cluster,
                                                                    tiny_model_dir):
    """RolloutWorker as a Ray actor with an environment in a pool of one actor: episodes with
    replies out of the policy mask come back through `generate`."""
    import ray
    from test_rollout_worker import TASK, _start, _stop

    env = EnvironmentConfig(name="env_plugins:Chatter", max_turns=3, max_tokens_per_turn=3,
                            pool={"actors_per_worker": 1, "cpus_per_actor": 0})
    worker = _start(tiny_model_dir, task=TASK.model_copy(update={"environment": env}))
    try:
        batch = ray.get(worker.generate.remote(_problems(2), [0, 1], 7))
        hosts = ray.get(worker.__ray_call__.remote(lambda w: len(w.episodes.envs.hosts)))
    finally:
        _stop(worker)
    assert hosts == 1 and len(batch.rollouts) == 8
    for r in batch.rollouts:
        assert r.env_failure is None and r.turns >= 2 and r.env_replies >= 1
        assert 0 < r.policy_mask.count(False) <= r.env_replies * len(REPLY)


def test_limits_cut_the_episode_by_turns_and_by_the_total_budget(tiny_llm):
    by_turns = _run(tiny_llm, _chatter(max_turns=2), _problems(1))
    assert [(r.finish_reason, r.turns) for r in by_turns] == [("turns", 2)] * 2
    long_turns = _run(tiny_llm, _chatter(max_tokens_per_turn=30), _problems(1), budget=40)
    assert "length" in {r.finish_reason for r in long_turns}
    for r in long_turns:  # a cut episode fills the budget exactly, a reply cut to fit
        assert len(r.response_ids) == 40 if r.finish_reason == "length" else \
            len(r.response_ids) < 40


# ---------------------------------------------------------------- pure: no engine


def test_environment_tokens_are_attended_but_out_of_the_trained_mask():
    p = _problems(1)[0]
    r = Rollout(problem=p, group_id=0, prompt_ids=[1, 2], response_ids=[10, 11, 12, 13, 14],
                behaviour_logprobs=[-1.0, -2.0, -3.0], policy_version=3, finish_reason="stop",
                policy_mask=[True, False, False, True, True])
    batch = pad_rollouts([r], [1.0], pad_id=0, version=5)
    assert batch.response_mask[0].tolist() == [False, False, True, False, False, True, True]
    assert batch.attention_mask[0].tolist() == [1] * 7
    assert batch.behaviour_logp[0].tolist() == [0, 0, -1, 0, 0, -2, -3]
    assert batch.token_lags[0].tolist() == [0, 0, 2, 0, 0, 2, 2]
    with pytest.raises(ValueError, match="3 policy tokens but 2 behaviour"):
        Rollout(problem=p, group_id=0, prompt_ids=[1], response_ids=[1, 2, 3],
                behaviour_logprobs=[-1.0, -1.0], policy_version=0, finish_reason="stop",
                policy_mask=[True, True, True])
    with pytest.raises(ValueError, match="policy_mask entries"):
        Rollout(problem=p, group_id=0, prompt_ids=[1], response_ids=[1, 2],
                behaviour_logprobs=[-1.0], policy_version=0, finish_reason="stop",
                policy_mask=[True])


def test_check_reply_refuses_garbage():
    assert check_reply(EnvStep(reply="x"), 10).reply == "x"
    for bad, why in [("x", "not an EnvStep"), (EnvStep(reply_ids=[3, 99]), "token ids"),
                     (EnvStep(done=True), "done without a reward"),
                     (EnvStep(done=True, reward=math.nan), "not a finite"),
                     (EnvStep(reply="a", reply_ids=[1]), "both")]:
        with pytest.raises(EnvFailure, match=why):
            check_reply(bad, 10)


def test_the_environment_must_import_and_have_the_interface():
    assert environment_class("calculator") is CalculatorEnvironment
    for name, why in [("env_plugins:NoStep", "does not implement step"),
                      ("env_plugins:NotAnEnvironment", "not a subclass"),
                      ("no_such_module:Env", "cannot import"), ("calculatr", "unknown")]:
        with pytest.raises(ValueError, match=why):
            environment_class(name)
    with pytest.raises(ValueError, match="cannot be built"):
        EnvironmentConfig(name="calculator", options={"nope": 1})


def test_the_calculator_answers_calls_and_scores_the_final_answer():
    task = get_task("calculator", terms=3, digits=3)
    problem = task.problems("train", 1, seed=0)[0]
    a, b, c = problem.metadata["numbers"]
    env = CalculatorEnvironment()
    env.reset(problem)
    call = f"[{a}+{b}+{c}]"
    out = env.step(Turn(text=call, token_ids=(), index=0, finish_reason="stop"))
    assert out.reply == f"{a + b + c}\n" and not out.done and out.info["tool_call_valid"] == 1
    assert env.step(Turn(text="[1+x]", token_ids=(), index=1, finish_reason="stop")).reply == "?\n"
    end = env.step(Turn(text=problem.answer, token_ids=(), index=2, finish_reason="stop"))
    assert end.done and end.reward == 1.0
    assert env.step(Turn(text="12", token_ids=(), index=2, finish_reason="stop")).reward == 0.0
    assert evaluate("1+2-3") == 0 and evaluate("1*2") is None
    assert score_calculator(f"{call}{problem.answer}\n{problem.answer}", problem) == 1.0
    assert score_calculator(problem.answer, problem) == 1.0


def _tiny_calculator(*overrides):
    from cluster.config.loader import load_config
    from cluster.config.train_config import TrainConfig

    return load_config(TrainConfig, ROOT / "configs" / "tiny_cpu_calculator.yaml", list(overrides))


def test_the_door_refuses_what_multi_turn_cannot_hold():
    from cluster.config.loader import ConfigError
    from cluster.train.door.tasks import check_plugins_of

    cfg = _tiny_calculator()
    assert cfg.task.environment.name == "calculator"
    for bad, why in [
            (["rollout.in_flight_updates=true", "max_lag=1"], "batch-level only"),
            (["task.environment.max_tokens_per_turn=49"], "at most rollout.max_new_tokens"),
            (["task.reward=scorers:short_answers"], "the environment gives the episode's reward"),
            (["task.environment.name=calculatr"], "unknown environment"),
            (["rollout.max_new_tokens=600"], "must be below rollout.max_model_len")]:
        with pytest.raises(ConfigError, match=why):
            _tiny_calculator(*bad)
    for name, why in [("env_plugins:NoStep", "does not implement step"),
                      ("klrl_no_such_module:Env", "cannot import")]:
        with pytest.raises(ConfigError, match=f"task.environment: .*{why}"):
            check_plugins_of(_tiny_calculator(f"task.environment.name={name}"))


def test_the_environment_actors_cpus_are_requested_and_not_the_engines():
    from cluster.config.loader import ConfigError
    from cluster.train.door.resources import check_local_resources

    pool = ["task.environment.pool.actors_per_worker=2", "task.environment.pool.cpus_per_actor=1"]
    plain, pooled = _tiny_calculator("ray.num_cpus=2"), _tiny_calculator("ray.num_cpus=2", *pool)
    assert pooled.reserved_cpus == plain.reserved_cpus + 2 and pooled.environment_cpus == 2
    assert pooled.worker_rollout.threads == plain.worker_rollout.threads
    check_local_resources(plain)
    with pytest.raises(ConfigError, match=r"2 x task.environment.pool.cpus_per_actor=1"):
        check_local_resources(pooled)


def test_the_bench_environment_part_configures_renders_and_checks():
    """`klrl bench --only environment` (cluster/bench/environment.py): its settings are valid
    run configs, its environment ends after TURNS turns, and its figures are rendered and
    required. (The measurement itself runs with `klrl bench --quick --only environment`.)"""
    from cluster.bench import environment as bench_env
    from cluster.bench.report import _environment_table
    from cluster.bench.results import check_result, default_parts
    from cluster.config.loader import DEMO_CONFIG
    from cluster.config.train_config import load_train_config

    base = load_train_config(DEMO_CONFIG, [])
    for delay_s, actors in bench_env.SETTINGS.values():
        env = bench_env.environment_config(base, delay_s, actors).task.environment
        assert env.pool.actors_per_worker == actors and env.options == {"delay_s": delay_s}
    answering = bench_env.Answering()
    answering.reset(_problems(1)[0])
    turn = Turn(text="x", token_ids=(1,), index=0, finish_reason="stop")
    steps = [answering.step(turn) for _ in range(bench_env.TURNS)]
    assert [x.done for x in steps] == [False] * (bench_env.TURNS - 1) + [True]
    assert "environment" not in default_parts("cpu") + default_parts("cuda")
    setting = {"samples_per_s": 2.0, "environment_share": 0.25, "outside_engine_share": 0.5,
               "turns_mean": 3.0}
    result = {"device": "cpu", "workloads": {}, "parts": {"environment": {}},
              "environment": {"delay_ms": 50, "samples": 16, "ratio_threads": 0.9,
                              "ratio_pool": 0.8, "settings": {"instant": setting}}}
    assert check_result(result) == []
    table = "\n".join(_environment_table(result["environment"]))
    assert "threads **0.90**, pool **0.80**" in table and "| instant | 2.00 | 25% | 50%" in table
    assert check_result(result | {"environment": {}}) == ["environment"]


def _rollout(group: int, failure: str | None = None, **kw) -> Rollout:
    p = _problems(1)[0]
    return Rollout(problem=p, group_id=group, prompt_ids=[1], response_ids=[4, 5, 6],
                   behaviour_logprobs=[-1.0, -1.0], policy_version=0,
                   finish_reason=kw.pop("finish_reason", "stop"), env_failure=failure,
                   policy_mask=[True, False, True], **kw)


def test_a_failed_sample_costs_its_group_and_too_many_stop_the_run():
    from cluster.train.episodes import EnvironmentFailing, EpisodeBook

    book = EpisodeBook(EnvironmentConfig(name="calculator", max_failure_share=0.2))
    warned: list[str] = []
    batch = [_rollout(0, turns=2, env_replies=1, env_info={"tool_call": 1.0}),
             _rollout(0, finish_reason="turns"), _rollout(1, "timeout: no answer within 5 s"),
             _rollout(1), _rollout(2, finish_reason="length"), _rollout(2)]
    kept, metrics = book.take(batch, warned.append)
    assert [r.group_id for r in kept] == [0, 0, 2, 2]
    assert "'calculator' failed 1 of 6 samples ({'timeout': 1}" in warned[0]
    assert metrics["env/failures"] == 1 and metrics["env/dropped_samples"] == 2
    assert metrics["env/tool_call_rate"] == pytest.approx(1 / 6)
    assert metrics["env/turns_mean"] == pytest.approx(7 / 6)
    assert metrics["env/truncated_turns_frac"] == metrics["env/truncated_length_frac"]
    assert metrics["env/info/tool_call"] == pytest.approx(1 / 6)
    assert metrics["env/policy_tokens_mean"] == 2
    with pytest.raises(EnvironmentFailing, match="'calculator' failed 3 of the run's 12"):
        book.take([_rollout(3, "exception: E: x"), _rollout(3, "exception: E: x"),
                   *[_rollout(4)] * 4])


def test_the_failure_count_survives_a_checkpoint(tmp_path):
    """A resumed run keeps counting the environment's failed share from the checkpoint's
    counts (ControllerState.env_samples, env_failures; the controller saves and restores
    them): its share is the run's, not the resumed part's."""
    from cluster.train import checkpoint as ckpt
    from cluster.train.episodes import EnvironmentFailing, EpisodeBook

    cfg = EnvironmentConfig(name="calculator", max_failure_share=0.2)
    book = EpisodeBook(cfg)
    book.take([_rollout(0, "timeout: t"), *[_rollout(0)] * 3, *[_rollout(1)] * 6],
              lambda _: None)
    state = ckpt.ControllerState(step=1, prompt_position=3, env_samples=book.samples,
                                 env_failures=book.failures)
    saved = ckpt.write_checkpoint(tmp_path, state, lambda d, tag: (d / tag).mkdir(), keep=1)
    resumed = ckpt.read_checkpoint(saved)
    assert (resumed.env_samples, resumed.env_failures) == (10, 1)
    batch = [_rollout(2, "timeout: t"), *[_rollout(2)] * 3]  # 1 of 4 alone: above the share
    again = EpisodeBook(cfg)
    again.restore(resumed.env_samples, resumed.env_failures)
    _, metrics = again.take(batch, lambda _: None)  # the run's 2 of 14: within it
    assert metrics["env/failures_total"] == 2
    assert metrics["env/failure_share"] == pytest.approx(2 / 14)
    with pytest.raises(EnvironmentFailing, match="failed 1 of the run's 4"):
        EpisodeBook(cfg).take(batch, lambda _: None)


def _docs_blocks(kind: str) -> list[str]:
    text = (ROOT / "docs" / "multi-turn.md").read_text()
    return [b.split("```", 1)[0] for b in text.split(f"```{kind}\n")[1:]]


def _flatten(tree: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out += _flatten(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}={value}")
    return out


def test_the_docs_worked_example_runs(tiny_llm, tmp_path, monkeypatch):
    """docs/multi-turn.md's environment, as written, runs episodes on the real engine, and its
    YAML passes the config's checks."""
    import yaml

    from cluster.config.loader import load_config
    from cluster.config.train_config import TrainConfig

    (tmp_path / "my_envs.py").write_text(_docs_blocks("python")[0])
    monkeypatch.syspath_prepend(str(tmp_path))
    overrides = _flatten(yaml.safe_load(_docs_blocks("yaml")[0]))
    cfg = load_config(TrainConfig, ROOT / "configs" / "tiny_cpu.yaml", overrides)
    env = cfg.task.environment
    assert (env.name, env.max_turns, env.max_tokens_per_turn) == ("my_envs:TryAgain", 3, 8)
    rollouts = _run(tiny_llm, env.model_copy(update={"max_tokens_per_turn": 4}), _problems(2))
    for r in rollouts:
        assert r.env_failure is None and 1 <= r.turns <= 3
        assert r.finish_reason in ("stop", "turns")
        assert r.env_replies == r.turns - 1  # the last turn gets no reply
        assert r.reward == (1.0 - 0.25 * (r.turns - 1) if r.finish_reason == "stop" else 0.0)


def test_turn_seeds_start_at_the_samples_own_and_differ_by_turn():
    from actors.seeds import MAX_SEED, turn_seed

    assert turn_seed(1234, 0) == 1234  # turn 0 is sampled as a single-turn sample would be
    seeds = {turn_seed(s, k) for s in (1234, 1235) for k in range(1, 50)}
    assert len(seeds) == 98 and all(0 <= x < MAX_SEED for x in seeds)
