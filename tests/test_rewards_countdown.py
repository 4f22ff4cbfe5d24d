"""Countdown: solvable seeded problems, and a safe expression evaluator (never eval) that
rejects everything but numbers, + - * / and parentheses, fast, whatever the input."""
from __future__ import annotations

import time
from fractions import Fraction

import pytest

from rewards import get_task
from rewards.countdown import (
    SPLIT_SHAPES,
    extract_expression,
    is_held_out,
    make_problem,
    score_countdown,
)
from rewards.expression import ExpressionError, evaluate

TASK = get_task("countdown")


@pytest.mark.parametrize("split", TASK.splits)
def test_generated_problems_are_solvable_and_well_formed(split):
    counts, (lo, hi) = SPLIT_SHAPES[split]
    problems = TASK.problems(split, 300, seed=1)
    for p in problems:
        numbers, target = p.metadata["numbers"], p.metadata["target"]
        assert len(numbers) in counts and all(1 <= x <= 50 for x in numbers)
        assert lo <= target <= hi
        assert score_countdown(f"<answer>{p.answer}</answer>", p) == 1.0
        assert p.prompt.isascii() and p.prompt[:-1].isprintable()
        assert str(target) in p.prompt and str(numbers)[1:-1] in p.prompt
        if split != "out_of_domain":
            assert is_held_out(numbers, target) == (split == "in_domain")
    if split != "train":
        assert len({p.uid for p in problems}) == len(problems)


def test_deterministic_and_seeded():
    assert TASK.problems("train", 30, seed=5) == get_task("countdown").problems("train", 30, 5)
    assert TASK.problems("train", 30, seed=5) != TASK.problems("train", 30, seed=6)


P = make_problem([1, 3, 4, 6], 24, "6 / (1 - 3 / 4)")


@pytest.mark.parametrize("completion,reward", [
    ("<answer>6 / (1 - 3 / 4)</answer>", 1.0),           # fractional intermediate, exact
    ("6/(1-3/4)", 1.0),                                  # first line without tags
    ("6 / (1 - 3 / 4) = 24\nmore text", 1.0),            # trailing "= target" allowed
    ("<answer>4 * 6</answer>", 1.0),                     # a subset of the numbers
    ("<answer>1 + 1</answer> no, <answer>(4 * 6)</answer>", 1.0),  # the last tag counts
    ("<answer>(4 * 6)</answer> no, <answer>1 + 1</answer>", 0.0),
    ("6 / (1 - 3 / 4) = 25", 0.0),                       # states a wrong target
    ("<answer>6 * 4 * 1</answer>", 1.0),
    ("<answer>6 * 4 * 1 * 1</answer>", 0.0),             # 1 used twice
    ("<answer>8 * 3</answer>", 0.0),                     # 8 is not given
    ("<answer>24</answer>", 0.0),
    ("<answer>6 * 4 + 0</answer>", 0.0),
    ("<answer>6 * 3 + 4 + 1</answer>", 0.0),             # 23
    ("<answer>-(1 - 4 * 6) + 1</answer>", 0.0),          # unary minus is not allowed
    ("<answer>4 * 6 = 24 = 24</answer>", 0.0),
    ("", 0.0), ("<answer></answer>", 0.0), ("I cannot solve this.", 0.0),
])
def test_scorer(completion, reward):
    assert score_countdown(completion, P) == reward


def test_evaluator_precedence_and_exact_division():
    assert evaluate("2 + 3 * 4") == (Fraction(14), [2, 3, 4])
    assert evaluate("(2 + 3) * 4")[0] == 20
    assert evaluate("8 - 3 - 2")[0] == 3            # left associative
    assert evaluate("8 / 4 / 2")[0] == 1
    assert evaluate("8 / 3")[0] == Fraction(8, 3)   # no float rounding
    assert evaluate(" ( ( 7 ) ) ")[0] == 7


ADVERSARIAL = [
    "9**9**9", "2^3", "__import__('os').system('echo hi')", "1e9", "0x10", "1.5 + 2",
    "-1 + 2", "+1", "1 +", "(1 + 2", "1 + 2)", "()", "1 2", "1 / 0", "1 / (2 - 2)",
    "\u0661 + 2", "1\u00a0+ 2", "lambda: 1", "[1, 2]", "1 // 2", "1 % 2", "1234567 + 1",
    "(" * 33 + "1" + ")" * 33, "(" * 10_000 + "1" + ")" * 10_000, "1+" * 1_000_000 + "1",
    "9" * 10_000_000, "*".join(["999999"] * 28), "",
]


@pytest.mark.parametrize("text", ADVERSARIAL, ids=range(len(ADVERSARIAL)))
def test_evaluator_rejects_everything_else_fast(text):
    start = time.perf_counter()
    with pytest.raises(ExpressionError):
        evaluate(text)
    assert time.perf_counter() - start < 0.05


def test_scorer_on_megabytes_is_fast():
    start = time.perf_counter()
    for text in ["<answer>" * 200_000, "x" * 5_000_000 + "<answer>4*6</answer>",
                 "(" * 3_000_000, "<answer>" + "1+" * 2_000_000 + "</answer>"]:
        score_countdown(text, P)
    assert score_countdown("y" * 5_000_000 + "<answer>4*6</answer>", P) == 1.0
    assert time.perf_counter() - start < 1.0


def test_extract_expression():
    assert extract_expression("think...\n<answer> (1 + 2) </answer>") == "(1 + 2)"
    assert extract_expression(" 3 * 4 \nblah") == "3 * 4"
