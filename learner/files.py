"""File modes of what klrl writes for people to read.

safetensors writes its file 0600 (readable by its owner only) whatever the umask, so a trained
model shared on a cluster filesystem was unreadable by colleagues; `mkdtemp` makes 0700
directories. Files and directories written for others get the modes the umask allows, as any
other file would (0644 / 0755 under the usual umask 022).
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
