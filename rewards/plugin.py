"""User-supplied scorers, named "package.module:function" in a run's config."""
from __future__ import annotations

import importlib
import pickle
import re

from rewards.records import Scorer

_SPEC = re.compile(r"(?P<module>[A-Za-z_]\w*(\.[A-Za-z_]\w*)*):(?P<attr>[A-Za-z_]\w*(\.[A-Za-z_]\w*)*)")


def load_scorer(spec: str) -> Scorer:
    """Import the scorer named by `spec` ("package.module:function").

    The function is called as `function(completion: str, problem: rewards.Problem) -> float`
    and must be importable by that name in a fresh interpreter (scoring runs in worker
    processes). Raises ValueError naming the spec when it is malformed, cannot be imported,
    is not callable, or cannot be sent to a worker (e.g. a lambda assigned to a name).
    """
    match = _SPEC.fullmatch(spec.strip()) if isinstance(spec, str) else None
    if match is None:
        raise ValueError(f"scorer spec {spec!r} is not of the form 'package.module:function'")
    module_name, attr_path = match["module"], match["attr"]
    try:
        target = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or whatever the module raises while importing
        raise ValueError(f"scorer {spec!r}: cannot import module {module_name!r}: "
                         f"{type(e).__name__}: {e}") from e
    for part in attr_path.split("."):
        try:
            target = getattr(target, part)
        except AttributeError as e:
            raise ValueError(f"scorer {spec!r}: module {module_name!r} has no attribute "
                             f"{attr_path!r}") from e
    if not callable(target):
        raise ValueError(f"scorer {spec!r} is a {type(target).__name__}, not a callable")
    try:
        pickle.dumps(target)
    except Exception as e:
        raise ValueError(f"scorer {spec!r} cannot be sent to scoring workers (define it as a "
                         f"module-level function): {e}") from e
    return target
