"""Task lookup by name. Task modules are imported on first use, so asking for "arithmetic"
never imports math-verify or datasets."""
from __future__ import annotations

import importlib
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
    task-specific `options` (see each task class's docstring)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}")
    module_name, class_name = TASKS[name].split(":")
    task_class = getattr(importlib.import_module(module_name), class_name)
    try:
        return task_class(**options)
    except TypeError as e:  # an unknown or misspelt option: say which task and what it takes
        raise ValueError(f"task {name!r}: bad options {sorted(options)}: {e}. "
                         f"See the docstring of {TASKS[name]}.") from e
