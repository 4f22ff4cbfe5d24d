"""The shm transport: a safetensors file in `shm_dir/klrl-<run_id>/` (its own settings,
`ShmSettings`: SyncConfig.shm_dir, a tmpfs, and the run), written atomically (temporary file +
rename, so a reader never sees half a file); the path travels in the record. Learner and
workers must share the node (and the tmpfs).

The two newest versions are kept, older ones deleted: the version being published and the one
before, which workers may still be loading. That suffices because the controller finishes every
load of the versions before the last published one before it publishes the next
(cluster/train/weight_sync_state.py).
"""
from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actors.weight_sync.base import Fetched, SafetensorsTransport
from actors.weight_sync.traits import ShmTraits

KEEP_VERSIONS = 2  # files kept per run (the one being published and the one before)
_FILE_RE = re.compile(r"^v(\d+)\.safetensors$")


@dataclass(frozen=True)
class ShmSettings:
    """The shm transport's own settings: the tmpfs directory (SyncConfig.shm_dir) and the run
    whose files it holds there."""

    shm_dir: str
    run_id: str

    @property
    def directory(self) -> Path:
        return run_dir(self.run_id, self.shm_dir)


class ShmTransport(ShmTraits, SafetensorsTransport):
    """Owns the run's shm directory: writes each version's file, keeps the newest two, waits
    for a file on the worker's side, and removes the directory at the end of the run.
    settings: where (`for_run` builds them; the registry's instance has none and can only
    answer what the transport is, and fetch, which reads the path in the record)."""

    def __init__(self, settings: ShmSettings | None = None):
        self.settings = settings

    def for_run(self, run_id: str, sync: Any) -> ShmTransport:
        return ShmTransport(ShmSettings(str(sync.shm_dir), run_id))

    def store(self, tensors, metadata, version):
        path = _write(tensors, metadata, version, self._settings().directory)
        return {"path": str(path)}, path.stat().st_size

    def fetch(self, update, deadline) -> Fetched:
        t0 = time.perf_counter()
        path = Path(update.path)
        while not path.exists():
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"weight file {path} (version {update.version}) did not appear in time; "
                    "the shm transport needs learner and workers on one node (use "
                    "object_store across nodes)")
            time.sleep(0.05)
        return Fetched(str(path), {"fetch": time.perf_counter() - t0})

    def cleanup(self) -> None:
        settings = self._settings()
        remove_published(settings.run_id, settings.shm_dir)

    def _settings(self) -> ShmSettings:
        if self.settings is None:
            raise RuntimeError("the shm transport writes where its settings say: use "
                               "transport('shm').for_run(run_id, sync_cfg)")
        return self.settings


def run_dir(run_id: str, shm_dir: str | os.PathLike = "/dev/shm") -> Path:
    """Directory of one run's shm files."""
    if not run_id or "/" in run_id or run_id in (".", ".."):
        raise ValueError(f"run_id must be a plain, non-empty name, got {run_id!r}")
    return Path(shm_dir) / f"klrl-{run_id}"


def remove_published(run_id: str, shm_dir: str | os.PathLike = "/dev/shm") -> None:
    """Delete a run's shm files (at the end of the run; /dev/shm is RAM)."""
    d = run_dir(run_id, shm_dir)
    if d.is_dir():
        for f in d.iterdir():
            f.unlink(missing_ok=True)
        d.rmdir()


def _write(tensors, metadata, version: int, directory: Path) -> Path:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"v{version:09d}.safetensors"
    tmp = directory / f".v{version:09d}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        os.replace(tmp, final)  # atomic on one filesystem: readers see all or nothing
    finally:
        tmp.unlink(missing_ok=True)
    for f in directory.iterdir():  # keep the newest KEEP_VERSIONS versions up to this one
        m = _FILE_RE.match(f.name)
        if m and int(m.group(1)) <= version - KEEP_VERSIONS:
            f.unlink(missing_ok=True)
    return final
