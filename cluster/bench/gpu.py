"""`klrl bench --device cuda`: what differs on a GPU (cluster/bench/run.py runs the same
measurements on either device): the workloads' settings, the copy bound of a weight sync,
the driver and CUDA versions, and the `gpu`-marked tests.

One GPU holds the learner rank and the rollout worker, `GPU_SHARE` of it each in Ray's
accounting (as the H100 runs of docs/gpu.md did). The worker's engine may take
`ENGINE_MEMORY` of the GPU's memory (`rollout.gpu_memory_utilization`): that leaves room for
the learner and for the raw-vLLM baseline, which starts a second engine with the same settings
in a subprocess while the worker sits idle (cluster/bench/engines.py). A weight sync goes
through the transports that work on one shared GPU (`sync_transports`: those of
actors.weight_sync's registry that say so; nccl needs a GPU per member of its group).

Nothing here starts Ray, vLLM or DeepSpeed; torch is imported inside the functions that need
it (actors.weight_sync imports it).
"""
from __future__ import annotations

import functools
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from cluster.config.loader import REPO_ROOT

GPU_SHARE = 0.5        # Ray GPUs of the learner rank and of the rollout worker: one GPU shared
ENGINE_MEMORY = 0.3    # rollout.gpu_memory_utilization: worker + raw baseline + learner fit
GPU_LAGS = (0, 2)      # end to end: on-policy, and the pipeline two versions deep
GPU_IN_FLIGHT_LAGS = (2,)  # and that pipeline again with in-flight weight updates
COPY_PROBE_BYTES = 256 * 2**20  # the headline device-to-device copy speed
GPU_TESTS_TIMEOUT_S = 540       # `--only tests` fits a 10-minute call with start-up around it
# The files of gpu-marked tests, most informative first (what no GPU has run yet, then what
# has): pytest runs the gpu-marked tests of these in this order, then those of any other file,
# so that a run stopped early has done the most informative ones.
GPU_TEST_ORDER = ("tests/test_in_flight_gpu.py", "tests/test_outputs.py",
                  "tests/test_own_model.py", "tests/test_weight_sync.py",
                  "tests/test_ipc_transfer.py", "tests/test_bench_gpu.py",
                  "tests/test_learner_ranks.py", "tests/test_engine_options.py")


def cuda_missing() -> str | None:
    """Why `--device cuda` cannot run here (None: torch sees a CUDA GPU)."""
    import torch

    if torch.cuda.is_available():
        return None
    return (f"torch {torch.__version__} sees no CUDA GPU (torch.cuda.is_available() is False); "
            "run it where one is, with the gpu extra (docs/gpu.md)")


def _transports() -> dict:
    import actors.weight_sync  # the registry (actors/weight_sync/registry.py); imports torch

    return actors.weight_sync.TRANSPORTS


def sync_transports() -> tuple[str, ...]:
    """The transports that work on one GPU shared by learner rank 0 and the worker, as the
    installed actors.weight_sync's registry has them (shm, object_store, cuda_ipc)."""
    return tuple(name for name, t in _transports().items() if t.shares_a_gpu)


def run_transport() -> str:
    """The default `sync.transport` of the workloads (their engines are built for it, the
    end-to-end runs sync with it): the first shared-GPU transport that stays on the GPU
    (cuda_ipc) where there is one, else the first of them (shm, one node)."""
    shared = sync_transports()
    transports = _transports()
    return next((name for name in shared if transports[name].on_learner_device), shared[0])


def measured_transports(transport: str) -> tuple[str, ...]:
    """The transports the sync part measures when the workloads run `transport`: those any
    engine can load (shm, object_store), and one through a vLLM weight-transfer backend only
    when it is `transport`, whose backend the engines are built for (cuda_ipc)."""
    transports = _transports()
    return tuple(name for name in sync_transports()
                 if name == transport or transports[name].vllm_backend is None)


def gpu_overrides(dtype: str = "float32", transport: str | None = None) -> tuple[str, ...]:
    """The config overrides that put a workload on one GPU shared by the learner rank and one
    rollout worker (learner.num_gpus_per_rank > 0 is what makes the learner run on CUDA),
    syncing with `transport` (default: `run_transport`)."""
    return (f"learner.num_gpus_per_rank={GPU_SHARE}", f"rollout.num_gpus_per_worker={GPU_SHARE}",
            f"rollout.gpu_memory_utilization={ENGINE_MEMORY}", f"learner.dtype={dtype}",
            f"sync.transport={transport or run_transport()}")


def gpu_split(cfg) -> dict[str, Any]:
    """How a GPU workload (TrainConfig `cfg`) shares the machine, for the JSON's `split`."""
    r, lc = cfg.worker_rollout, cfg.rank_learner
    return {"gpu": (f"one GPU shared: learner rank {lc.num_gpus_per_rank:g} and rollout worker "
                    f"{r.num_gpus_per_worker:g} Ray GPU"),
            "rollout_worker": (f"{r.num_gpus_per_worker:g} Ray GPU, engine "
                               f"gpu_memory_utilization {r.gpu_memory_utilization:g}, {r.dtype}, "
                               f"{r.num_cpus_per_worker:g} Ray CPU"),
            "learner_rank": (f"{lc.num_gpus_per_rank:g} Ray GPU, {lc.dtype}, DeepSpeed on nccl, "
                             f"{lc.num_cpus_per_rank:g} Ray CPU"),
            "sync_transport": cfg.sync.transport,
            "baselines": "subprocess on the same GPU with the same settings, actors idle"}


# --------------------------------------------------------------------------- copy bound


@functools.cache
def d2d_copy_seconds(num_bytes: int, reps: int = 5) -> float:
    """Best-of-`reps` time of one device-to-device copy of `num_bytes` between two buffers on
    the current GPU, timed with CUDA events around the copy alone (after a warm-up copy, and
    synchronised): no weight sync of those bytes can beat it. Cached per size."""
    import torch

    src = torch.ones(max(1, num_bytes), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)  # elapsed_time: milliseconds
    del src, dst
    torch.cuda.empty_cache()
    return best


def d2d_bytes_per_s(num_bytes: int = COPY_PROBE_BYTES) -> float:
    return num_bytes / d2d_copy_seconds(num_bytes)


def driver_version() -> str | None:
    """The NVIDIA driver's version (nvidia-smi), or None where it cannot be read."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip().splitlines() or [None])[0]


# --------------------------------------------------------------------------- gpu tests


def run_gpu_tests(timeout_s: float = GPU_TESTS_TIMEOUT_S,
                  python: str = sys.executable) -> dict[str, Any]:
    """`pytest -m gpu -rs` of the checkout klrl runs from, in a subprocess (the interpreter
    running the bench), `GPU_TEST_ORDER` first; its counts, skip reasons and failures, read
    from its JUnit report, or where pytest was stopped at `timeout_s` (no report), from the
    outcomes it had printed by then (`parse_progress`)."""
    order = [p for p in GPU_TEST_ORDER if (REPO_ROOT / p).is_file()]
    command = [python, "-m", "pytest", "-v", "-m", "gpu", "-rs", "-p", "no:cacheprovider",
               *order, "tests"]
    shown = "python -m pytest -v -m gpu -rs"
    if not (REPO_ROOT / "tests").is_dir():
        return {"command": shown, "returncode": None, "timed_out": False,
                "error": f"no tests/ directory in {REPO_ROOT} (klrl installed without its "
                         "checkout)"}
    with tempfile.TemporaryDirectory(prefix="klrl-bench-") as tmp:
        xml = Path(tmp) / "gpu-tests.xml"
        t0 = time.perf_counter()
        returncode, output = run_bounded([*command, f"--junitxml={xml}"], timeout_s,
                                         cwd=REPO_ROOT)
        timed_out = returncode is None
        counts = parse_junit(xml) if xml.is_file() else parse_progress(output)
    return {"command": shown, "returncode": returncode, "timed_out": timed_out,
            "seconds": time.perf_counter() - t0, **counts, "output_tail": output[-3000:]}


def run_bounded(command: list[str], timeout_s: float, *, cwd: str | Path | None = None,
                log=None) -> tuple[int | None, str]:
    """Run `command` in a process session of its own for at most `timeout_s`: its exit code
    (None when it was stopped) and its output (stdout and stderr; "" when written to the open
    file `log` instead). At the timeout the whole session is stopped, SIGTERM then SIGKILL:
    the Ray cluster and vLLM engines a test or a bench part started with it too, so that they
    free the GPU for what comes next."""
    proc = subprocess.Popen(command, cwd=cwd, stdout=log or subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, out or ""
    except subprocess.TimeoutExpired:
        pass
    out = ""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:  # a process that left the session may hold the pipe open: not waited for
            out, _ = proc.communicate(timeout=15)
            break
        except subprocess.TimeoutExpired:
            continue
    return None, out or ""


# pytest -v's line for a finished test: "tests/test_a.py::test_b PASSED    [ 12%]"
_PROGRESS = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", re.MULTILINE)


def parse_progress(output: str) -> dict[str, Any]:
    """Counts of the tests a `pytest -v` run had finished when it was stopped (its JUnit
    report is written only at the end), as `parse_junit` gives them, skip reasons and
    failure messages aside (pytest prints them at the end too), with `stopped`: True."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures = []
    key = {"PASSED": "passed", "XPASS": "passed", "FAILED": "failed", "ERROR": "errors",
           "SKIPPED": "skipped", "XFAIL": "skipped"}
    for test, outcome in _PROGRESS.findall(output):
        counts[key[outcome]] += 1
        if outcome in ("FAILED", "ERROR"):
            failures.append({"test": test, "message": "(stopped before pytest's summary)"})
    return counts | {"skip_reasons": [], "failures": failures, "stopped": True}


def parse_junit(path: str | Path) -> dict[str, Any]:
    """Counts of a pytest JUnit report (passed, failed, errors, skipped), each skipped test
    with its reason, and each failed or erroring test with the first line of its message."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    skips, failures = [], []
    for case in ET.parse(path).getroot().iter("testcase"):
        test = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        if outcome is None:
            counts["passed"] += 1
            continue
        message = (outcome.get("message") or outcome.text or "").strip()
        if outcome.tag == "skipped":
            counts["skipped"] += 1
            skips.append({"test": test, "reason": message})
        else:
            counts["failed" if outcome.tag == "failure" else "errors"] += 1
            failures.append({"test": test, "message": (message.splitlines() or [""])[0][:500]})
    return counts | {"skip_reasons": skips, "failures": failures}
