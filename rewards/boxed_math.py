"""MATH-style problems whose answer is the last \\boxed{...} of the completion, checked for
mathematical equivalence with math-verify (e.g. \\frac{1}{2}, 0.5 and 1/2 all match).

Rows need a `problem` (text) and either an `answer` or a `solution` whose last \\boxed{} holds
the answer (MATH's format), or whose last line is "#### answer" (GSM8K's format); an optional
`unique_id` names the problem. Datasets with other column names are read through the
`columns` option, e.g. GSM8K: {question: problem, answer: solution}.
"""
from __future__ import annotations

import random
import re
import threading
from typing import Any

from rewards.dataset_rows import (
    DATA_DIR,
    DatasetSource,
    load_problems,
    require_text,
    sample_problems,
)
from rewards.records import Problem, Task

DEFAULT_SOURCES = {
    # The paper's setup: MATH training set, MATH500 as the in-domain evaluation.
    "train": DatasetSource(name="DigitalLearningGmbH/MATH-lighteval", split="train"),
    "in_domain": DatasetSource(name="HuggingFaceH4/MATH-500", split="test"),
}
HUB_SPLITS = {"train": "train", "in_domain": "test", "out_of_domain": "test"}  # for bare names
FIXTURE = DATA_DIR / "math_fixture.jsonl"
PROMPT_SUFFIX = " Let's think step by step and output the final answer within \\boxed{}."
# How a problem is put and its answer read (MathTask's `template` option): boxed adds
# PROMPT_SUFFIX and reads the last \boxed{}; plain sends the problem text as it is and reads
# the completion's first line (e.g. "2+3=" -> "5"). Recorded in each Problem's metadata.
TEMPLATES = ("boxed", "plain")
ANSWER_IN = "answer_in"
MAX_ANSWER_CHARS = 500    # a boxed answer longer than this is not an answer worth parsing
MAX_ANSWER_DEPTH = 16     # brace nesting inside the box (MATH answers stay under 6)
VERIFY_TIMEOUT_S = 2      # math-verify's own per-call alarm (whole seconds)

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_FINAL_LINE = re.compile(r"^####[ \t]*(\S.*?)[ \t]*$", re.MULTILINE)  # GSM8K: "#### 72"


def first_line(text: str) -> str | None:
    """The completion's first line, stripped (the answer of the plain template), or None."""
    line = text.strip().split("\n", 1)[0].strip()
    return line if line and len(line) <= MAX_ANSWER_CHARS else None


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (or \\fbox{...}) in `text`, or None when there is
    none, its braces do not close, or it exceeds MAX_ANSWER_CHARS / MAX_ANSWER_DEPTH.
    Linear in the answer's length whatever the size of `text`."""
    start = max(text.rfind(command) for command in _BOX_COMMANDS)
    if start < 0:
        return None
    position = text.find("{", start)
    if position < 0 or text[start:position].strip() not in _BOX_COMMANDS:
        return None  # e.g. "\boxedfoo" or "\boxed 5" (no braces): not a boxed answer
    depth, begin = 0, position + 1
    for index in range(position, min(len(text), begin + MAX_ANSWER_CHARS + 1)):
        char = text[index]
        if char == "{" and text[index - 1] != "\\":
            depth += 1
            if depth > MAX_ANSWER_DEPTH:
                return None
        elif char == "}" and text[index - 1] != "\\":
            depth -= 1
            if depth == 0:
                content = text[begin:index].strip()
                return content or None
    return None


def solution_answer(solution: str) -> str | None:
    """The final answer of a worked solution: its last \\boxed{} (MATH), else the text of
    its last "#### answer" line (GSM8K), else None."""
    boxed = last_boxed(solution)
    if boxed is not None:
        return boxed
    finals = _FINAL_LINE.findall(solution)
    return finals[-1] if finals and len(finals[-1]) <= MAX_ANSWER_CHARS else None


def score_math(completion: str, problem: Problem) -> float:
    """1.0 if the completion's answer is equivalent to problem.answer, else 0.0: its last
    boxed answer, or with the plain template (problem.metadata ANSWER_IN) its first line."""
    predicted = (first_line(completion) if problem.metadata.get(ANSWER_IN) == "first line"
                 else last_boxed(completion))
    if predicted is None:
        return 0.0
    from math_verify import parse, verify  # imported here so `import rewards` stays light

    # math-verify bounds its own work with SIGALRM, which exists only in the main thread.
    timeout = VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold = parse(f"\\boxed{{{problem.answer}}}", parsing_timeout=timeout)
    answer = parse(f"\\boxed{{{predicted}}}", parsing_timeout=timeout)
    if not gold or not answer:
        return 0.0
    return 1.0 if verify(gold, answer, timeout_seconds=timeout) else 0.0


def math_row_to_problem(row: Any, index: int, split: str, source_label: str,
                        template: str = "boxed") -> Problem:
    """A Problem from one dataset row (see the module docstring for the fields), put as
    `template` says (TEMPLATES)."""
    if not isinstance(row, dict):
        raise TypeError(f"row is {type(row).__name__}, not an object")
    text = require_text(row, "problem")
    if row.get("answer") not in (None, ""):
        answer = require_text(row, "answer", MAX_ANSWER_CHARS)
    else:
        answer = solution_answer(require_text(row, "solution"))
        if answer is None:
            raise ValueError("no answer field, and no \\boxed{} or '#### ' answer in the solution")
    uid = str(row.get("unique_id") or f"{source_label}#{index}")
    metadata = {k: row[k] for k in ("level", "type", "subject") if k in row}
    if template == "plain":
        metadata[ANSWER_IN] = "first line"
    return Problem(uid=f"math/{split}/{uid}", task="math", split=split,
                   prompt=text + (PROMPT_SUFFIX if template == "boxed" else ""), answer=answer,
                   metadata=metadata)


class MathTask(Task):
    """MATH-style boxed-answer problems scored with math-verify.

    Options (each source is a local .jsonl/.json/.parquet path, a hub dataset name, or a
    mapping {name, config, split} for `datasets.load_dataset`):
    - train: default the MATH training set (DigitalLearningGmbH/MATH-lighteval, split train).
    - in_domain: default MATH500 (HuggingFaceH4/MATH-500, split test).
    - out_of_domain: optional, any other boxed-answer set (e.g. a file); adds that split.
    - path: one local file for every split (overrides the defaults); "fixture" is the small
      set shipped with klrl (rewards/data/math_fixture.jsonl), for tests and CPU demos.
    - columns: {source column: this task's column} renaming applied to every row of the
      sources given above (not the default hub sets, already in this schema), e.g. GSM8K's
      {question: problem, answer: solution}; a source given as a mapping may carry its own
      `columns` instead. Without it, rows in another schema are malformed.
    - template: boxed (default): the problem with " Let's think step by step and output the
      final answer within \\boxed{}.", answered by the completion's last \\boxed{}; plain:
      the problem text as it is, answered by the completion's first line (one's own
      question-answer data, e.g. "2+3=" answered "5"). Both checked with math-verify.
    Datasets are loaded when a split is first asked for. `skipped_rows[split]` counts the
    malformed rows left out.
    """

    name = "math"
    scorer = staticmethod(score_math)
    max_new_tokens = 1024

    def __init__(self, train: Any = None, in_domain: Any = None, out_of_domain: Any = None,
                 path: str | None = None, columns: dict[str, str] | None = None,
                 template: str = "boxed"):
        if template not in TEMPLATES:
            raise ValueError(f"math: template {template!r} is not one of {', '.join(TEMPLATES)}")
        self.template = template
        if path is not None:
            local = str(FIXTURE) if path == "fixture" else str(path)
            train = train or local
            in_domain = in_domain or local
        given = {"train": train, "in_domain": in_domain, "out_of_domain": out_of_domain}
        if columns and all(value is None for value in given.values()):
            raise ValueError("math: `columns` renames the columns of the datasets given by "
                             "path/train/in_domain/out_of_domain, and none is given")
        self.sources = {
            split: DatasetSource.coerce(value, HUB_SPLITS[split]).with_columns(columns)
            if value is not None else DEFAULT_SOURCES[split]
            for split, value in given.items() if value is not None or split in DEFAULT_SOURCES
        }
        self.splits = self.finite_splits = tuple(self.sources)  # every split is a dataset
        self.skipped_rows: dict[str, int] = {}
        self._loaded: dict[str, list[Problem]] = {}

    def _draw(self, split: str, n: int | None, rng: random.Random) -> list[Problem]:
        if split not in self._loaded:
            source = self.sources[split]
            label = source.short_label()
            self._loaded[split], self.skipped_rows[split] = load_problems(
                source, lambda row, i: math_row_to_problem(row, i, split, label, self.template))
        return sample_problems(self._loaded[split], split, n, rng)
