"""Countdown: combine given numbers with + - * / and parentheses to reach a target.

Every problem is solvable by construction: the generator builds a random expression over a
subset of the drawn numbers and takes its (positive integer) value as the target; that
expression is the problem's `answer` (one solution among possibly many).

Splits:
- "train" and "in_domain": 3 or 4 numbers in [1, 50], target in [1, 100]. A fixed hash of
  (numbers, target) holds out 1 problem in 10 for in_domain; train never produces those.
- "out_of_domain": 5 numbers in [1, 50], target in [101, 999] (longer searches, bigger targets).

The scorer reads the last <answer>...</answer> of the completion, or its first line when it
has no such tag; an optional trailing "= <target>" is allowed. Reward 1.0 when the expression
is valid (see rewards.expression), uses each given number at most as often as it is given, and
equals the target exactly; else 0.0.
"""
from __future__ import annotations

import hashlib
import random
import re
from collections import Counter
from fractions import Fraction

from rewards.expression import MAX_CHARS, ExpressionError, evaluate
from rewards.records import Problem, Task

NUMBER_RANGE = (1, 50)
SPLIT_SHAPES = {  # split -> (how many numbers, (lowest, highest) target)
    "train": ((3, 4), (1, 100)),
    "in_domain": ((3, 4), (1, 100)),
    "out_of_domain": ((5,), (101, 999)),
}
HELD_OUT_ONE_IN = 10
DEFAULT_SIZES = {"train": 10_000, "in_domain": 500, "out_of_domain": 500}
_MAX_ATTEMPTS_PER_PROBLEM = 10_000

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_TRAILING_EQUALS = re.compile(r"=\s*(-?[0-9]{1,6})\s*$")


def make_problem(numbers: list[int], target: int, solution: str, split: str = "train") -> Problem:
    """The countdown problem "reach `target` from `numbers`"; `solution` is a known answer."""
    listed = ", ".join(str(x) for x in numbers)
    prompt = (
        f"Using the numbers [{listed}], make {target}. You may use + - * / and parentheses, "
        f"and each number at most once. Write only the expression inside <answer> </answer>, "
        f"for example <answer>(1 + 2) * 3</answer>.\n"
    )
    return Problem(
        uid=f"countdown/{split}/{'_'.join(map(str, numbers))}->{target}",
        task="countdown",
        split=split,
        prompt=prompt,
        answer=solution,
        metadata={"numbers": list(numbers), "target": target},
    )


def extract_expression(completion: str) -> str:
    """The text the scorer evaluates: the last <answer> tag's content, else the first line."""
    # Only the tail can hold the final answer; bounding the search keeps megabytes cheap.
    tail = completion[-(MAX_CHARS * 20):]
    tagged = _ANSWER_TAG.findall(tail)
    text = tagged[-1] if tagged else completion.split("\n", 1)[0][: MAX_CHARS + 1]
    return text.strip()


def score_countdown(completion: str, problem: Problem) -> float:
    """1.0 for a valid expression over the given numbers that equals the target, else 0.0."""
    numbers, target = problem.metadata["numbers"], int(problem.metadata["target"])
    text = extract_expression(completion)
    stated = _TRAILING_EQUALS.search(text)
    if stated is not None:
        if int(stated.group(1)) != target:
            return 0.0
        text = text[: stated.start()]
    try:
        value, literals = evaluate(text)
    except ExpressionError:
        return 0.0
    if Counter(literals) - Counter(numbers):  # a number not given, or used too often
        return 0.0
    return 1.0 if value == target else 0.0


def is_held_out(numbers: list[int], target: int) -> bool:
    """The fixed in_domain/train partition (a stable hash, independent of any seed)."""
    key = f"{sorted(numbers)}->{target}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "big") % HELD_OUT_ONE_IN == 0


def random_solvable(rng: random.Random, count: int,
                    target_range: tuple[int, int]) -> tuple[list[int], int, str]:
    """(numbers, target, solution): `count` numbers and a target some of them reach."""
    lo, hi = NUMBER_RANGE
    for _ in range(_MAX_ATTEMPTS_PER_PROBLEM):
        numbers = [rng.randint(lo, hi) for _ in range(count)]
        used = rng.sample(numbers, rng.randint(2, count))
        value, text = _random_expression(rng, used)
        if value.denominator == 1 and target_range[0] <= value <= target_range[1]:
            return numbers, int(value), text
    raise RuntimeError(f"no countdown problem with {count} numbers reaches {target_range}")


def _random_expression(rng: random.Random, numbers: list[int]) -> tuple[Fraction, str]:
    """Combine random pairs until one term is left; every intermediate value stays positive
    (as in the game), and "/" only where it is exact."""
    terms = [(Fraction(x), str(x)) for x in numbers]
    while len(terms) > 1:
        (a, a_text), (b, b_text) = terms.pop(rng.randrange(len(terms))), terms.pop(
            rng.randrange(len(terms)))
        choices = [(a + b, "+"), (a * b, "*")]
        if a > b:
            choices.append((a - b, "-"))
        if b != 0 and (a / b).denominator == 1:
            choices.append((a / b, "/"))
        value, op = rng.choice(choices)
        terms.append((value, f"({a_text} {op} {b_text})"))
    value, text = terms[0]
    return value, text[1:-1] if text.startswith("(") else text


class CountdownTask(Task):
    """Countdown with seeded, solvable problems. No options."""

    name = "countdown"
    splits = ("train", "in_domain", "out_of_domain")
    scorer = staticmethod(score_countdown)
    max_new_tokens = 64

    def _draw(self, split: str, n: int | None, rng: random.Random) -> list[Problem]:
        n = DEFAULT_SIZES[split] if n is None else n
        counts, target_range = SPLIT_SHAPES[split]
        problems: dict[str, Problem] = {}
        drawn: list[Problem] = []
        attempts = 0
        while len(drawn) < n:
            attempts += 1
            if attempts > _MAX_ATTEMPTS_PER_PROBLEM * max(n, 1):
                raise RuntimeError(f"countdown split {split!r}: cannot draw {n} problems")
            numbers, target, solution = random_solvable(rng, rng.choice(counts), target_range)
            if split != "out_of_domain" and is_held_out(numbers, target) != (split == "in_domain"):
                continue
            problem = make_problem(numbers, target, solution, split)
            if split == "train":
                drawn.append(problem)  # i.i.d. draws; repeats are fine for training
            elif problem.uid not in problems:  # evaluation sets hold distinct problems
                problems[problem.uid] = problem
                drawn.append(problem)
        return drawn
