"""Paths a run reads and writes: relative ones made absolute once, in the driver, and the
directories a run writes into checked before it starts.

Invariant: after `resolve_paths`, every local path of a TrainConfig (model.path,
model.ref_path, output_dir, sync.shm_dir, the dataset files of task.options and of each
evaluation set) is absolute, so that it names the same file in every process of the run: a
Ray actor's working directory is the one its node started in, not the driver's. A relative
path means relative to the directory klrl is started from (the driver's working directory).
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from actors.weight_sync.traits import transport_traits
from cluster.config.loader import ConfigError
from cluster.config.train_config import TrainConfig
from rewards.dataset_rows import resolve_local_paths


def resolve_paths(cfg: TrainConfig, base: Path | None = None) -> TrainConfig:
    """`cfg` with its local paths absolute against `base` (default: this process's working
    directory). A model path that is not there is left as it is: it may be a hub name, and
    the model check says what it is. Idempotent."""
    base = Path.cwd() if base is None else Path(base)

    def local(path: str | None) -> str | None:
        if path is None:
            return None
        full = base / Path(path).expanduser()
        return str(full) if full.exists() else path

    model = cfg.model.model_copy(update={"path": local(cfg.model.path),
                                         "ref_path": local(cfg.model.ref_path)})
    task = cfg.task.model_copy(update={"options": resolve_local_paths(cfg.task.options, base)})
    sets = {name: s.model_copy(update={"options": resolve_local_paths(s.options, base)})
            for name in type(cfg.eval).model_fields
            if hasattr(s := getattr(cfg.eval, name), "options")}
    update = {"model": model, "task": task, "eval": cfg.eval.model_copy(update=sets),
              "output_dir": str(base / Path(cfg.output_dir).expanduser())}
    if (shm_dir := getattr(cfg.sync, "shm_dir", None)) is not None:
        update["sync"] = cfg.sync.model_copy(update={"shm_dir": str(base / Path(shm_dir))})
    return cfg.model_copy(update=update)


def can_create_in(directory: Path) -> OSError | None:
    """None when a directory can be made in `directory` (tried with a temporary one, removed
    at once: root passes permission checks, so asking `os.access` is not enough, and /proc
    refuses anyway), else the error."""
    try:
        if not directory.is_dir():
            raise NotADirectoryError(f"{directory} is not a directory")
        os.rmdir(tempfile.mkdtemp(prefix=".klrl-preflight-", dir=directory))
    except OSError as exc:
        return exc
    return None


def nearest_existing(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def cannot_write_in(directory: Path) -> OSError | None:
    """None when files can be written into `directory`: it is a directory one can create in,
    or it can be made (its nearest existing ancestor is one; a file in the way is not)."""
    return can_create_in(directory if directory.is_dir() else nearest_existing(directory))


def check_creatable(directory: Path, flag: str) -> None:
    """`directory` is a directory one can write in, or can be made (ConfigError naming `flag`
    otherwise)."""
    if exc := cannot_write_in(directory):
        raise ConfigError(f"{flag}={directory}: cannot create it ({exc.strerror or exc})")


def check_writable_file(path: Path, flag: str) -> None:
    """A file a command writes after its work (a JSON, a log) can be written there: not a
    directory, and its directory exists or can be made (ConfigError naming `flag`), so the
    work is not lost to a typo found at its end."""
    if path.is_dir():
        raise ConfigError(f"{flag}={path}: is a directory; give a file path")
    if path.exists() and not os.access(path, os.W_OK):
        raise ConfigError(f"{flag}={path}: cannot be written")
    check_creatable(path.parent, flag)


def check_output_dir(run_dir: Path, field: str = "output_dir") -> None:
    """The run directory must be creatable: its nearest existing ancestor a directory in which
    a directory can be made."""
    if exc := cannot_write_in(run_dir.parent):
        raise ConfigError(f"{field}={run_dir.parent}: cannot create the run directory there "
                          f"({exc.strerror or exc}); choose a writable output_dir")


def check_shm_dir(cfg: TrainConfig) -> None:
    """sync.shm_dir, where the shm transport writes the weights, must be a directory in which
    the learner can make the run's own (`klrl-<run_id>/`); else the first weight publish
    fails once every actor has started."""
    shm_dir = getattr(cfg.sync, "shm_dir", None)
    if not transport_traits(cfg.sync.transport).writes_shm_dir or shm_dir is None:
        return
    if exc := can_create_in(Path(shm_dir)):
        raise ConfigError(f"sync.shm_dir={shm_dir}: the shm transport cannot write there "
                          f"({exc.strerror or exc}); give an existing, writable directory on a "
                          "tmpfs (/dev/shm on Linux), or use sync.transport=object_store")
