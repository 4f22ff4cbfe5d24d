"""The math task: the shipped fixture, math-verify equivalence on the last \\boxed{} answer,
and pathological answers that finish within the scoring timeout."""
from __future__ import annotations

import threading

import pytest

from rewards import ScoringPool, get_task
from rewards.boxed_math import DEFAULT_SOURCES, MAX_ANSWER_CHARS, last_boxed, score_math
from rewards.dataset_rows import DatasetSource

TASK = get_task("math", path="fixture")
BY_ANSWER = {p.answer: p for p in TASK.problems("in_domain")}


def test_fixture_loads_every_row_with_an_answer():
    problems = TASK.problems("in_domain")
    assert len(problems) >= 20 and TASK.skipped_rows == {"in_domain": 0}
    assert len({p.uid for p in problems}) == len(problems)
    for p in problems:
        assert p.answer and p.prompt.endswith("\\boxed{}.")
        assert score_math(f"So the answer is $\\boxed{{{p.answer}}}$.", p) == 1.0
    assert TASK.splits == ("train", "in_domain")


@pytest.mark.parametrize("answer,completion,reward", [
    ("\\frac{1}{2}", "\\boxed{0.5}", 1.0),
    ("\\frac{1}{2}", "The probability is \\boxed{1/2}.", 1.0),
    ("\\frac{3}{4}", "\\boxed{\\dfrac{3}{4}}", 1.0),
    ("\\frac{3}{4}", "\\boxed{\\frac{4}{3}}", 0.0),
    ("5\\sqrt{2}", "\\boxed{\\sqrt{50}}", 1.0),
    ("x^2 - x - 6", "\\boxed{(x+2)(x-3)}", 1.0),
    ("(3, 2)", "\\boxed{(2, 3)}", 0.0),                 # ordered pair: order matters
    ("(-3, 3)", "\\boxed{[-3, 3]}", 0.0),               # open vs closed interval
    ("2, 3", "\\boxed{3, 2}", 1.0),                     # a set of solutions
    ("50", "\\boxed{49} no wait, \\boxed{50}", 1.0),   # the last box counts
    ("50", "\\boxed{50} no wait, \\boxed{49}", 0.0),
    ("50", "The answer is 50.", 0.0),                   # the answer must be boxed
    ("50", "\\boxed{50", 0.0),                          # unclosed
    ("50", "\\fbox{50}", 1.0),
    ("9\\pi", "\\boxed{9\\pi}", 1.0),
])
def test_equivalence(answer, completion, reward):
    assert score_math(completion, BY_ANSWER[answer]) == reward


def test_last_boxed():
    assert last_boxed("a \\boxed{\\frac{1}{2}} b") == "\\frac{1}{2}"
    assert last_boxed("\\boxed {x}") == "x"
    assert last_boxed("\\boxed{\\{1, 2\\}}") == "\\{1, 2\\}"
    assert last_boxed("\\boxed{}") is None
    assert last_boxed("\\boxedx{1}") is None
    assert last_boxed("no box") is None
    assert last_boxed("\\boxed{" + "{" * 17 + "1" + "}" * 17 + "}") is None  # too deep
    assert last_boxed("\\boxed{" + "1" * (MAX_ANSWER_CHARS + 1) + "}") is None
    assert last_boxed("\\boxed{" + "1" * (MAX_ANSWER_CHARS - 1) + "}") is not None


def test_scores_in_a_non_main_thread():
    result = []
    thread = threading.Thread(target=lambda: result.append(
        score_math("\\boxed{0.5}", BY_ANSWER["\\frac{1}{2}"])))
    thread.start()
    thread.join(timeout=30)
    assert result == [1.0]


PATHOLOGICAL = {
    "nested fractions": "\\boxed{" + "\\frac{1}{" * 15 + "2" + "}" * 15 + "}",
    "too deeply nested": "\\boxed{" + "\\frac{1}{" * 1000 + "2" + "}" * 1000 + "}",
    "power tower": "\\boxed{9^{9^{9^{9}}}}",
    "python power": "\\boxed{9**9**9}",
    "huge factorial": "\\boxed{100000000!}",
    "megabytes then answer": "x" * 5_000_000 + "\\boxed{50}",
    "megabytes of braces": "\\boxed{" + "{" * 3_000_000,
    "many boxes": "\\boxed{1}" * 300_000,
    "long sum": "\\boxed{" + "+".join(["x"] * 240) + "}",
}


def test_pathological_answers_finish_within_the_timeout():
    problem = BY_ANSWER["50"]
    completions = list(PATHOLOGICAL.values())
    # math-verify's own alarms bound each parse and the verify at VERIFY_TIMEOUT_S (2 s); a
    # worker's first call also imports math-verify and sympy. Over 5 s, "nested fractions"
    # was killed on a loaded machine (beside a sweep and the other xdist worker); 15 s still
    # kills, and so fails, any work the alarms do not bound.
    with ScoringPool(workers=2, timeout_s=15.0) as pool:
        results = pool.score(TASK.scorer,
                             [problem] * len(completions), completions)
    for name, result in zip(PATHOLOGICAL, results):
        assert result.failure is None, (name, result)  # finished on its own, not killed
        assert result.reward == (1.0 if name == "megabytes then answer" else 0.0), name


def test_sources_default_to_the_papers_datasets_without_loading_them():
    task = get_task("math")
    assert task.sources == DEFAULT_SOURCES
    assert task.sources["in_domain"] == DatasetSource(name="HuggingFaceH4/MATH-500", split="test")
    assert task._loaded == {}  # nothing fetched until a split is asked for
    custom = get_task("math", in_domain={"name": "org/set", "config": "c"},
                      out_of_domain="other/set")
    assert custom.splits == ("train", "in_domain", "out_of_domain")
    assert custom.sources["in_domain"] == DatasetSource(name="org/set", config="c", split="test")
    assert custom.sources["out_of_domain"].split == "test"


def test_hub_dataset_is_read_through_datasets_load_dataset(monkeypatch):
    import datasets

    calls = []

    def load_dataset(name, config=None, split=None):
        calls.append((name, config, split))
        return datasets.Dataset.from_list([
            {"problem": "1+1?", "solution": "It is $\\boxed{2}$.", "level": "Level 1",
             "type": "Algebra"},
            {"problem": "2+2?", "solution": "no box here", "level": "Level 1", "type": "Algebra"},
        ])

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    task = get_task("math")
    problems = task.problems("train")
    assert calls == [("DigitalLearningGmbH/MATH-lighteval", None, "train")]
    assert [p.answer for p in problems] == ["2"] and task.skipped_rows == {"train": 1}
    assert problems[0].uid == "math/train/DigitalLearningGmbH/MATH-lighteval:train#0"


def test_sampling_from_a_loaded_split():
    everything = TASK.problems("in_domain")
    five = TASK.problems("in_domain", 5, seed=1)
    assert len({p.uid for p in five}) == 5
    assert five == TASK.problems("in_domain", 5, seed=1) != TASK.problems("in_domain", 5, seed=2)
    assert len(TASK.problems("in_domain", 1000)) == len(everything)  # evaluation: all there is
    train = TASK.problems("train", 3 * len(everything) + 1, seed=0)  # train: epochs
    assert len(train) == 3 * len(everything) + 1
    first_epoch = train[: len(everything)]
    assert sorted(p.uid for p in first_epoch) == sorted(
        p.uid.replace("in_domain", "train") for p in everything)


def test_the_plain_template_puts_ones_own_problems_as_they_are(tmp_path):
    """Issue 48: one's own question-answer data (`a+b=` prompts) scored 0% under the boxed
    template. template=plain sends the problem text unchanged and reads the first line."""
    import json

    rows = tmp_path / "sums.jsonl"
    rows.write_text("".join(json.dumps({"problem": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                            for a, b in ((2, 3), (10, 7))))
    plain = get_task("math", path=str(rows), template="plain")
    problems = plain.problems("in_domain")
    assert sorted(p.prompt for p in problems) == ["10+7=", "2+3="]
    two = next(p for p in problems if p.prompt == "2+3=")
    assert score_math("5\n2+4=6", two) == 1.0 and score_math(" 5 ", two) == 1.0
    assert score_math("6\n5", two) == 0.0 and score_math("", two) == 0.0
    boxed = get_task("math", path=str(rows)).problems("in_domain")
    assert all(p.prompt.endswith("\\boxed{}.") for p in boxed)
    assert score_math("5", boxed[0]) == 0.0  # the boxed template reads only a box
    with pytest.raises(ValueError, match="template 'raw' is not one of boxed, plain"):
        get_task("math", path=str(rows), template="raw")
