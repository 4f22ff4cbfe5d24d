"""Task lookup by name: the one place that says which tasks exist.

A task is named either by a key of `TASKS` (the tasks shipped in rewards/) or, for a task that
lives in the user's own package, by a plug-in spec "package.module:TaskClass" naming a
`rewards.Task` subclass. Every consumer (TaskConfig and EvalSet validation, the prompt stream,
the rollout workers, evaluation, `klrl eval --task`) resolves names through `get_task`, so a
task added here, or a plug-in, is usable everywhere at once.

Task modules are imported on first use, so asking for "arithmetic" never imports
math-verify or datasets; a plug-in is imported only when it is built (never by
`check_task_name`, which config validation calls: see rewards/plugin.py for why).
"""
from __future__ import annotations

import difflib
import importlib
import inspect
from typing import Any

from rewards.plugin import check_sendable, check_spec, import_spec, is_plugin
from rewards.records import Task

# name -> "module:class". Adding a task to klrl is adding its module and one line here.
TASKS = {
    "arithmetic": "rewards.arithmetic:ArithmeticTask",
    "countdown": "rewards.countdown:CountdownTask",
    "counting": "rewards.counting:CountingTask",
    "math": "rewards.boxed_math:MathTask",
    "mmlu": "rewards.mmlu:MMLUTask",
    "calculator": "rewards.calculator:CalculatorTask",
}
PLUGIN_FORM = "package.module:TaskClass"


def check_task_name(name: str) -> None:
    """ValueError unless `name` is a task of TASKS or has the form of a plug-in spec; imports
    nothing. An unknown name gets one line: the closest task, the known tasks and the plug-in
    form."""
    if is_plugin(name):
        check_spec(name, "task", PLUGIN_FORM)
    elif name not in TASKS:
        raise ValueError(f"unknown task {name!r}{_hint(name, TASKS)}; known tasks: "
                         f"{', '.join(TASKS)}, or a plug-in task {PLUGIN_FORM!r} (a rewards.Task "
                         "subclass in your own package)")


def task_class(name: str) -> type[Task]:
    """The class of task `name` (a key of TASKS or a plug-in spec), imported. ValueError naming
    it when it is unknown, cannot be imported or is not a rewards.Task subclass."""
    check_task_name(name)
    if not is_plugin(name):
        module_name, class_name = TASKS[name].split(":")
        return getattr(importlib.import_module(module_name), class_name)
    cls = import_spec(name, "task", PLUGIN_FORM)
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        what = "a class" if isinstance(cls, type) else f"a {type(cls).__name__}"
        # ValueError, like every mistake in a config: callers report it as one
        raise ValueError(f"task {name!r} is {what}, not a rewards.Task subclass")  # noqa: TRY004
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise ValueError(f"task {name!r} does not implement {missing} (see rewards.Task)")
    return cls


def get_task(name: str, **options: Any) -> Task:
    """The task called `name` ("arithmetic", "countdown", "math", "mmlu" or a plug-in
    "package.module:TaskClass"), built with its task-specific `options` (see each task class's
    docstring). Building one loads no data (datasets load when a split is first drawn), so
    configs check their tasks this way. Raises ValueError naming an unknown task or option and
    what there is instead, or the part of the rewards.Task contract the task breaks."""
    task = build_task(task_class(name), name, options)
    check_contract(task, name)
    return task


def build_task(cls: type[Task], name: str, options: dict[str, Any]) -> Task:
    """`cls(**options)`; ValueError naming an option the class does not take (and the closest
    one it does), or what the class raised (TypeError: a missing option; ValueError: a bad
    value), prefixed with the task's name."""
    where = TASKS.get(name, name)
    known = task_options(cls)
    if unknown := [k for k in options if k not in known]:
        takes = f"its options are {', '.join(known)}" if known else "it takes no options"
        raise ValueError(f"task {name!r} has no option {unknown[0]!r}{_hint(unknown[0], known)}; "
                         f"{takes} (see the docstring of {where})")
    try:
        return cls(**options)
    except (TypeError, ValueError) as e:  # a missing required option, a value it refuses
        raise ValueError(f"task {name!r}: bad options {sorted(options)}: {_one_line(e)}. "
                         f"See the docstring of {where}.") from e


def _one_line(exc: Exception) -> str:
    """An option's error in one line: a pydantic ValidationError (a task's own option model)
    as `field: message` per error, without its input echo and documentation URL."""
    from pydantic import ValidationError

    if not isinstance(exc, ValidationError):
        return " ".join(str(exc).split())
    return "; ".join(".".join(map(str, err["loc"])) + ": " + err["msg"].removeprefix(
        "Value error, ") for err in exc.errors())


def check_contract(task: Task, name: str) -> None:
    """What the trainer relies on from a built task, checked before any problem is drawn:
    a non-empty `name`, non-empty `splits` of strings, a `scorer` that scoring processes can
    receive, and a positive `max_new_tokens`. ValueError naming the task and the attribute."""
    def broken(what: str) -> ValueError:
        return ValueError(f"task {name!r} breaks the rewards.Task contract: {what}")

    if not (isinstance(getattr(task, "name", None), str) and task.name):
        raise broken("`name` must be a non-empty string (it seeds the problem streams)")
    splits = getattr(task, "splits", None)
    if not (isinstance(splits, tuple) and splits and all(isinstance(s, str) and s for s in splits)):
        raise broken(f"`splits` must be a non-empty tuple of split names, got {splits!r}")
    scorer = getattr(task, "scorer", None)
    if not callable(scorer):
        raise broken("`scorer` must be a function (completion, problem) -> float")
    try:
        check_sendable(scorer, "its scorer")
    except ValueError as e:
        raise broken(str(e)) from None
    budget = getattr(task, "max_new_tokens", None)
    if not (isinstance(budget, int) and not isinstance(budget, bool) and budget >= 1):
        raise broken(f"`max_new_tokens` must be a positive int, got {budget!r}")


def task_options(task_class: type[Task]) -> list[str]:
    """The keyword options a task class takes (its __init__'s named parameters)."""
    if task_class.__init__ is object.__init__:
        return []
    params = inspect.signature(task_class.__init__).parameters.values()
    return [p.name for p in params if p.name != "self"
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _hint(word: str, choices) -> str:
    """' (did you mean X?)' for the choice `word` abbreviates, else the most similar one (the
    rule the config loader applies to keys and values), else ''."""
    choices = list(choices)
    close = ([c for c in choices if c.startswith(word)]
             or difflib.get_close_matches(word, choices, n=1))
    return f" (did you mean {close[0]!r}?)" if close else ""
