"""Synthetic integer arithmetic: the CPU task the embedded tiny model is trained on.

Prompt format (fixed: the tiny character-level model is trained on it): f"{a}{op}{b}=" with no
spaces, e.g. "37-54="; the answer is str(result), e.g. "-17".

Splits, mirroring the paper's in/out-of-domain evaluation:
- "train": a, b uniform in [0, 99], op in {+, -}, drawn i.i.d. (with replacement) from the
  problems that are not held out.
- "in_domain": the same distribution, drawn without replacement from a fixed held-out set of
  HELD_OUT_SIZE problems that "train" never produces.
- "out_of_domain": a, b uniform in [100, 999] (longer numbers), op in {+, -}, drawn without
  replacement; disjoint from the others by construction.
"""
from __future__ import annotations

import functools
import random
import re

from rewards.records import Problem, Task

OPERATORS = ("+", "-")
IN_DOMAIN_RANGE = (0, 99)
OUT_OF_DOMAIN_RANGE = (100, 999)
HELD_OUT_SIZE = 2000  # 10% of the 20,000 two-digit problems
DEFAULT_SIZES = {"train": 10_000, "in_domain": HELD_OUT_SIZE, "out_of_domain": 1000}

_INTEGER = re.compile(r"[+-]?[0-9]{1,40}")  # ASCII digits only; long enough for any answer here


def make_problem(a: int, op: str, b: int, split: str = "train") -> Problem:
    """The arithmetic problem "a op b =" (op is "+" or "-")."""
    if op not in OPERATORS:
        raise ValueError(f"op must be one of {OPERATORS}, got {op!r}")
    result = a + b if op == "+" else a - b
    return Problem(
        uid=f"arithmetic/{split}/{a}{op}{b}",
        task="arithmetic",
        split=split,
        prompt=f"{a}{op}{b}=",
        answer=str(result),
        metadata={"a": a, "op": op, "b": b},
    )


def score_arithmetic(completion: str, problem: Problem) -> float:
    """1.0 if the completion's first line, stripped, is an integer equal to the answer."""
    first_line = completion.split("\n", 1)[0].strip()
    if not _INTEGER.fullmatch(first_line):
        return 0.0
    return 1.0 if int(first_line) == int(problem.answer) else 0.0


@functools.lru_cache(maxsize=1)
def _two_digit_partition() -> tuple[list[tuple[int, str, int]], list[tuple[int, str, int]]]:
    """(train pool, held-out pool) of all (a, op, b) with a, b in IN_DOMAIN_RANGE.

    A fixed shuffle (its own seed, independent of any caller's) puts HELD_OUT_SIZE problems in
    the held-out pool; train samples only the rest, so in_domain is unseen by construction.
    """
    lo, hi = IN_DOMAIN_RANGE
    every = [(a, op, b) for a in range(lo, hi + 1) for op in OPERATORS for b in range(lo, hi + 1)]
    random.Random("arithmetic:held-out-partition").shuffle(every)
    return every[HELD_OUT_SIZE:], every[:HELD_OUT_SIZE]


class ArithmeticTask(Task):
    """Two-digit addition/subtraction (train, in_domain) and three-digit (out_of_domain).

    No options. `problems(split, n=None)` gives DEFAULT_SIZES[split] problems; in_domain and
    out_of_domain refuse an `n` larger than the split holds.
    """

    name = "arithmetic"
    splits = ("train", "in_domain", "out_of_domain")
    scorer = staticmethod(score_arithmetic)
    max_new_tokens = 8  # the longest answer, "-899", is 4 characters; leave room for EOS

    def _draw(self, split: str, n: int | None, rng: random.Random) -> list[Problem]:
        n = DEFAULT_SIZES[split] if n is None else n
        if split == "train":
            pool = _two_digit_partition()[0]
            return [make_problem(*rng.choice(pool), split=split) for _ in range(n)]
        if split == "in_domain":
            held_out = _two_digit_partition()[1]
            _check_size(split, n, len(held_out))
            return [make_problem(*t, split=split) for t in rng.sample(held_out, n)]
        lo, hi = OUT_OF_DOMAIN_RANGE
        width = hi - lo + 1
        total = width * width * len(OPERATORS)
        _check_size(split, n, total)
        # Sample indices without replacement instead of materialising 1.6M tuples.
        out = []
        for index in rng.sample(range(total), n):
            index, b = divmod(index, width)
            a, op = divmod(index, len(OPERATORS))
            out.append(make_problem(lo + a, OPERATORS[op], lo + b, split=split))
        return out


def _check_size(split: str, n: int, available: int) -> None:
    if n > available:
        raise ValueError(f"arithmetic split {split!r} holds {available} distinct problems; "
                         f"asked for {n}")
