"""A character-level (byte-level) tokenizer built locally: one token per byte, no merges.

Every ASCII character is one token; any other text round-trips through its UTF-8 bytes.
It is a `tokenizers` BPE model with the 256 byte-level symbols as vocabulary and *no merges*,
behind the same normaliser, pre-tokeniser and decoder as Qwen2's tokenizer. Why that shape:
transformers >= 5 `AutoTokenizer` always rebuilds a `qwen2` model's tokenizer as
`Qwen2Tokenizer` (NFC + Qwen split regex + ByteLevel + BPE), whatever tokenizer.json says. A
WordLevel tokenizer gets silently mangled by that rebuild (spaces and newlines vanish,
letters become unknown); this one is unchanged by it, so transformers 4 and 5, vLLM and our
own code all produce the same ids (tests/test_tiny_model.py checks all of them).

Encoding adds BOS in front (a post-processor); EOS ends every answer the model is trained on.
"""
from __future__ import annotations

from pathlib import Path

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]  # ids 0..3, in this order; bytes follow from id 4

# Qwen2Tokenizer's pre-tokenisation regex (transformers/models/qwen2/tokenization_qwen2.py).
# With no merges the split cannot change the result; it is kept so the pipeline is identical.
_QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _byte_symbols() -> list[str]:
    """The 256 ByteLevel symbols in byte order (GPT-2's bytes_to_unicode)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def build_char_tokenizer():
    """Return a `PreTrainedTokenizerFast`: specials 0..3, then one id per byte (260 ids)."""
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + _byte_symbols())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A $B",
        special_tokens=[(BOS, vocab[BOS])],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",  # left padding suits batched generation with HF
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )


def save_char_tokenizer(out_dir: str | Path):
    """Build the tokenizer and write it to `out_dir` (tokenizer.json and its config)."""
    import json

    tokenizer = build_char_tokenizer()
    tokenizer.save_pretrained(str(out_dir))
    # Name the class AutoTokenizer picks for qwen2 anyway, so every transformers version
    # loads the same class (v4: Qwen2TokenizerFast straight from tokenizer.json).
    cfg_path = Path(out_dir) / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "Qwen2Tokenizer"
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    return tokenizer
