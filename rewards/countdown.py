"""Countdown: combine given numbers with + - * / and parentheses to reach a target.

Every generated problem is solvable by construction: the generator builds a random expression
over a subset of the drawn numbers and takes its (positive integer) value as the target; that
expression is the problem's `answer` (one solution among possibly many).

Generated splits:
- "train" and "in_domain": 3 or 4 numbers in [1, 50], target in [1, 100]. A fixed hash of
  (numbers, target) holds out 1 problem in 10 for in_domain; train never produces those.
- "out_of_domain": 5 numbers in [1, 50], target in [101, 999] (longer searches, bigger targets).

The scorer reads the last <answer>...</answer> of the completion, or its first line when it
has no such tag; an optional trailing "= <target>" is allowed. Reward 1.0 when the expression
is valid (see rewards.expression), uses each given number at most as often as it is given, and
equals the target exactly; else 0.0.

Datasets: any split may come from a dataset instead of the generator (options `train`,
`in_domain`, `out_of_domain`; `true` names HUB_DATASET, the set of the TinyZero and TBA
experiments). Rows have `target` (an integer) and `nums` (a list of 2 to MAX_NUMBERS
integers), the schema of that set; other schemas go through the `columns` option. A dataset
row carries no solution: its problem's `answer` is the target. The 1-in-10 held-out
partition applies to generated splits only: a dataset split is used as it is.
"""
from __future__ import annotations

import hashlib
import random
import re
from collections import Counter
from fractions import Fraction
from typing import Any

from rewards.dataset_rows import DatasetSource, load_problems, sample_problems
from rewards.expression import MAX_CHARS, MAX_LITERAL_DIGITS, ExpressionError, evaluate
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
# The countdown set of TinyZero and of the TBA paper: ~490k rows of 3 or 4 numbers in [1, 99],
# columns `target` and `nums`, one hub split ("train"; those experiments hold out its last rows).
HUB_DATASET = "Jiayi-Pan/Countdown-Tasks-3to4"
MAX_NUMBERS = 10
_MAX_INTEGER = 10**MAX_LITERAL_DIGITS - 1  # the largest literal (and stated target) scored

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


def countdown_row_to_problem(row: Any, index: int, split: str) -> Problem:
    """A Problem from one dataset row: `target` (an integer) and `nums` (2 to MAX_NUMBERS
    integers), each a non-negative integer the scorer can read (at most 6 digits). An
    integer written as a string ("24") is accepted; a float, bool or anything else is not."""
    if not isinstance(row, dict):
        raise TypeError(f"row is {type(row).__name__}, not an object")
    numbers = row["nums"]
    if not isinstance(numbers, (list, tuple)) or not 2 <= len(numbers) <= MAX_NUMBERS:
        raise ValueError(f"field 'nums' must be a list of 2 to {MAX_NUMBERS} integers")
    numbers = [_row_integer(x, "nums") for x in numbers]
    target = _row_integer(row["target"], "target")
    return make_problem(numbers, target, str(target), split)


def _row_integer(value: Any, field: str) -> int:
    if isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_INTEGER:
        raise ValueError(f"field {field!r}: {value!r} is not an integer in [0, {_MAX_INTEGER}]")
    return value


def dataset_source(value: Any) -> DatasetSource | None:
    """A split's source from its option: None or False (generated), True (HUB_DATASET's
    train split), a path or hub name, or a mapping {name (default HUB_DATASET), config,
    split (default train), columns}."""
    if value is None or value is False:
        return None
    if value is True:
        return DatasetSource(name=HUB_DATASET, split="train")
    if isinstance(value, dict) and "name" not in value:
        value = {"name": HUB_DATASET, **value}
    return DatasetSource.coerce(value, "train")


class CountdownTask(Task):
    """Countdown: seeded, solvable problems, or the rows of a dataset.

    Options (each split generated unless given a dataset source):
    - train, in_domain, out_of_domain: `true` for HUB_DATASET (Jiayi-Pan/Countdown-Tasks-3to4,
      hub split train), a local .jsonl/.json/.parquet path, another hub name, or a mapping
      {name, config, split, columns} for `datasets.load_dataset` (name defaults to
      HUB_DATASET; a sliced split such as "train[:99%]" / "train[99%:]" keeps training and
      evaluation rows apart). Two splits may not read the same rows.
    - columns: {source column: this task's column} renaming applied to every row of the
      sources given above, e.g. {numbers: nums}.
    Datasets are loaded when a split is first asked for; `skipped_rows[split]` counts the
    malformed rows left out.
    """

    name = "countdown"
    splits = ("train", "in_domain", "out_of_domain")
    scorer = staticmethod(score_countdown)
    max_new_tokens = 64

    def __init__(self, train: Any = None, in_domain: Any = None, out_of_domain: Any = None,
                 columns: dict[str, str] | None = None):
        given = {"train": train, "in_domain": in_domain, "out_of_domain": out_of_domain}
        self.sources = {split: source.with_columns(columns) for split, value in given.items()
                        if (source := dataset_source(value)) is not None}
        if columns and not self.sources:
            raise ValueError("countdown: `columns` renames the columns of the datasets given by "
                             "train/in_domain/out_of_domain, and none is given")
        seen: dict[tuple, str] = {}
        for split, source in self.sources.items():
            key = (source.name, source.config, source.split)
            if key in seen:
                raise ValueError(
                    f"countdown: {seen[key]} and {split} read the same rows ({source.label()}); "
                    "give the evaluation split other rows, e.g. train: {split: 'train[:99%]'}, "
                    f"{split}: {{split: 'train[99%:]'}}")
            seen[key] = split
        self.finite_splits = tuple(self.sources)
        self.skipped_rows: dict[str, int] = {}
        self._loaded: dict[str, list[Problem]] = {}

    def _draw(self, split: str, n: int | None, rng: random.Random) -> list[Problem]:
        if split in self.sources:
            if split not in self._loaded:
                self._loaded[split], self.skipped_rows[split] = load_problems(
                    self.sources[split], lambda row, i: countdown_row_to_problem(row, i, split))
            return sample_problems(self._loaded[split], split, n, rng)
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
