"""Countdown: solvable seeded problems, and a safe expression evaluator (never eval) that
rejects everything but numbers, + - * / and parentheses, fast, whatever the input."""
from __future__ import annotations

import json
import logging
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


# ---------------------------------------------------------------- countdown from a dataset
ROWS = [{"target": 24, "nums": [1, 3, 4, 6]}, {"target": 10, "nums": [2, 5]},
        {"target": "98", "nums": ["10", 9, 8]}]          # integers written as strings: accepted
BAD_ROWS = [
    {"nums": [1, 2]},                                    # no target
    {"target": 3},                                       # no nums
    {"target": 3, "nums": "1 2"},                        # nums not a list
    {"target": 3, "nums": [3]},                          # one number
    {"target": 3, "nums": list(range(1, 12))},           # eleven numbers
    {"target": 3, "nums": [1, 2.5]},                     # not an integer
    {"target": 3.0, "nums": [1, 2]},                     # a float target
    {"target": True, "nums": [1, 2]},                    # a bool is no number
    {"target": -3, "nums": [1, 2]},                      # negative
    {"target": 3, "nums": [1, 10**7]},                   # more digits than the scorer reads
    {"target": "x", "nums": [1, 2]},
    ["not", "an", "object"],
]


def write_rows(path, rows, extra_lines=()):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "".join(extra_lines))
    return str(path)


def test_dataset_rows_become_problems_and_malformed_rows_are_counted(tmp_path, caplog):
    path = write_rows(tmp_path / "cd.jsonl", ROWS[:1] + BAD_ROWS + ROWS[1:], ["{not json\n"])
    task = get_task("countdown", train=path)
    with caplog.at_level(logging.WARNING, logger="rewards.dataset_rows"):
        problems = task.rows("train")
    assert [(p.metadata["numbers"], p.metadata["target"]) for p in problems] == [
        ([1, 3, 4, 6], 24), ([2, 5], 10), ([10, 9, 8], 98)]   # file order
    assert task.skipped_rows == {"train": len(BAD_ROWS) + 1}
    assert any(f"skipped {len(BAD_ROWS) + 1} malformed" in r.getMessage() for r in caplog.records)
    p = problems[0]
    assert p.answer == "24" and p.uid == "countdown/train/1_3_4_6->24" and p.split == "train"
    assert p.prompt == make_problem([1, 3, 4, 6], 24, "").prompt  # the generator's prompt
    assert score_countdown("<answer>6 / (1 - 3 / 4)</answer>", p) == 1.0
    assert score_countdown("<answer>2 * 5</answer>", problems[1]) == 1.0
    assert score_countdown("<answer>24</answer>", p) == 0.0
    # The dataset split is finite, the generated ones are not; evaluation splits sample it.
    assert task.is_finite("train") and not task.is_finite("in_domain")
    assert task.problems("train", n=2, seed=0) == task.problems("train", n=2, seed=0)
    assert len(task.problems("in_domain", n=5, seed=0)) == 5  # still generated
    with pytest.raises(ValueError, match="generated.*no rows"):
        task.rows("in_domain")


def test_parquet_and_a_column_mapping(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "cd.parquet"
    pq.write_table(pa.table({"numbers": [[1, 3, 4, 6], [2, 5]], "goal": [24, 10]}), path)
    task = get_task("countdown", out_of_domain=str(path), columns={"numbers": "nums",
                                                                   "goal": "target"})
    assert [p.metadata["target"] for p in task.rows("out_of_domain")] == [24, 10]
    assert task.finite_splits == ("out_of_domain",)


def test_sources_default_to_the_hub_set_and_never_overlap():
    from rewards.countdown import HUB_DATASET

    task = get_task("countdown", train=True)  # named, not loaded: no hub access needed
    assert HUB_DATASET == "Jiayi-Pan/Countdown-Tasks-3to4"
    assert task.sources["train"].label() == f"{HUB_DATASET}:train"
    split = get_task("countdown", train={"split": "train[:99%]"},
                     in_domain={"split": "train[99%:]"})
    assert split.sources["in_domain"].label() == f"{HUB_DATASET}:train[99%:]"
    assert get_task("countdown", train=False).finite_splits == ()
    with pytest.raises(ValueError, match="train and in_domain read the same rows"):
        get_task("countdown", train=True, in_domain=True)
    with pytest.raises(ValueError, match="`columns` renames"):
        get_task("countdown", columns={"numbers": "nums"})
    with pytest.raises(ValueError):
        get_task("countdown", train={"nmae": "x.jsonl"})  # a typo in a source's fields
    with pytest.raises(ValueError, match="has no option 'dataset'"):
        get_task("countdown", dataset=True)
