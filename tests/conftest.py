"""Shared fixtures. Tiny models are built locally (never downloaded), once per session."""
from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A randomly initialised tiny Qwen2 + char tokenizer (the default architecture,
    seed 0), built once per test session. Read-only: copy it before changing it."""
    from cluster.tiny.model import build_random_model

    return build_random_model(tmp_path_factory.mktemp("tiny_model") / "model", seed=0)


@pytest.fixture(scope="session")
def tiny_llm(tiny_model_dir):
    """One vLLM engine (CPU: fp32) on `tiny_model_dir`, shared by every test that needs it:
    an engine start costs about 20 s on 2 cores. Shut down at the end of the session."""
    from actors.engine import make_llm, shutdown_llm

    llm = make_llm(tiny_model_dir, seed=0, max_model_len=256)
    yield llm
    shutdown_llm(llm)
    del llm
    gc.collect()


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster on loopback for one test module (reused if one is running).
    Oversubscribed (4 logical CPUs on 2 cores): tests place a worker and 1-2 learner ranks."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
                 _node_ip_address="127.0.0.1")
    yield
    if started:
        ray.shutdown()


TESTS_DIR = str(Path(__file__).parent)


@pytest.fixture(scope="module")
def plugin_scorers_importable():
    """tests/ on PYTHONPATH, so that Ray workers can import the plug-in scorers in
    tests/scorers.py. Workers inherit PYTHONPATH from the driver when it starts the local
    cluster, so a cluster started without it is shut down first; the caller starts one."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = TESTS_DIR + (os.pathsep + old if old else "")
    yield
    if ray.is_initialized():
        ray.shutdown()
    if old is None:
        os.environ.pop("PYTHONPATH")
    else:
        os.environ["PYTHONPATH"] = old
