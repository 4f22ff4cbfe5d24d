"""The task registry, the plug-in scorer loader, and the package's purity."""
from __future__ import annotations

import pickle
import subprocess
import sys

import pytest
from pydantic import ValidationError

import rewards
from rewards import Problem, get_task, load_scorer

LOCAL_OPTIONS = {"arithmetic": {}, "countdown": {}, "counting": {},
                 "math": {"path": "fixture"}, "mmlu": {"path": "fixture"}, "calculator": {}}


@pytest.mark.parametrize("name", rewards.TASKS)
def test_every_task_meets_the_contract(name):
    task = get_task(name, **LOCAL_OPTIONS[name])
    assert task.name == name and task.splits and isinstance(task.max_new_tokens, int)
    assert pickle.loads(pickle.dumps(task.scorer)) is task.scorer  # sent to workers by name
    for split in task.splits:
        problems = task.problems(split, 5, seed=0)
        assert len(problems) == 5 and problems == task.problems(split, 5, seed=0)
        for p in problems:
            assert (p.task, p.split) == (name, split) and p.prompt and p.answer
            assert pickle.loads(pickle.dumps(p)) == p
            assert isinstance(task.scorer(p.answer if name != "math" else "", p), float)
    with pytest.raises(ValueError, match="no split"):
        task.problems("nonexistent")
    with pytest.raises(ValueError, match="n must be"):
        task.problems(task.splits[0], -1)


def test_counting_answers_are_long_and_spread():
    """The long-response task: exact answers, lengths from a few characters to about 240 (one
    token each for the byte-level tiny tokenizer), long-tailed, within its max_new_tokens."""
    from rewards.counting import MAX_COUNT, make_problem

    task = get_task("counting")
    p = make_problem(7, 11)
    assert (p.prompt, p.answer) == ("7..11:", "7 8 9 10 11")
    assert task.scorer("7 8 9 10 11\nmore", p) == 1.0 and task.scorer("7 8 9 10", p) == 0.0
    lengths = sorted(len(q.answer) for q in task.problems("train", 2000, seed=0))
    assert lengths[len(lengths) // 2] <= 16 and lengths[-1] >= 150  # median short, tail long
    assert max(len(q.answer.split()) for q in task.problems("train", 2000)) <= MAX_COUNT
    assert lengths[-1] + 1 <= task.max_new_tokens


def test_unknown_task_and_bad_options_are_clear_errors():
    with pytest.raises(ValueError, match="unknown task 'gsm8k'; known tasks: arithmetic"):
        get_task("gsm8k")
    with pytest.raises(ValueError,
                       match="task 'arithmetic' has no option 'digits'; it takes no options"):
        get_task("arithmetic", digits=3)
    with pytest.raises(ValueError, match="has no option 'pth' \\(did you mean 'path'\\?\\); its "
                       "options are train, in_domain, out_of_domain, path, columns"):
        get_task("math", pth="fixture")
    with pytest.raises(ValueError, match="no split 'trian' \\(did you mean 'train'\\?\\)"):
        get_task("countdown").check_split("trian")


def test_problem_is_a_frozen_typed_record():
    p = Problem(uid="u", task="t", split="s", prompt="1+1=", answer="2")
    assert p.metadata == {}
    with pytest.raises(ValidationError):
        p.answer = "3"
    with pytest.raises(ValidationError):
        Problem(uid="u", task="t", split="s", prompt="p", answer=None)
    with pytest.raises(ValidationError):
        Problem(uid="u", task="t", split="s", prompt="p", answer="a", extra_field=1)


def test_load_scorer():
    from rewards.countdown import score_countdown

    assert load_scorer("rewards.countdown:score_countdown") is score_countdown
    assert load_scorer(" scorer_faults:misbehave ").__name__ == "misbehave"


@pytest.mark.parametrize("spec,message", [
    ("rewards.countdown.score_countdown", "not of the form"),
    ("rewards.countdown:", "not of the form"),
    ("rewards/countdown:score", "not of the form"),
    ("no_such_module_xyz:score", "cannot import module 'no_such_module_xyz'"),
    ("rewards.countdown:no_such_function", "has no attribute 'no_such_function'"),
    ("scorer_faults:not_callable", "is a int, not a callable"),
    ("scorer_faults:lambda_scorer", "cannot be sent to scoring workers"),
    ("scorer_faults_broken_import:score", "RuntimeError: broken on import"),
])
def test_load_scorer_errors_name_the_spec(spec, message, tmp_path, monkeypatch):
    (tmp_path / "scorer_faults_broken_import.py").write_text(
        "raise RuntimeError('broken on import')")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=message) as error:
        load_scorer(spec)
    assert repr(spec) in str(error.value)


def test_import_is_pure_and_light():
    code = ("import sys, rewards; rewards.get_task('arithmetic').problems('train', 3); "
            "print(' '.join(sorted(m for m in ('ray', 'vllm', 'deepspeed', 'torch', 'datasets', "
            "'math_verify', 'sympy') if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_task_names_come_from_the_registry():
    """TaskConfig and EvalSet accept exactly the registry's names and the plug-in form; an
    unknown name is one line with the closest name, the known tasks and the plug-in form."""
    from rewards.config import EvalSet, TaskConfig
    from rewards.registry import check_task_name

    for name in rewards.TASKS:
        check_task_name(name)
    check_task_name("klrl_no_such_package.tasks:SomeTask")  # the form only: nothing imported
    with pytest.raises(ValueError) as error:
        check_task_name("arith")
    assert str(error.value) == (
        "unknown task 'arith' (did you mean 'arithmetic'?); known tasks: arithmetic, countdown, "
        "counting, math, mmlu, calculator, or a plug-in task 'package.module:TaskClass' "
        "(a rewards.Task subclass in your own package)")
    with pytest.raises(ValueError, match="task spec 'a.b:C:D' is not of the form "
                                         "'package.module:TaskClass'"):
        check_task_name("a.b:C:D")
    with pytest.raises(ValidationError, match="unknown task 'mmlu2' \\(did you mean 'mmlu'\\?\\)"):
        EvalSet(task="mmlu2", split="out_of_domain")
    # a plug-in's options and split are not checked at load time, where it is not imported
    cfg = TaskConfig(name="klrl_no_such_package.tasks:SomeTask", options={"x": 1}, train_split="t")
    assert cfg.name == "klrl_no_such_package.tasks:SomeTask"
    assert "rewards.Task subclass" in TaskConfig.model_fields["name"].description
    assert all(name in TaskConfig.model_fields["name"].description for name in rewards.TASKS)


BROKEN_TASKS = '''
import random
from rewards import Problem, Task


def score(completion, problem):
    return 0.0


class Good(Task):
    name = "good"
    splits = ("train",)
    scorer = staticmethod(score)

    def __init__(self, size: int = 3):
        self.size = size

    def _draw(self, split, n, rng):
        return [Problem(uid=str(i), task=self.name, split=split, prompt="p", answer="a")
                for i in range(self.size if n is None else n)]


class SplitsList(Good):
    splits = ["train"]


class LambdaScorer(Good):
    scorer = staticmethod(lambda completion, problem: 0.0)


class NoBudget(Good):
    max_new_tokens = 0


class NoName(Good):
    name = ""


class NoDraw(Task):
    name = "nodraw"
    splits = ("train",)
    scorer = staticmethod(score)


class NotATask:
    pass
'''


CONTRACT = "breaks the rewards.Task contract: "


@pytest.mark.parametrize("cls, message", [
    ("SplitsList", CONTRACT + "`splits` must be a non-empty tuple"),
    ("LambdaScorer", CONTRACT + "its scorer cannot be sent to scoring workers"),
    ("NoBudget", CONTRACT + "`max_new_tokens` must be a positive int, got 0"),
    ("NoName", CONTRACT + "`name` must be a non-empty string"),
    ("NoDraw", "does not implement _draw"),
    ("NotATask", "is a class, not a rewards.Task subclass"),
    ("score", "is a function, not a rewards.Task subclass"),
    ("Goood", "has no attribute 'Goood' \\(did you mean 'Good'\\?\\)"),
])
def test_a_plugin_task_that_breaks_the_contract_is_named(tmp_path, monkeypatch, cls, message):
    (tmp_path / "klrl_broken_tasks.py").write_text(BROKEN_TASKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "klrl_broken_tasks", raising=False)
    spec = f"klrl_broken_tasks:{cls}"
    with pytest.raises(ValueError, match=message) as error:
        get_task(spec)
    assert f"task {spec!r}" in str(error.value)


def test_a_plugin_task_is_checked_where_the_run_runs(tmp_path, monkeypatch):
    """rewards.config.check_plugins (the pre-flight's) imports plug-in tasks and makes
    validation's checks, naming the field; the good task builds with its options."""
    from rewards.config import EvalConfig, EvalSet, TaskConfig, check_plugins

    (tmp_path / "klrl_broken_tasks.py").write_text(BROKEN_TASKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "klrl_broken_tasks", raising=False)
    good = "klrl_broken_tasks:Good"
    only_train = EvalConfig(in_domain=EvalSet(split="train"), out_of_domain=None)
    assert get_task(good, size=2).problems("train") == get_task(good).problems("train", 2)
    check_plugins(TaskConfig(name=good, options={"size": 2}), only_train)
    for task, evaluation, message in [
        (TaskConfig(name="klrl_broken_tasks:Goood"), only_train,
         "task.name: .*did you mean 'Good'"),
        (TaskConfig(name=good, options={"sise": 2}), only_train,
         "task.options: .*no option 'sise' \\(did you mean 'size'\\?\\)"),
        (TaskConfig(name=good, train_split="trian"), only_train,
         "task.train_split: .*did you mean 'train'"),
        (TaskConfig(name=good), EvalConfig(),
         "eval.in_domain.split: task 'good' has no split 'in_domain'"),
        (TaskConfig(),
         EvalConfig(out_of_domain=EvalSet(task="klrl_broken_tasks:NoDraw", split="x")),
         "eval.out_of_domain.task: .*does not implement _draw"),
    ]:
        with pytest.raises(ValueError, match=message):
            check_plugins(task, evaluation)
