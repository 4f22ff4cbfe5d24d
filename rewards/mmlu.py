"""MMLU-style multiple choice, for evaluation only (the paper's out-of-domain sets are MMLU
physics, chemistry and biology).

Rows (the `cais/mmlu` schema): `question` (text), `choices` (2 to 10 option texts) and
`answer` (the correct option's 0-based index, or its letter "A", "B", ...); `subject` is
optional. The prompt lists the options as "A. ...", "B. ..." and asks for the letter; the
scorer extracts one letter from the completion (see `extract_letter`).
"""
from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any

from rewards.dataset_rows import (
    DATA_DIR,
    DatasetSource,
    load_problems,
    require_text,
    sample_problems,
)
from rewards.records import Problem, Task

DEFAULT_SUBJECTS = (
    "high_school_physics", "college_physics",
    "high_school_chemistry", "college_chemistry",
    "high_school_biology", "college_biology",
)
HUB_DATASET = "cais/mmlu"
FIXTURE = DATA_DIR / "mmlu_fixture.jsonl"
LETTERS = "ABCDEFGHIJ"
SPLIT = "out_of_domain"

# Where a model states its choice, most explicit first. Only the completion's tail is searched
# (an answer comes last), which also keeps megabytes of text cheap.
_TAIL_CHARS = 2000
_EXPLICIT = [
    re.compile(r"\\boxed\{\s*\(?([A-J])\)?\s*\}"),
    # "answer" in any case, the letter in upper case only ("the answer is a bit..." is no A)
    re.compile(r"(?i:answer)\s*(?:(?i:is)\s*)?:?\s*\(?\**([A-J])\b"),
]
# A bare leading letter must stand alone ("B", "(B)", "B. text"): "A cat..." is not an A.
_LEADING = re.compile(r"\s*\(?([A-J])(?:[).:]|\s*$|\s*\n)")


def extract_letter(completion: str, options: int = 4) -> str | None:
    """The chosen letter: the last "\\boxed{X}", else the last "answer is X" / "Answer: X",
    else a letter opening the completion ("B", "(B)", "B. text"). None when there is none or
    it is outside the first `options` letters."""
    tail = completion[-_TAIL_CHARS:]
    for pattern in _EXPLICIT:
        found = pattern.findall(tail)
        if found:
            letter = found[-1].upper()
            break
    else:
        match = _LEADING.match(completion[:20])
        letter = match.group(1) if match else None
    return letter if letter is not None and letter in LETTERS[:options] else None


def score_mmlu(completion: str, problem: Problem) -> float:
    """1.0 if the extracted letter is the correct option, else 0.0."""
    options = len(problem.metadata.get("choices", ())) or 4
    return 1.0 if extract_letter(completion, options) == problem.answer else 0.0


def format_prompt(question: str, choices: Sequence[str]) -> str:
    lines = [question.strip(), ""]
    lines += [f"{LETTERS[i]}. {choice}" for i, choice in enumerate(choices)]
    lines += ["", "Answer with the letter of the correct option."]
    return "\n".join(lines) + "\n"


def mmlu_row_to_problem(row: Any, index: int, subject: str | None, source_label: str) -> Problem:
    """A Problem from one row (see the module docstring for the fields)."""
    if not isinstance(row, dict):
        raise TypeError(f"row is {type(row).__name__}, not an object")
    question = require_text(row, "question")
    choices = row["choices"]
    if not isinstance(choices, (list, tuple)) or not 2 <= len(choices) <= len(LETTERS):
        raise ValueError(f"choices must be a list of 2 to {len(LETTERS)} options")
    choices = [require_text({"choice": c}, "choice") for c in choices]
    answer = row["answer"]
    if isinstance(answer, str) and len(answer.strip()) == 1 and answer.strip().upper() in LETTERS:
        answer = LETTERS.index(answer.strip().upper())
    if isinstance(answer, bool) or not isinstance(answer, int) or not 0 <= answer < len(choices):
        raise ValueError(f"answer {answer!r} is not an option index or letter")
    subject = str(row.get("subject") or subject or "unknown")
    return Problem(
        uid=f"mmlu/{subject}/{source_label}#{index}", task="mmlu", split=SPLIT,
        prompt=format_prompt(question, choices), answer=LETTERS[answer],
        metadata={"subject": subject, "choices": choices},
    )


class MMLUTask(Task):
    """MMLU multiple choice; one evaluation split, "out_of_domain" (no train split).

    Options:
    - subjects: MMLU subject names (default: physics, chemistry and biology, high school and
      college), each loaded from the hub (`cais/mmlu`, config = subject, split `hub_split`).
    - hub_split: the hub split to read (default "test").
    - path: a local .jsonl/.json/.parquet file (or a list of them) instead of the hub; rows
      whose `subject` is not in `subjects` are left out when `subjects` is given.
      "fixture" is the small set shipped with klrl (rewards/data/mmlu_fixture.jsonl).
    - columns: {source column: this task's column} renaming applied to every row of the
      `path` files (e.g. {options: choices, label: answer}); needs `path` (the hub's
      cais/mmlu is already in this schema).
    """

    name = "mmlu"
    splits = finite_splits = (SPLIT,)
    scorer = staticmethod(score_mmlu)
    max_new_tokens = 256

    def __init__(self, subjects: Sequence[str] | None = None, hub_split: str = "test",
                 path: str | Sequence[str] | None = None, columns: dict[str, str] | None = None):
        if isinstance(subjects, str):
            subjects = [subjects]
        self.subjects = tuple(subjects) if subjects else None
        if path is not None:
            paths = [path] if isinstance(path, str) else list(path)
            self.sources = [(DatasetSource(name=str(FIXTURE) if p == "fixture" else str(p),
                                           columns=columns or {}), None)
                            for p in paths]
        elif columns:
            raise ValueError("mmlu: `columns` renames the columns of `path` files; the hub's "
                             "cais/mmlu is already in this task's schema")
        else:
            self.sources = [(DatasetSource(name=HUB_DATASET, config=s, split=hub_split), s)
                            for s in (self.subjects or DEFAULT_SUBJECTS)]
        self.skipped_rows: dict[str, int] = {}
        self._loaded: list[Problem] | None = None

    def _draw(self, split: str, n: int | None, rng: random.Random) -> list[Problem]:
        if self._loaded is None:
            self._loaded, skipped = [], 0
            for source, subject in self.sources:
                label = source.short_label()
                problems, bad = load_problems(  # the converter runs before the loop moves on
                    source, lambda row, i, s=subject, lb=label: mmlu_row_to_problem(row, i, s, lb))
                self._loaded += problems
                skipped += bad
            self.skipped_rows[split] = skipped
            if self.subjects is not None:
                self._loaded = [p for p in self._loaded if p.metadata["subject"] in self.subjects]
                if not self._loaded:
                    raise ValueError(f"mmlu: no problems for subjects {list(self.subjects)}")
        return sample_problems(self._loaded, split, n, rng)
