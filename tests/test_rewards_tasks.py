"""The task registry, the plug-in scorer loader, and the package's purity."""
from __future__ import annotations

import pickle
import subprocess
import sys

import pytest
from pydantic import ValidationError

import rewards
from rewards import Problem, get_task, load_scorer

LOCAL_OPTIONS = {"arithmetic": {}, "countdown": {}, "math": {"path": "fixture"},
                 "mmlu": {"path": "fixture"}}


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


def test_unknown_task_and_bad_options_are_clear_errors():
    with pytest.raises(ValueError, match="unknown task 'gsm8k'; known tasks: arithmetic"):
        get_task("gsm8k")
    with pytest.raises(ValueError, match="task 'arithmetic' has no option 'digits'; it takes no options"):
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
    (tmp_path / "scorer_faults_broken_import.py").write_text("raise RuntimeError('broken on import')")
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
