"""Task lookup by name. Task modules are imported on first use, so asking for "arithmetic"
never imports math-verify or datasets."""
from __future__ import annotations

import difflib
import importlib
import inspect
from typing import Any

from rewards.records import Task

# name -> "module:class"
TASKS = {
    "arithmetic": "rewards.arithmetic:ArithmeticTask",
    "countdown": "rewards.countdown:CountdownTask",
    "math": "rewards.boxed_math:MathTask",
    "mmlu": "rewards.mmlu:MMLUTask",
}


def get_task(name: str, **options: Any) -> Task:
    """The task called `name` ("arithmetic", "countdown", "math" or "mmlu"), built with its
    task-specific `options` (see each task class's docstring). Building one loads no data
    (datasets load when a split is first drawn), so configs check their tasks this way.
    Raises ValueError naming an unknown task or option and what there is instead."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}{_hint(name, TASKS)}; known tasks: {', '.join(TASKS)}")
    module_name, class_name = TASKS[name].split(":")
    task_class = getattr(importlib.import_module(module_name), class_name)
    known = task_options(task_class)
    if unknown := [k for k in options if k not in known]:
        takes = f"its options are {', '.join(known)}" if known else "it takes no options"
        raise ValueError(f"task {name!r} has no option {unknown[0]!r}{_hint(unknown[0], known)}; "
                         f"{takes} (see the docstring of {TASKS[name]})")
    try:
        return task_class(**options)
    except TypeError as e:  # e.g. a missing required option
        raise ValueError(f"task {name!r}: bad options {sorted(options)}: {e}. "
                         f"See the docstring of {TASKS[name]}.") from e


def task_options(task_class: type[Task]) -> list[str]:
    """The keyword options a task class takes (its __init__'s named parameters)."""
    if task_class.__init__ is object.__init__:
        return []
    params = inspect.signature(task_class.__init__).parameters.values()
    return [p.name for p in params if p.name != "self"
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _hint(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
