"""Counting: a generated task whose right answers are long and of very different lengths, so that
packed micro-batches, the token budget and overlong shaping run end to end on CPU
(docs/long-responses.md).

Prompt f"{a}..{b}:" (no spaces), e.g. "7..11:"; the answer is every integer from a to b
separated by single spaces, "7 8 9 10 11". a is uniform in [0, START_MAX]; the count b - a + 1
is long-tailed: min(MAX_COUNT, ceil(2 x Pareto(1))), so P(count > x) = 2 / x up to the cap:
half the answers hold at most 4 numbers, about one in ten 20 or more, and the longest are about
MAX_COUNT x 4 characters (the tiny model's tokenizer is byte-level: a token per character).
The scorer wants the first line exactly (1.0, else 0.0). Splits: train and test, the same
distribution drawn from streams of their own.
"""
from __future__ import annotations

import math
import random

from rewards.records import Problem, Task

START_MAX = 199
MAX_COUNT = 60
DEFAULT_SIZES = {"train": 10_000, "test": 500}


def make_problem(a: int, b: int, split: str = "train") -> Problem:
    """The counting problem from a to b (a <= b)."""
    if b < a:
        raise ValueError(f"counting needs a <= b, got {a}..{b}")
    return Problem(uid=f"counting/{split}/{a}..{b}", task="counting", split=split,
                   prompt=f"{a}..{b}:", answer=" ".join(str(k) for k in range(a, b + 1)),
                   metadata={"a": a, "b": b})


def score_counting(completion: str, problem: Problem) -> float:
    """1.0 if the completion's first line, stripped, is the answer exactly."""
    return 1.0 if completion.split("\n", 1)[0].strip() == problem.answer else 0.0


def draw_count(rng: random.Random) -> int:
    """How many numbers an answer holds: long-tailed, 1 to MAX_COUNT."""
    return min(MAX_COUNT, math.ceil(2 * rng.paretovariate(1.0)))


class CountingTask(Task):
    """Count from a to b: answers from one number to MAX_COUNT of them (module docstring)."""

    name = "counting"
    splits = ("train", "test")
    scorer = staticmethod(score_counting)
    # The longest answer: MAX_COUNT numbers of up to 3 digits with their spaces, and the EOS.
    max_new_tokens = 4 * MAX_COUNT + 8

    def _draw(self, split: str, n: int | None, rng: random.Random) -> list[Problem]:
        n = DEFAULT_SIZES[split] if n is None else n
        out = []
        for _ in range(n):
            a = rng.randint(0, START_MAX)
            out.append(make_problem(a, a + draw_count(rng) - 1, split))
        return out
