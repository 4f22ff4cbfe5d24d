"""Supervised pieces of the embedded model's warm start: encoding problems as (ids, prompt
length) examples, their right-padded batches, and the two greedy accuracy checks (a generation,
and the teacher-forced one the stop rule uses every few steps). Kept apart from model.py, which
holds the recipes, the warm-start loop and the cache."""
from __future__ import annotations


def arithmetic_task():
    import rewards

    return rewards.get_task("arithmetic")


def encode_examples(tokenizer, problems) -> list[tuple[list[int], int]]:
    """(ids, prompt_length) for each problem: BOS + prompt + answer + EOS."""
    out = []
    for p in problems:
        prompt = tokenizer(p.prompt)["input_ids"]  # BOS + prompt characters
        answer = tokenizer(str(p.answer), add_special_tokens=False)["input_ids"]
        out.append((prompt + answer + [tokenizer.eos_token_id], len(prompt)))
    return out


def collate(examples, pad_id: int):
    """Right-padded batch; labels are -100 except on answer and EOS tokens."""
    import torch

    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (ids, n_prompt) in enumerate(examples):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, n_prompt : len(ids)] = torch.tensor(ids[n_prompt:])
        mask[i, : len(ids)] = 1
    return input_ids, labels, mask


def greedy_accuracy(model, tokenizer, task, problems, max_new_tokens: int = 8) -> float:
    """Greedy pass@1 with the HF model, scored by `task.scorer` (a quick in-process check;
    `actors.evaluate` is the vLLM evaluation used everywhere else)."""
    import torch

    if not problems:
        return 0.0
    enc = tokenizer([p.prompt for p in problems], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    return sum(float(task.scorer(t, p)) for t, p in zip(texts, problems)) / len(problems)


def exact_greedy_accuracy(model, tokenizer, examples: list[tuple[list[int], int]]) -> float:
    """Fraction of `examples` (from `encode_examples`) whose answer + EOS is the model's greedy
    continuation, token by token: one teacher-forced forward pass instead of a generation, so
    checking it every few steps costs little. It equals greedy pass@1 except for answers the
    scorer would also accept in another spelling (e.g. "+17"), which count as wrong here."""
    import torch

    input_ids, labels, mask = collate(examples, tokenizer.pad_token_id)
    with torch.no_grad():
        predicted = model(input_ids=input_ids, attention_mask=mask).logits[:, :-1].argmax(-1)
    target = labels[:, 1:]
    scored = target != -100
    correct = ((predicted == target) | ~scored).all(-1)
    return float(correct.double().mean())
