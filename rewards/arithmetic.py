"""Synthetic integer arithmetic: the CPU task the embedded tiny model is trained on.

Prompt format (fixed: the tiny character-level model is trained on it): f"{a}{op}{b}=" with no
spaces, e.g. "37-54="; the answer is str(result), e.g. "-17".

Splits, mirroring the paper's in/out-of-domain evaluation:
- "train": a, b uniform in [0, 99], op in {+, -}, drawn i.i.d. (with replacement) from the
  problems that are not held out.
- "in_domain": the same distribution, drawn without replacement from a fixed held-out set of
  HELD_OUT_SIZE problems that "train" never produces.
- "zero_padded": two-digit problems with a single-digit operand written with a leading zero
  ("07+54=", "36-05=", "03+08="), drawn without replacement. Out of distribution in format
  only: the numbers are those of training, but no training prompt (nor any of the embedded
  model's supervised warm-up) has a leading zero, so the model must carry what RL taught it to
  a spelling it never saw. The embedded model starts well below its in-domain accuracy here
  (docs/tasks.md has the figures), where a generalisation gap can show; the tiny config
  evaluates it as `eval.out_of_domain`.
- "out_of_domain": a, b uniform in [100, 999] (longer numbers), op in {+, -}, drawn without
  replacement; disjoint from the others by construction. The far split: the embedded model
  solves almost none of it before or after training (the tiny config's
  `eval.far_out_of_domain`).
- "retained": the multiplication facts "a*b=" with a in [0, 99] and b in [2, 9] (800 problems),
  drawn without replacement. A second capability that the task never rewards: no other split
  has a "*", and RL trains on "train" alone. The embedded model built with
  `model.embedded: arith-retain` is taught these facts beside addition and subtraction, so an
  evaluation on this split measures what RL makes it forget, the way the paper's MMLU sets
  measure knowledge a math-RL run never rewards (docs/tasks.md). The default model was never
  taught them (it scores about 0 here).
"""
from __future__ import annotations

import functools
import random
import re

from rewards.records import Problem, Task

OPERATORS = ("+", "-")
RETAINED_OPERATOR = "*"  # the retained split's operation: never in a rewarded split
RETAINED_MULTIPLIERS = range(2, 10)  # b in a*b: 0 and 1 would be facts no model can forget
IN_DOMAIN_RANGE = (0, 99)
OUT_OF_DOMAIN_RANGE = (100, 999)
HELD_OUT_SIZE = 2000  # 10% of the 20,000 two-digit problems
DEFAULT_SIZES = {"train": 10_000, "in_domain": HELD_OUT_SIZE, "zero_padded": 1000,
                 "out_of_domain": 1000, "retained": 500}

_INTEGER = re.compile(r"[+-]?[0-9]{1,40}")  # ASCII digits only; long enough for any answer here


def make_problem(a: int, op: str, b: int, split: str = "train", width: int = 1) -> Problem:
    """The arithmetic problem "a op b =" (op is "+", "-" or the retained split's "*"), each
    operand zero-padded to `width` digits (1: as is)."""
    if op not in (*OPERATORS, RETAINED_OPERATOR):
        raise ValueError(f"op must be one of {(*OPERATORS, RETAINED_OPERATOR)}, got {op!r}")
    result = a + b if op == "+" else a - b if op == "-" else a * b
    text = f"{a:0{width}d}{op}{b:0{width}d}"
    return Problem(
        uid=f"arithmetic/{split}/{text}",
        task="arithmetic",
        split=split,
        prompt=f"{text}=",
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


@functools.lru_cache(maxsize=1)
def _single_digit_operand_problems() -> list[tuple[int, str, int]]:
    """Every two-digit problem with an operand below 10: the ones a leading zero changes."""
    lo, hi = IN_DOMAIN_RANGE
    return [(a, op, b) for a in range(lo, hi + 1) for op in OPERATORS for b in range(lo, hi + 1)
            if min(a, b) < 10]


@functools.lru_cache(maxsize=1)
def retained_facts() -> list[tuple[int, str, int]]:
    """Every (a, "*", b) of the retained split, in a fixed order: the facts the arith-retain
    model is taught (cluster/tiny/warm_start.py) and the split's evaluation draws from."""
    lo, hi = IN_DOMAIN_RANGE
    return [(a, RETAINED_OPERATOR, b) for a in range(lo, hi + 1) for b in RETAINED_MULTIPLIERS]


class ArithmeticTask(Task):
    """Two-digit addition/subtraction (train, in_domain), the same with zero-padded
    single-digit operands (zero_padded), three-digit (out_of_domain), and multiplication facts
    no rewarded split contains (retained).

    No options. `problems(split, n=None)` gives DEFAULT_SIZES[split] problems; the evaluation
    splits refuse an `n` larger than the split holds.
    """

    name = "arithmetic"
    splits = ("train", "in_domain", "zero_padded", "out_of_domain", "retained")
    scorer = staticmethod(score_arithmetic)
    max_new_tokens = 8  # the longest answer, "-899", is 4 characters; leave room for EOS

    def distinct_problems(self, split: str) -> int | None:
        """The evaluation splits' sizes (train is drawn with replacement: None)."""
        self.check_split(split)
        if split == "train":
            return None
        if split == "in_domain":
            return len(_two_digit_partition()[1])
        if split == "zero_padded":
            return len(_single_digit_operand_problems())
        if split == "retained":
            return len(retained_facts())
        lo, hi = OUT_OF_DOMAIN_RANGE
        return (hi - lo + 1) ** 2 * len(OPERATORS)

    def _draw(self, split: str, n: int | None, rng: random.Random) -> list[Problem]:
        n = DEFAULT_SIZES[split] if n is None else n
        if split == "train":
            pool = _two_digit_partition()[0]
            return [make_problem(*rng.choice(pool), split=split) for _ in range(n)]
        self.check_count(split, n)
        if split == "in_domain":
            held_out = _two_digit_partition()[1]
            return [make_problem(*t, split=split) for t in rng.sample(held_out, n)]
        if split == "zero_padded":
            pool = _single_digit_operand_problems()
            return [make_problem(*t, split=split, width=2) for t in rng.sample(pool, n)]
        if split == "retained":
            return [make_problem(*t, split=split) for t in rng.sample(retained_facts(), n)]
        lo, hi = OUT_OF_DOMAIN_RANGE
        width = hi - lo + 1
        total = self.distinct_problems(split)
        # Sample indices without replacement instead of materialising 1.6M tuples.
        out = []
        for index in rng.sample(range(total), n):
            index, b = divmod(index, width)
            a, op = divmod(index, len(OPERATORS))
            out.append(make_problem(lo + a, OPERATORS[op], lo + b, split=split))
        return out

