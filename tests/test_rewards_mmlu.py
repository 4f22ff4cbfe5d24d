"""The mmlu task: lettered prompts, letter extraction, subjects, and the hub path."""
from __future__ import annotations

import time

import pytest

from rewards import get_task
from rewards.mmlu import DEFAULT_SUBJECTS, extract_letter, score_mmlu

TASK = get_task("mmlu", path="fixture")


def test_fixture_prompts_and_gold_letters():
    problems = TASK.problems("out_of_domain")
    assert len(problems) >= 15 and TASK.splits == ("out_of_domain",)
    subjects = {p.metadata["subject"] for p in problems}
    assert {"high_school_physics", "high_school_chemistry", "high_school_biology"} <= subjects
    for p in problems:
        choices = p.metadata["choices"]
        assert p.prompt.splitlines()[2:2 + len(choices)] == [
            f"{letter}. {c}" for letter, c in zip("ABCD", choices)]
        assert score_mmlu(p.answer, p) == 1.0
        assert score_mmlu(f"The answer is {p.answer}.", p) == 1.0
        wrong = next(letter for letter in "ABCD" if letter != p.answer)
        assert score_mmlu(f"The answer is {wrong}.", p) == 0.0
    assert {p.answer for p in problems} == set("ABCD")  # letters and indices both parsed


@pytest.mark.parametrize("completion,letter", [
    ("B", "B"), ("(B)", "B"), ("B. 60 km/h", "B"), ("  C\n", "C"), ("The answer is B.", "B"),
    ("answer: (C)", "C"), ("The answer is **C**", "C"), ("Answer: D", "D"),
    ("I think A, but \\boxed{D}", "D"), ("answer is A... no, the answer is C", "C"),
    ("A cat sat", None), ("The answer is a bit unclear", None), ("Answer: E", None),
    ("b", None), ("", None), ("The answer is Because", None), ("none of them", None),
])
def test_extract_letter(completion, letter):
    assert extract_letter(completion) == letter


def test_extraction_on_megabytes_is_fast():
    start = time.perf_counter()
    assert extract_letter("answer " * 1_000_000 + "The answer is C") == "C"
    assert extract_letter("(" * 5_000_000) is None
    assert time.perf_counter() - start < 1.0


def test_subject_filter_and_sampling():
    biology = get_task("mmlu", path="fixture", subjects=["college_biology"])
    problems = biology.problems("out_of_domain")
    assert problems and {p.metadata["subject"] for p in problems} == {"college_biology"}
    assert TASK.problems("out_of_domain", 4, seed=1) == TASK.problems("out_of_domain", 4, seed=1)
    with pytest.raises(ValueError, match="no problems for subjects"):
        get_task("mmlu", path="fixture", subjects=["astronomy"]).problems("out_of_domain")
    with pytest.raises(ValueError, match="no split 'train'"):
        TASK.problems("train")


def test_hub_subjects_are_read_through_datasets_load_dataset(monkeypatch):
    import datasets

    calls = []

    def load_dataset(name, config=None, split=None):
        calls.append((name, config, split))
        return datasets.Dataset.from_list([
            {"question": f"Q about {config}?", "subject": config, "choices": ["w", "x", "y", "z"],
             "answer": 2},
        ])

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    problems = get_task("mmlu").problems("out_of_domain")
    assert calls == [("cais/mmlu", subject, "test") for subject in DEFAULT_SUBJECTS]
    assert [p.answer for p in problems] == ["C"] * len(DEFAULT_SUBJECTS)
    calls.clear()
    get_task("mmlu", subjects="virology", hub_split="validation").problems("out_of_domain")
    assert calls == [("cais/mmlu", "virology", "validation")]
