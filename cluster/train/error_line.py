"""The one line a command prints for an error that ended it (the whole traceback goes to the
log): `Type: first line of the message`.

An error raised inside a Ray actor or task reaches the driver as a RayTaskError, whose own first
line names only the process (`ray::LearnerRank.setup() (pid=..., ip=..., actor_id=...,
repr=...)`), the actual error being the last line of the remote traceback after it. So the line
is the original error's, with the call it came from: `RuntimeError in LearnerRank.setup: ...`.
"""
from __future__ import annotations

import re
import sys


def error_line(exc: BaseException, limit: int = 300) -> str:
    """`Type: first line` of `exc`'s message (at most `limit` characters); for an error from a
    Ray actor or task, the original error's, `Type in Actor.method: first line`."""
    where = ""
    ray_exceptions = sys.modules.get("ray.exceptions")  # without Ray, no error is Ray's
    task_error = getattr(ray_exceptions, "RayTaskError", None)
    while (task_error is not None and isinstance(exc, task_error)
           and isinstance(exc.cause, BaseException) and exc.cause is not exc):
        where = where or _call(exc)
        exc = exc.cause
    first = (str(exc).strip().splitlines() or [""])[0][:limit]
    return f"{type(exc).__name__}{f' in {where}' if where else ''}: {first}"


def _call(exc) -> str:
    """The remote call a RayTaskError came from, `Actor.method`: from its process title
    (`ray::Actor.method()`), which the error Ray raises in the driver (a subclass of the
    original error's type too) keeps only in its message's first line; else the function's
    name."""
    title = getattr(exc, "proctitle", None) or (str(exc).splitlines() or [""])[0]
    if found := re.search(r"ray::([\w.]+)", title):
        return found.group(1)
    return getattr(exc, "function_name", None) or ""
