"""Prompt rendering (actors.prompting): chat templates, system prompts and stop strings, the
same in training (RolloutWorker.generate) and evaluation (actors.evaluate, also through
RolloutWorker.evaluate). The chat model is the tiny model with a chat template set on its
tokenizer (same weights: the shared `tiny_llm` engine can run its token ids)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from pydantic import ValidationError

import rewards
from actors.engine import greedy_params, request_params
from actors.evaluate import evaluate
from actors.prompting import PromptRenderer
from rewards.config import EvalConfig, TaskConfig

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
SYSTEM = "Answer with a number."


def odd_length(completion: str, problem) -> float:
    """Depends only on the completion, so a test can recompute every reward."""
    return float(len(completion) % 2 == 1)


class ArithmeticOddLength(rewards.Task):
    name = "arithmetic-odd"
    splits = ("in_domain",)
    scorer = staticmethod(odd_length)
    max_new_tokens = 8

    def problems(self, split, n=None, seed=0):
        return rewards.get_task("arithmetic").problems(split, n, seed)

    def _draw(self, split, n, rng):  # unused: problems() delegates
        raise NotImplementedError


@pytest.fixture(scope="module")
def chat_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """A copy of the tiny model whose tokenizer has a chat template."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("chat_model") / "model"
    shutil.copytree(tiny_model_dir, out)
    tok = AutoTokenizer.from_pretrained(str(out))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(out))
    return out


def chat_ids(tok, prompt: str, system: str | None = SYSTEM) -> list[int]:
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}]
    out = tok.apply_chat_template(messages, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_auto_renders_with_the_chat_template_and_none_gives_the_raw_prompt(chat_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(chat_model_dir))
    problems = rewards.get_task("arithmetic").problems("in_domain", 3, seed=0)
    auto = PromptRenderer(tok, chat_template="auto", system_prompt=SYSTEM)
    for p in problems:
        ids = auto.token_ids(p.prompt)
        assert ids == chat_ids(tok, p.prompt)
        assert f"<|system|>{SYSTEM}" in tok.decode(ids) and "<|assistant|>" in tok.decode(ids)
    assert auto.prompts(problems) == [{"prompt_token_ids": chat_ids(tok, p.prompt)}
                                      for p in problems]
    assert PromptRenderer(tok).token_ids("1+2=") == chat_ids(tok, "1+2=", system=None)
    none = PromptRenderer(tok, chat_template="none")
    assert none.token_ids("1+2=") == tok("1+2=")["input_ids"]  # BOS + characters, as before
    with pytest.raises(ValueError, match="system prompt needs a chat template"):
        PromptRenderer(tok, chat_template="none", system_prompt=SYSTEM)


def test_auto_is_raw_text_for_the_tiny_models_tokenizer(tiny_model_dir):
    """The embedded model's tokenizer has no chat template: the demo's prompts are unchanged."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    renderer = PromptRenderer.for_task(tok, TaskConfig())
    assert not renderer.use_chat_template
    assert renderer.token_ids("37-54=") == tok("37-54=")["input_ids"]
    with pytest.raises(ValueError, match="the tokenizer has none"):
        PromptRenderer.for_task(tok, TaskConfig(system_prompt=SYSTEM))


def test_task_config_prompting_fields():
    cfg = TaskConfig()
    assert (cfg.chat_template, cfg.system_prompt, cfg.stop) == ("auto", None, [])
    with pytest.raises(ValidationError, match="system_prompt needs a chat template"):
        TaskConfig(chat_template="none", system_prompt=SYSTEM)
    with pytest.raises(ValidationError):
        TaskConfig(stop=[""])
    with pytest.raises(ValidationError):
        TaskConfig(chat_template="chatml")


def test_training_requests_carry_the_stop_strings():
    from actors.config import RolloutConfig

    params = request_params(RolloutConfig(), seed=0, worker_index=0, num_prompts=2, stop=["\n"])
    assert [p.stop for p in params] == [["\n"], ["\n"]]
    assert greedy_params(4, stop=("a", "b")).stop == ["a", "b"]


def test_evaluation_sends_the_rendered_token_ids(tiny_llm, chat_model_dir):
    renderer = PromptRenderer.from_pretrained(chat_model_dir, system_prompt=SYSTEM)
    task = ArithmeticOddLength()
    result = evaluate(tiny_llm, task, ["in_domain"], n=12, samples=0, renderer=renderer,
                      progress=False)
    problems = task.problems("in_domain", 12, 0)
    ids = [chat_ids(renderer.tokenizer, p.prompt) for p in problems]
    outs = tiny_llm.generate([{"prompt_token_ids": i} for i in ids], greedy_params(8),
                             use_tqdm=False)
    r = result.splits["in_domain"]
    assert r.greedy_accuracy == pytest.approx(sum(odd_length(o.outputs[0].text, None)
                                                  for o in outs) / 12)
    assert r.mean_prompt_tokens == pytest.approx(sum(map(len, ids)) / 12)
    assert r.mean_prompt_tokens > 30  # the template and system prompt are there


def test_evaluation_stops_at_the_stop_strings(tiny_llm):
    task = ArithmeticOddLength()
    plain = PromptRenderer(tiny_llm.get_tokenizer())
    problems = task.problems("in_domain", 12, 0)
    texts = [o.outputs[0].text for o in tiny_llm.generate(
        plain.prompts(problems), greedy_params(8), use_tqdm=False)]
    # A printable ASCII character that some greedy completion writes, not first.
    stop = next(c for t in texts for i, c in enumerate(t)
                if i > 0 and c.isascii() and c.isprintable() and not c.isspace() and c not in t[:i])
    base = evaluate(tiny_llm, task, ["in_domain"], n=12, samples=0, renderer=plain,
                    progress=False).splits["in_domain"]
    cut = evaluate(tiny_llm, task, ["in_domain"], n=12, samples=0, progress=False,
                   renderer=PromptRenderer(tiny_llm.get_tokenizer(), stop=[stop]))
    cut = cut.splits["in_domain"]
    expected = [t.split(stop)[0] for t in texts]
    assert cut.greedy_accuracy == pytest.approx(sum(odd_length(t, None) for t in expected) / 12)
    assert cut.mean_response_tokens < base.mean_response_tokens
    assert cut.truncated <= base.truncated


def test_training_and_evaluation_render_identically(ray_cluster, chat_model_dir):
    """A worker on the chat model: generate's prompt ids and evaluate's prompts are the chat
    template's rendering (system prompt included), and stop strings end training samples."""
    import ray
    from transformers import AutoTokenizer

    from actors.config import RolloutConfig, SyncConfig
    from actors.rollout_worker import RolloutWorker

    tok = AutoTokenizer.from_pretrained(str(chat_model_dir))
    stop = [chr(c) for c in range(ord("a"), ord("z") + 1)]  # frequent in random completions
    task_cfg = TaskConfig(system_prompt=SYSTEM, stop=stop)
    cfg = RolloutConfig(samples_per_prompt=4, max_new_tokens=10, max_model_len=128)
    w = ray.remote(RolloutWorker).options(num_cpus=1).remote(
        str(chat_model_dir), cfg, SyncConfig(), task_cfg, seed=0)
    try:
        problems = rewards.get_task("arithmetic").problems("train", 5, seed=0)
        batch = ray.get(w.generate.remote(problems, list(range(5)), 3))
        eval_cfg = EvalConfig(num_problems=6, samples=0)
        report = ray.get(w.evaluate.remote(eval_cfg))
    finally:
        try:
            ray.get(w.shutdown.remote(), timeout=60)
        finally:
            ray.kill(w)
    for r in batch.rollouts:
        assert r.prompt_ids == chat_ids(tok, r.problem.prompt)
    stopped = [r for r in batch.rollouts
               if r.finish_reason == "stop" and r.response_ids[-1] != tok.eos_token_id]
    assert stopped, "no sample ended at a stop string"
    assert all(any(s in tok.decode(r.response_ids) for s in stop) for r in stopped)
    task = rewards.get_task("arithmetic")
    for name, r in report.sets.items():
        eval_problems = task.problems(name, 6, seed=eval_cfg.seed)
        assert r.problem_ids == [p.uid for p in eval_problems]
        ids = [chat_ids(tok, p.prompt) for p in eval_problems]
        assert r.mean_prompt_tokens == pytest.approx(sum(map(len, ids)) / len(ids))
