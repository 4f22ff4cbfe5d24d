"""The file modes of what klrl writes for people to read (learner/files.py says why): the modes
the umask allows, as any other file would get. Torch-free: cluster/tiny/ and `klrl --help`
import it.
"""
from __future__ import annotations

import os
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def give_normal_modes(directory: str | Path) -> None:
    """chmod `directory` and the files directly in it to 0777 / 0666 minus the umask."""
    mask = _umask()
    directory = Path(directory)
    os.chmod(directory, 0o777 & ~mask)
    for f in directory.iterdir():
        if f.is_file():
            os.chmod(f, 0o666 & ~mask)
