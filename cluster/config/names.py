"""The rule for names that become a directory under `output_dir`: a run's name
(`TrainConfig.run_name`) and a sweep's (`SweepConfig.name`). One home, so that no name can
leave `output_dir` whichever command it reaches.

Invariant: a name is one plain directory name, so `output_dir / name` is a new directory
strictly inside `output_dir`. Letters, digits, `_`, `-` and `.`; not empty, no separator, and
not a name of dots only (`.` is `output_dir` itself, `..` its parent, where a run would write
its files and its checkpoint clean-up would delete)."""
from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator

MAX_NAME_LENGTH = 200  # below the 255 bytes a file name may have on common file systems
_NAME = re.compile(r"[\w.\-]+")


def check_dir_name(name: str) -> str:
    """`name` when it is one plain directory name (module docstring), else ValueError saying
    why and what a name may hold."""
    allowed = "letters, digits, '_', '-' and '.'"
    if not name:
        raise ValueError(f"a name must not be empty; use {allowed}")
    if set(name) == {"."}:
        raise ValueError(f"{name!r} is not a name of its own ('.' is output_dir itself, '..' "
                         f"its parent); use {allowed}, e.g. 'run-1'")
    if not _NAME.fullmatch(name):
        bad = sorted({c for c in name if not _NAME.fullmatch(c)})
        raise ValueError(f"{name!r} holds {', '.join(map(repr, bad))}: a name is one directory "
                         f"name under output_dir, of {allowed} only")
    if len(name) > MAX_NAME_LENGTH:
        raise ValueError(f"a name has at most {MAX_NAME_LENGTH} characters ({len(name)} given)")
    return name


DirName = Annotated[str, AfterValidator(check_dir_name)]
"""A str field holding one plain directory name (`check_dir_name`)."""
