"""How a learner's ranks meet: torch.distributed (gloo on CPU, NCCL on GPU) on a TCP store that
rank 0 hosts, then DeepSpeed's communication layer on top of that process group.

Invariant: rank 0 binds the store's port itself (port 0: the OS picks one) and holds the socket
from then on, so no other process can take it between choosing and listening. Choosing a "free"
port first and binding it later, as torch's env:// rendezvous does, loses to any process that
binds it in between: on a busy node (CI's pytest workers, Ray, vLLM, each opening connections
on ephemeral ports) that ended a run in EADDRINUSE before its first step.
"""
from __future__ import annotations

import hashlib
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch


def _timeout(collective_timeout_s: float | None) -> timedelta:
    """None: DeepSpeed's default (10 minutes, or DEEPSPEED_TIMEOUT), the timeout DeepSpeed
    gives a process group it makes itself."""
    if collective_timeout_s is None:
        from deepspeed.constants import default_pg_timeout

        return default_pg_timeout
    return timedelta(seconds=collective_timeout_s)


def host_store(host: str, world_size: int, collective_timeout_s: float | None = None):
    """Rank 0's side: a TCP store listening on `host` at a port the OS picks (`.port`); keep
    the returned object alive as long as the process group (it serves the group's store)."""
    return torch.distributed.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False,
                                      timeout=_timeout(collective_timeout_s))


def build_ops_for_this_installation() -> None:
    """Make DeepSpeed's JIT op builds (its CPU all-reduce op, deepspeed_shm_comm, built at
    `init_distributed`) this installation's own: built with the `ninja` beside this interpreter
    (the wheel DeepSpeed depends on) into a cache directory of this interpreter's environment.

    Why: torch keeps JIT-built ops in one directory per user (~/.cache/torch_extensions/py311_cpu)
    and ninja rebuilds an op whenever the command in its log differs from its own, a whole
    rebuild each time (about a minute of both cores on a 2-core machine, which every rank
    starting then waits for). Two things made it differ between runs of one machine: ninja 1.13
    (the wheel) hashes command lines otherwise than 1.11 (Debian's), and which one a rank found
    depended on how its Ray node was started (from an activated virtual environment or not);
    and two installations (a second virtual environment, a fresh clone) compile against their
    own torch headers, so each switch between them read as a changed command, and an op built
    against one torch could be loaded by the other. A TORCH_EXTENSIONS_DIR the user set is
    kept: they chose where builds go."""
    bin_dir = os.path.dirname(sys.executable)
    if os.path.isfile(os.path.join(bin_dir, "ninja")):
        path = os.environ.get("PATH", "")
        if path.split(os.pathsep)[0] != bin_dir:
            os.environ["PATH"] = bin_dir + (os.pathsep + path if path else "")
    if "TORCH_EXTENSIONS_DIR" not in os.environ:
        from torch.utils.cpp_extension import get_default_build_root

        tag = hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]
        os.environ["TORCH_EXTENSIONS_DIR"] = os.path.join(get_default_build_root(),
                                                          f"klrl-{tag}")


def build_cpu_allreduce_op() -> bool:
    """Build DeepSpeed's CPU all-reduce op into torch's extensions cache now, as a learner rank
    would at its first start (`make venv` runs this: the build is part of installing, not of
    the first run or test, which would otherwise wait a minute or more for it). False where
    DeepSpeed's accelerator has no such op (a GPU machine builds none)."""
    from deepspeed.comm.torch import build_shm_op

    build_ops_for_this_installation()
    return build_shm_op() is not None


def init_process_group(cuda: bool, rank: int, world_size: int, addr: str, port: int, store=None,
                       collective_timeout_s: float | None = None) -> None:
    """Join the process group that meets at addr:port: rank 0 passes the store it hosts
    (`host_store`), the others connect to it. Then DeepSpeed wraps that group. A collective
    that waits longer than `collective_timeout_s` raises instead of blocking forever (gloo
    raises in the waiting rank; NCCL's watchdog aborts the communicator); None: DeepSpeed's
    default."""
    import deepspeed

    timeout = _timeout(collective_timeout_s)
    # DeepSpeed's CPU all-reduce names its /dev/shm buffers after MASTER_ADDR/PORT
    # (remove_shm_buffers finds them by that name).
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "MASTER_ADDR": addr, "MASTER_PORT": str(port)})
    if store is None:
        store = torch.distributed.TCPStore(addr, port, world_size, is_master=False, timeout=timeout)
    backend = "nccl" if cuda else "gloo"
    extra = {}
    if cuda and world_size > 1:  # as DeepSpeed does: bind the group to this rank's device
        extra["device_id"] = torch.device("cuda", torch.cuda.current_device())
    torch.distributed.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                         timeout=timeout, **extra)
    # torch.distributed is up, so DeepSpeed only wraps it (comm.init_distributed), building
    # its CPU all-reduce op on first use, as this installation's own; its buffers are new
    # files in /dev/shm, so those that killed groups left there go first.
    if not cuda:
        remove_orphaned_shm_buffers()
    build_ops_for_this_installation()
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False,
                               timeout=timeout)


SHM_BUFFER_PREFIX = "deepspeed_allreduce_buffer_"  # DeepSpeed's CPU comm op (shm.cpp)
ORPHAN_MIN_AGE_S = 600.0  # far longer than a rank takes from creating its buffer to mapping it


def remove_orphaned_shm_buffers(min_age_s: float = ORPHAN_MIN_AGE_S,
                                shm_dir: Path = Path("/dev/shm")) -> list[Path]:
    """Delete this user's all-reduce buffers that no process maps any more, older than
    `min_age_s`: those of groups whose ranks were killed outright (SIGKILL, a node's end, a
    job whose driver was lost), which no shutdown could free. They live in RAM, 66 MB a rank,
    and would pile up run after run. A live group's buffers are mapped by its ranks, which
    read their own processes' maps; the age covers the moment between a rank creating its
    buffer and mapping it. Called before a CPU group forms (init_process_group); returns what
    was removed."""
    mine = [p for p in shm_dir.glob(SHM_BUFFER_PREFIX + "*")
            if _owned_by_me(p) and time.time() - _changed(p) >= min_age_s]
    if not mine:
        return []
    mapped = _mapped_shm_files(shm_dir)
    removed = []
    for path in mine:
        if str(path) not in mapped:
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _owned_by_me(path: Path) -> bool:
    try:
        return path.stat().st_uid == os.getuid()
    except FileNotFoundError:
        return False


def _changed(path: Path) -> float:
    """Its last write: a buffer being created is written (its workspace seeded) just before
    it is mapped; a mapped one is kept whatever its age."""
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return time.time()


def _mapped_shm_files(shm_dir: Path) -> set[str]:
    """Every file under `shm_dir` that a process this user can read maps (/proc/PID/maps)."""
    prefix, found = str(shm_dir) + "/", set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # gone, or another user's: not one that can map this user's 0600 files
            continue
        for line in text.splitlines():
            at = line.find(prefix)
            if at >= 0:
                found.add(line[at:].removesuffix(" (deleted)"))
    return found


def remove_shm_buffers(addr: str, port: int) -> int:
    """Delete this node's /dev/shm all-reduce buffers of the process group that met at
    addr:port (DeepSpeed's CPU comm op names them after it); how many were removed."""
    removed = 0
    for path in Path("/dev/shm").glob(f"{SHM_BUFFER_PREFIX}*_{addr}_{port}_*"):
        path.unlink(missing_ok=True)
        removed += 1
    return removed
