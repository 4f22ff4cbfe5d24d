"""User code named "package.module:attribute" in a run's config: plug-in scorers (`task.reward`,
`load_scorer`) and plug-in tasks (`task.name`, `eval.<set>.task`; rewards.registry). One rule
for both: the spec's form is checked when a config loads; the import happens where the run
runs (cluster/train/door/preflight.py, `klrl eval`), in that process and again in every Ray worker
and scoring process that uses it, so its package must be importable in all of them."""
from __future__ import annotations

import difflib
import importlib
import pickle
import re

from rewards.records import Scorer

_DOTTED = r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*"
_SPEC = re.compile(rf"(?P<module>{_DOTTED}):(?P<attr>{_DOTTED})")
IMPORT_HINT = "install its package, or put the directory that holds it on PYTHONPATH"


def is_plugin(name: str) -> bool:
    """Whether `name` is a plug-in spec "package.module:Name" (it has a colon; no task,
    scorer or environment klrl ships does): the one rule every registry asks."""
    return ":" in name


def check_spec(spec: str, kind: str, form: str) -> tuple[str, str]:
    """(module, attribute path) of `spec`; ValueError naming it when it is not of the form
    'package.module:attribute' (`form` is how the message spells that, e.g.
    'package.module:function'). Imports nothing."""
    match = _SPEC.fullmatch(spec.strip()) if isinstance(spec, str) else None
    if match is None:
        raise ValueError(f"{kind} spec {spec!r} is not of the form {form!r}")
    return match["module"], match["attr"]


def import_spec(spec: str, kind: str, form: str) -> object:
    """The object `spec` names, imported. ValueError naming the spec when it is malformed, its
    module cannot be imported (whatever the module raises) or has no such attribute (with the
    closest name it does have)."""
    module_name, attr_path = check_spec(spec, kind, form)
    try:
        target = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or whatever the module raises while importing
        hint = f" ({IMPORT_HINT})" if isinstance(e, ModuleNotFoundError) else ""
        raise ValueError(f"{kind} {spec!r}: cannot import module {module_name!r}: "
                         f"{type(e).__name__}: {e}{hint}") from e
    for part in attr_path.split("."):
        try:
            target = getattr(target, part)
        except AttributeError as e:
            public = [a for a in dir(target) if not a.startswith("_")]
            close = difflib.get_close_matches(part, public, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"{kind} {spec!r}: module {module_name!r} has no attribute "
                             f"{attr_path!r}{hint}") from e
    return target


def check_sendable(function: object, what: str) -> None:
    """ValueError unless `function` pickles (by reference: a module-level function), as it must
    to reach the scoring worker processes."""
    try:
        pickle.dumps(function)
    except Exception as e:
        raise ValueError(f"{what} cannot be sent to scoring workers (define it as a "
                         f"module-level function): {e}") from e


def load_scorer(spec: str) -> Scorer:
    """Import the scorer named by `spec` ("package.module:function").

    The function is called as `function(completion: str, problem: rewards.Problem) -> float`
    and must be importable by that name in a fresh interpreter (scoring runs in worker
    processes). Raises ValueError naming the spec when it is malformed, cannot be imported,
    is not callable, or cannot be sent to a worker (e.g. a lambda assigned to a name).
    """
    target = import_spec(spec, "scorer", "package.module:function")
    if not callable(target):
        # ValueError, like every mistake in a config: callers report it as one
        kind = type(target).__name__
        raise ValueError(f"scorer {spec!r} is a {kind}, not a callable")  # noqa: TRY004
    check_signature(target, f"scorer {spec!r}", ("completion", "problem"))
    check_sendable(target, f"scorer {spec!r}")
    return target


def check_signature(function: object, what: str, arguments: tuple[str, ...]) -> None:
    """ValueError unless `function` can be called with len(arguments) positional arguments (as
    `function(completion, problem)` for a scorer), naming what it takes instead. A callable
    whose signature Python cannot read (some builtins) passes: it is called as it comes."""
    import inspect

    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*arguments)
    except TypeError as e:
        called = ", ".join(arguments)
        raise ValueError(f"{what} takes {signature} but is called with ({called}): {e}; "
                         f"define it as `def {getattr(function, '__name__', 'f')}({called})`"
                         ) from None
