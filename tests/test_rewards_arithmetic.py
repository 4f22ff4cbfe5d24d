"""The arithmetic task: exact prompt format (the tiny model is trained on it), held-out
splits, determinism, and a scorer that accepts only the right integer."""
from __future__ import annotations

import re
import time

import pytest

from rewards import get_task
from rewards.arithmetic import HELD_OUT_SIZE, make_problem, score_arithmetic

TASK = get_task("arithmetic")
FORMAT = re.compile(r"(\d+)([+-])(\d+)=")


def test_prompt_and_answer_format():
    p = make_problem(37, "-", 54)
    assert (p.prompt, p.answer, p.task, p.split) == ("37-54=", "-17", "arithmetic", "train")
    assert p.metadata == {"a": 37, "op": "-", "b": 54}
    assert make_problem(0, "+", 0).answer == "0"
    with pytest.raises(ValueError):
        make_problem(1, "/", 2)
    assert make_problem(12, "*", 3, split="retained").answer == "36"  # the retained split's op


@pytest.mark.parametrize("split,lo,hi", [
    ("train", 0, 99), ("in_domain", 0, 99), ("out_of_domain", 100, 999),
])
def test_splits_draw_from_their_ranges(split, lo, hi):
    problems = TASK.problems(split, 1000, seed=3)
    ops = set()
    for p in problems:
        a, op, b = FORMAT.fullmatch(p.prompt).groups()
        assert lo <= int(a) <= hi and lo <= int(b) <= hi
        assert int(p.answer) == (int(a) + int(b) if op == "+" else int(a) - int(b))
        assert p.split == split and p.uid == f"arithmetic/{split}/{a}{op}{b}"
        ops.add(op)
    assert ops == {"+", "-"}
    assert any(p.answer.startswith("-") for p in problems)


def test_in_domain_is_held_out_from_train():
    held_out = {p.prompt for p in TASK.problems("in_domain")}
    assert len(held_out) == HELD_OUT_SIZE
    for seed in range(3):
        assert not held_out & {p.prompt for p in TASK.problems("train", 20_000, seed)}


def test_evaluation_splits_are_distinct_problems_and_bounded():
    assert len({p.uid for p in TASK.problems("out_of_domain", 5000)}) == 5000
    with pytest.raises(ValueError, match="holds 2000"):
        TASK.problems("in_domain", HELD_OUT_SIZE + 1)
    with pytest.raises(ValueError, match="no split 'test'"):
        TASK.problems("test")
    assert TASK.problems("train", 0) == []


def test_distinct_problems_is_what_each_split_holds():
    """Each evaluation split's size is known without drawing it: asking for all of them gives
    that many distinct problems, one more is refused (the doors refuse it before a run);
    train is drawn with replacement (None)."""
    assert TASK.distinct_problems("train") is None
    for split in ("in_domain", "zero_padded", "retained"):
        size = TASK.distinct_problems(split)
        assert len({p.uid for p in TASK.problems(split, size)}) == size
        with pytest.raises(ValueError, match=f"holds {size} distinct problems; asked for"):
            TASK.problems(split, size + 1)
        TASK.check_count(split, size)
    assert TASK.distinct_problems("out_of_domain") == 900 * 900 * 2  # three-digit a, op, b


def test_zero_padded_spells_training_numbers_in_a_form_no_training_prompt_has():
    """The near out-of-domain split: two-digit problems, a single-digit operand written with a
    leading zero, its answer the problem's own; no train prompt ever looks like it."""
    problems = TASK.problems("zero_padded", 3800)  # all of them
    assert len({p.prompt for p in problems}) == 3800
    with pytest.raises(ValueError, match="holds 3800"):
        TASK.problems("zero_padded", 3801)
    for p in problems:
        a, op, b = FORMAT.fullmatch(p.prompt).groups()
        assert len(a) == len(b) == 2 and "0" in (a[0], b[0]), p.prompt
        assert int(p.answer) == (int(a) + int(b) if op == "+" else int(a) - int(b))
        assert score_arithmetic(p.answer, p) == 1.0
    train = {p.prompt for p in TASK.problems("train", 20_000)}
    assert not train & {p.prompt for p in problems}
    assert not any(re.search(r"(^|[+-])0\d", prompt) for prompt in train)


def test_deterministic_for_a_seed_and_different_across_seeds():
    for split in TASK.splits:
        first = TASK.problems(split, 50, seed=7)
        assert first == get_task("arithmetic").problems(split, 50, seed=7)
        assert first != TASK.problems(split, 50, seed=8)
    assert [p.prompt for p in TASK.problems("train", 50)] != [
        p.prompt for p in TASK.problems("in_domain", 50)]


@pytest.mark.parametrize("completion,reward", [
    ("-17", 1.0), (" -17 ", 1.0), ("-17\n12+3=15", 1.0), ("-017", 1.0),
    ("17", 0.0), ("-18", 0.0), ("", 0.0), ("\n-17", 0.0), ("-17abc", 0.0), ("-17.0", 0.0),
    ("- 17", 0.0), ("-1_7", 0.0), ("\u0661\u0667", 0.0), ("0x11", 0.0), ("-17-17", 0.0),
])
def test_scorer(completion, reward):
    assert score_arithmetic(completion, make_problem(37, "-", 54)) == reward


def test_scorer_on_pathological_text_is_fast():
    p = make_problem(1, "+", 2)
    start = time.perf_counter()
    assert score_arithmetic("3" * 5_000_000, p) == 0.0
    assert score_arithmetic("3\n" + "x" * 5_000_000, p) == 1.0
    assert score_arithmetic("9**9**9", p) == 0.0
    assert time.perf_counter() - start < 1.0


def test_retained_split_holds_facts_no_rewarded_split_has():
    """The retained split: every a*b fact (a two-digit or less, b in 2-9), a product the scorer
    accepts, and an operator that no train or other evaluation prompt contains, so RL on this
    task never rewards it (what the arith-retain model is taught and may forget)."""
    facts = TASK.problems("retained", 800)  # all of them
    assert len({p.prompt for p in facts}) == 800
    with pytest.raises(ValueError, match="holds 800"):
        TASK.problems("retained", 801)
    for p in facts:
        a, b = p.prompt[:-1].split("*")
        assert 0 <= int(a) <= 99 and 2 <= int(b) <= 9
        assert p.answer == str(int(a) * int(b)) and score_arithmetic(p.answer, p) == 1.0
    for split in ("train", "in_domain", "zero_padded", "out_of_domain"):
        assert not any("*" in p.prompt for p in TASK.problems(split, 1000)), split
