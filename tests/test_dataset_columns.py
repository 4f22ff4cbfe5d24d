"""Datasets in another schema than the task's load through a column mapping (the task option
`columns`, or a source's own `columns`), applied before the task's row converter; without it
their rows are malformed."""
from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from rewards import get_task
from rewards.config import TaskConfig
from rewards.dataset_rows import DatasetSource, MalformedRows, rename_columns

GSM8K_ROWS = [
    {"question": "Natalia sold clips to 48 friends in April, and half as many in May. "
                 "How many clips did she sell altogether?",
     "answer": "In May she sold 48/2 = <<48/2=24>>24 clips.\n48+24 = <<48+24=72>>72\n#### 72"},
    {"question": "Weng earns $12 an hour. How much did she earn for 50 minutes?",
     "answer": "12/60 = $<<12/60=0.2>>0.2 per minute.\n0.2 x 50 = $<<0.2*50=10>>10\n#### 10"},
    {"question": "What is 3 squared?", "answer": "3*3 = 9\n#### 9"},
]
GSM8K_COLUMNS = {"question": "problem", "answer": "solution"}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def test_gsm8k_rows_load_for_the_math_task_after_mapping(tmp_path):
    path = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS + [{"text": "no question"}])
    task = get_task("math", path=path, columns=GSM8K_COLUMNS)
    problems = task.problems("in_domain")
    assert [p.answer for p in problems] == ["72", "10", "9"]
    assert problems[0].prompt.startswith(GSM8K_ROWS[0]["question"])
    assert task.skipped_rows == {"in_domain": 1}  # the row without a question
    assert task.scorer("so \\boxed{72}", problems[0]) == 1.0


def test_without_the_mapping_the_rows_are_malformed(tmp_path):
    path = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS)
    with pytest.raises(MalformedRows, match=r"3 rows, 3 malformed.*task option `columns`"):
        get_task("math", path=path).problems("in_domain")


def test_a_source_may_carry_its_own_mapping(tmp_path):
    gsm8k = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS)
    native = write_jsonl(tmp_path / "math.jsonl", [{"problem": "1+1?", "answer": "2"}])
    task = get_task("math", train={"name": gsm8k, "columns": GSM8K_COLUMNS}, in_domain=native)
    assert [p.answer for p in task.problems("train")] == ["72", "10", "9"]
    assert [p.answer for p in task.problems("in_domain")] == ["2"]


def test_training_prompts_load_through_the_task_config(tmp_path):
    from cluster.train.prompts import PromptStream

    path = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS)
    cfg = TaskConfig(name="math", options={"path": path, "columns": GSM8K_COLUMNS})
    problems, group_ids = PromptStream(cfg, seed=0).next_batch(4)
    assert group_ids == [0, 1, 2, 3]
    assert {p.answer for p in problems} <= {"72", "10", "9"}


def test_mmlu_rows_in_another_schema(tmp_path):
    rows = [{"q": "Which is a noble gas?", "options": ["O", "Ne", "N", "C"], "label": 1},
            {"q": "Unit of force?", "options": ["N", "J"], "label": "A"}]
    path = write_jsonl(tmp_path / "mcq.jsonl", rows)
    columns = {"q": "question", "options": "choices", "label": "answer"}
    problems = get_task("mmlu", path=path, columns=columns).problems("out_of_domain")
    assert sorted(p.answer for p in problems) == ["A", "B"]
    with pytest.raises(MalformedRows, match="2 rows, 2 malformed"):
        get_task("mmlu", path=path).problems("out_of_domain")
    with pytest.raises(ValueError, match="columns"):
        get_task("mmlu", columns=columns)  # the hub set is in the task's schema already


def test_mappings_are_checked():
    assert rename_columns({"a": 1, "b": 2, "c": 3}, {"a": "b"}) == {"b": 1, "c": 3}
    assert rename_columns(["not", "a", "row"], {"a": "b"}) == ["not", "a", "row"]
    with pytest.raises(ValidationError, match="same name"):
        DatasetSource(name="x.jsonl", columns={"a": "problem", "b": "problem"})
    with pytest.raises(ValidationError, match="empty"):
        DatasetSource(name="x.jsonl", columns={"a": ""})
    with pytest.raises(ValueError, match="columns"):
        get_task("math", columns=GSM8K_COLUMNS)  # no dataset given: the defaults are MATH's
