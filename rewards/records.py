"""Typed records at the rewards boundary: a problem handed to the policy, a scoring outcome,
and the task interface every prompt source implements."""
from __future__ import annotations

import difflib
import random
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

Scorer = Callable[["str", "Problem"], float]
"""A scorer maps (completion text, problem) to a reward. It must be a module-level function
(importable by name) so that scoring worker processes can unpickle it."""


class Problem(BaseModel):
    """One prompt with its verifiable answer.

    `prompt` is the exact text given to the policy; `answer` the ground truth the task's scorer
    checks against (a string even when numeric, e.g. "-17"). `uid` identifies the problem's
    content within its task and split (the same problem drawn twice has the same uid).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    uid: str
    task: str
    split: str
    prompt: str
    answer: str
    metadata: dict[str, Any] = Field(default_factory=dict)


class ScoreResult(BaseModel):
    """The outcome of scoring one completion: `reward` is 0.0 whenever `failure` is set.

    failure kinds: "timeout" (the scorer ran past the pool's per-item limit), "exception" (it
    raised), "invalid_value" (it returned None, NaN, inf or a non-number), "memory" (it hit the
    worker's memory limit), "crash" (the worker process died).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    reward: float = 0.0
    failure: str | None = None
    detail: str | None = None  # short human-readable reason, e.g. the exception message


class Task(ABC):
    """A prompt source plus a verifiable scorer.

    Subclasses set `name`, `splits` and `scorer` (a module-level function, so it pickles into
    scoring workers) and implement `_draw(split, n, rng)`. `problems` is deterministic for a
    (split, n, seed): the random stream is seeded from the task name, split and seed, so two
    splits never share a stream.

    A split is either generated (drawn at random without end: arithmetic, countdown's
    generator) or finite: the rows of a dataset, listed in `finite_splits`. For a finite split,
    `problems(split, n=None)` must give every row, in file order, which `rows(split)` returns;
    the training stream goes through a finite split epoch by epoch
    (cluster/train/prompts.py), and through a generated one by seeded draws.
    """

    name: ClassVar[str]
    splits: tuple[str, ...]
    scorer: Scorer
    max_new_tokens: int = 32  # completion budget the evaluation uses by default
    finite_splits: tuple[str, ...] = ()  # the splits that are datasets (set per instance)

    def problems(self, split: str, n: int | None = None, seed: int = 0) -> list[Problem]:
        """`n` problems of `split` (None: the split's default size), deterministic for `seed`."""
        self.check_split(split)
        if n is not None and n < 0:
            raise ValueError(f"n must be >= 0 or None, got {n}")
        # A str seed is hashed with SHA-512 by `random`: stable across runs and PYTHONHASHSEED.
        rng = random.Random(f"{self.name}:{split}:{seed}")
        return self._draw(split, n, rng)

    def distinct_problems(self, split: str) -> int | None:
        """How many distinct problems `split` holds, where that is known without loading any
        data; None where it is not (a split drawn with replacement, a dataset not yet read).
        An evaluation asking a split for more than it holds is refused before a run starts
        (`check_count`, from EvalConfig.check_sets and `klrl eval --n`); the final evaluation
        takes such a set whole (actors.evaluate.problems_of)."""
        self.check_split(split)
        return None

    def check_count(self, split: str, n: int) -> None:
        """ValueError when `split` is known to hold fewer than `n` distinct problems."""
        size = self.distinct_problems(split)
        if size is not None and n > size:
            raise ValueError(f"{self.name} split {split!r} holds {size} distinct problems; "
                             f"asked for {n}")

    def is_finite(self, split: str) -> bool:
        """Whether `split` is a finite list of rows (a dataset), not generated without end.
        Known without loading any data."""
        self.check_split(split)
        return split in self.finite_splits

    def rows(self, split: str) -> list[Problem]:
        """Every problem of a finite split, in file order (loads the dataset on first use).
        ValueError for a generated split, which has no rows to list."""
        if not self.is_finite(split):
            raise ValueError(f"task {self.name!r} split {split!r} is generated (drawn at "
                             "random without end), not a dataset: it has no rows to list")
        return self.problems(split, n=None)

    def check_split(self, split: str) -> None:
        """Raise ValueError, naming the splits there are, when `split` is not one of them."""
        if split not in self.splits:
            # A typo, not another split (in_domain and out_of_domain are close in spelling).
            close = [c for c in difflib.get_close_matches(split, self.splits, n=1, cutoff=0.8)
                     if abs(len(c) - len(split)) <= 2]
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"task {self.name!r} has no split {split!r}{hint}; "
                             f"its splits are {', '.join(self.splits)}")

    @abstractmethod
    def _draw(self, split: str, n: int | None, rng: random.Random) -> list[Problem]:
        ...

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, splits={self.splits})"
