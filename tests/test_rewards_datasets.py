"""Dataset rows from local files: malformed rows are skipped and counted with one clear
warning, never a crash; jsonl, json and parquet files load the same way."""
from __future__ import annotations

import json
import logging

import pytest

from rewards import get_task
from rewards.dataset_rows import MalformedRows

GOOD_MATH = {"problem": "What is 2+3?", "solution": "It is $\\boxed{5}$."}
BAD_MATH_LINES = [
    "{not json",                                            # not JSON at all
    json.dumps({"solution": "\\boxed{1}"}),                 # no problem
    json.dumps({"problem": "Q?"}),                          # neither answer nor solution
    json.dumps({"problem": "Q?", "solution": "no box"}),    # solution without a boxed answer
    json.dumps({"problem": ["a list"], "answer": "1"}),     # wrong type
    json.dumps({"problem": "   ", "answer": "1"}),          # empty text
    json.dumps({"problem": "Q?", "solution": "\\boxed{1"}),  # unclosed box
    json.dumps(["a", "row", "that", "is", "a", "list"]),
    json.dumps(42),
    json.dumps({"problem": "Q?", "answer": "x" * 10_000}),  # an "answer" no one can box
]


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def test_malformed_math_rows_are_skipped_counted_and_logged(tmp_path, caplog):
    lines = [json.dumps(GOOD_MATH)] + BAD_MATH_LINES + ["", json.dumps(
        {"problem": "What is 1+1?", "answer": 2})]  # blank line ignored; int answer accepted
    path = write_lines(tmp_path / "rows.jsonl", lines)
    task = get_task("math", path=path)
    with caplog.at_level(logging.WARNING, logger="rewards.dataset_rows"):
        problems = task.problems("in_domain")
    assert [p.answer for p in problems] == ["5", "2"]
    assert task.skipped_rows == {"in_domain": len(BAD_MATH_LINES)}
    (record,) = [r for r in caplog.records if "malformed" in r.getMessage()]
    message = record.getMessage()
    assert f"skipped {len(BAD_MATH_LINES)} malformed row(s) of {len(BAD_MATH_LINES) + 2}" in message
    assert "rows.jsonl" in message and "row 1: ValueError: not JSON" in message


def test_a_file_without_one_usable_row_is_a_clear_error(tmp_path):
    path = write_lines(tmp_path / "bad.jsonl", BAD_MATH_LINES)
    with pytest.raises(MalformedRows, match=r"bad.jsonl: no usable rows \(10 rows, 10 malformed"):
        get_task("math", path=path).problems("train")
    with pytest.raises(FileNotFoundError):
        get_task("math", path=str(tmp_path / "missing.jsonl")).problems("train")


def test_malformed_mmlu_rows(tmp_path, caplog):
    good = {"question": "Q?", "choices": ["a", "b", "c", "d"], "answer": 1, "subject": "s"}
    bad = [
        {**good, "answer": 4}, {**good, "answer": -1}, {**good, "answer": "Z"},
        {**good, "answer": True}, {**good, "answer": 1.5}, {**good, "choices": ["only one"]},
        {**good, "choices": "abcd"}, {**good, "choices": ["a", None, "c", "d"]},
        {k: v for k, v in good.items() if k != "question"}, {**good, "choices": ["x"] * 11},
    ]
    path = write_lines(tmp_path / "mmlu.jsonl", [json.dumps(r) for r in [good, *bad]] + [
        json.dumps({**good, "answer": "d"})])
    task = get_task("mmlu", path=path)
    with caplog.at_level(logging.WARNING, logger="rewards.dataset_rows"):
        problems = task.problems("out_of_domain")
    assert [p.answer for p in problems] == ["B", "D"]
    assert task.skipped_rows == {"out_of_domain": len(bad)}
    assert any(f"skipped {len(bad)} malformed" in r.getMessage() for r in caplog.records)


def test_json_and_parquet_files_load_like_jsonl(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    rows = [GOOD_MATH, {"problem": "What is 1+1?", "solution": "", "answer": "2"}]
    json_path = tmp_path / "rows.json"
    json_path.write_text(json.dumps(rows))
    parquet_path = tmp_path / "rows.parquet"
    datasets.Dataset.from_list(
        [{"problem": r["problem"], "solution": r["solution"], "answer": r.get("answer", "")}
         for r in rows]).to_parquet(str(parquet_path))
    for path in (json_path, parquet_path):
        problems = get_task("math", path=str(path)).problems("in_domain")
        assert [p.answer for p in problems] == ["5", "2"], path
    (tmp_path / "object.json").write_text(json.dumps({"rows": rows}))
    with pytest.raises(ValueError, match="must hold a list"):
        get_task("math", path=str(tmp_path / "object.json")).problems("in_domain")
