"""What a rollout reads from vLLM's outputs, on vLLM's cheapest path that gives the same values:
the sampled tokens' log-probs, and the completions' texts.

Why not vLLM's default output path: with `logprobs=0` its output processor builds, for every
request at every decode step, a `{token: Logprob}` dict and the sampled token's decoded string
(one tokenizer call per token), which costs more than a decode step of a small model
(docs/bench.md, "The log-prob tax"). Two request settings remove that work and change no value:

- `flat_logprobs=True`: vLLM keeps a request's log-probs in a few flat lists (`FlatLogprobs`)
  instead of one dict and one `Logprob` object per token; with `logprobs=0` they hold exactly
  the sampled token's log-prob at each position (`sampled_logprobs`).
- `detokenize=False`: vLLM decodes neither the log-probs' token strings nor the text; the
  worker decodes every completion's text in one batch afterwards (`completion_texts`), equal
  to the text vLLM's incremental detokenizer would have made. vLLM refuses `detokenize=False`
  with stop strings (it finds them in the text as it decodes), and decodes other than through
  a `tokenizers.Tokenizer` for a slow tokenizer: `decodes_texts_itself` says when the worker
  can take the text over.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# U+FFFD, which a decode puts for bytes that are not (yet) a whole UTF-8 character.
REPLACEMENT = "\ufffd"
# Prompt tokens decoded before a completion, so that its first token decodes as it does after
# the prompt (a SentencePiece-style leading space stays), as vLLM's detokenizer primes its
# stream with the prompt.
CONTEXT_TOKENS = 4


def decodes_texts_itself(tokenizer: Any, stop: Sequence[str]) -> bool:
    """True when a rollout asks vLLM for no text (`detokenize=False`) and decodes it here: no
    stop strings (vLLM needs its own text to find them) and a fast tokenizer, whose Rust
    `tokenizers.Tokenizer` vLLM's incremental detokenizer decodes with too."""
    return not stop and fast_backend(tokenizer) is not None


def sampled_logprobs(completion: Any) -> list[float]:
    """The log-prob of each sampled token of a vLLM `CompletionOutput` whose request asked for
    `logprobs=0`. With `flat_logprobs=True` that is the flat list itself (one entry per
    position, the sampled token's, checked against the token ids); otherwise one dict per
    position, read entry by entry."""
    steps, tokens = completion.logprobs, completion.token_ids
    if steps is None:
        raise RuntimeError("vLLM returned no log-probs; the request must set logprobs=0")
    flat = getattr(steps, "logprobs", None)
    if isinstance(flat, list):  # FlatLogprobs
        if len(flat) != len(tokens) or list(steps.token_ids) != list(tokens):
            raise RuntimeError(f"vLLM's flat log-probs hold {len(flat)} entries for "
                               f"{len(tokens)} sampled tokens; the request must set logprobs=0")
        return flat
    return [float(step[tok].logprob) for step, tok in zip(steps, tokens)]


def completion_texts(tokenizer: Any, prompt_ids: Sequence[Sequence[int]],
                     completions: Sequence[Any]) -> list[str]:
    """The text of each completion (a vLLM `CompletionOutput` of a request that set
    `detokenize=False`) after its prompt's token ids, equal to the text vLLM's incremental
    detokenizer makes with `skip_special_tokens=True` (`decodes_texts_itself` must hold):

    - a request that ended on a stop token (finish_reason "stop") decodes without it;
    - the completion decodes after the prompt's last CONTEXT_TOKENS tokens, whose own text is
      cut off again;
    - the detokenizer holds back text while it ends in an incomplete UTF-8 character (it
      shows as U+FFFD) and never releases what is still held at the end: such a text is cut
      back to its longest prefix of tokens whose decode does not end in U+FFFD;
    - where decoding the prompt's tail and the completion together does not begin with the
      tail's own text, the completion is decoded token by token as vLLM does (`stream_text`).

    All completions decode in one call of the Rust tokenizer."""
    backend = fast_backend(tokenizer)
    if backend is None:
        raise ValueError("completion_texts needs a fast tokenizer (decodes_texts_itself)")
    ids = [list(c.token_ids[:-1]) if c.finish_reason == "stop" else list(c.token_ids)
           for c in completions]
    tails = [list(p[-CONTEXT_TOKENS:]) for p in prompt_ids]
    wholes = backend.decode_batch([t + i for t, i in zip(tails, ids)], skip_special_tokens=True)
    heads = backend.decode_batch(tails, skip_special_tokens=True)
    texts = []
    for prompt, tail, tokens, whole, head in zip(prompt_ids, tails, ids, wholes, heads):
        if head.endswith(REPLACEMENT) or not whole.startswith(head):
            texts.append(stream_text(backend, prompt, tokens))
            continue
        kept = len(tokens)
        while whole.endswith(REPLACEMENT) and kept > 0:
            kept -= 1
            whole = backend.decode(tail + tokens[:kept], skip_special_tokens=True)
        texts.append(whole[len(head):])
    return texts


def stream_text(backend, prompt_ids: Sequence[int], ids: Sequence[int]) -> str:
    """`ids` decoded token by token after the prompt, as vLLM's fast incremental detokenizer
    decodes them (tokenizers' DecodeStream, restarted where it refuses a prefix)."""
    from tokenizers.decoders import DecodeStream

    stream, parts = DecodeStream(ids=list(prompt_ids), skip_special_tokens=True), []
    for token in ids:
        try:
            parts.append(stream.step(backend, token) or "")
        except Exception as exc:
            if not str(exc).startswith("Invalid prefix"):
                raise
            stream = DecodeStream(skip_special_tokens=True)
            parts.append(stream.step(backend, token) or "")
    return "".join(parts)


def fast_backend(tokenizer: Any):
    """A fast tokenizer's Rust `tokenizers.Tokenizer` (what vLLM decodes with), else None."""
    from tokenizers import Tokenizer

    backend = getattr(tokenizer, "_tokenizer", None)
    return backend if isinstance(backend, Tokenizer) else None
