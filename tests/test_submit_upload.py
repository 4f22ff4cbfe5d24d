"""`klrl submit` against a real Ray head on loopback (`ray start --head --block`, its
dashboard): the cluster's Python is checked by a probe job before the run's files are uploaded
(a Python the cluster lacks, or one without klrl's dependencies, is refused in one line naming
the fix, and nothing else reaches the cluster), and what a job's working_dir holds is the
project's tracked files (another checkout, with an untracked checkpoint and an ignored run
directory beside its code), said with its size before it is sent. The training job itself is
tests/test_multinode.py's."""
from __future__ import annotations

import dataclasses
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from ray_nodes import short_temp_dir, start_head
from test_submit import clone  # noqa: F401 - the fixture: another klrl checkout

from cluster.cli.main import main
from cluster.launchers import ray_jobs as jobs
from cluster.launchers.job_upload import project_upload

pytestmark = pytest.mark.slow
XDIST_GROUP = "own-processes"  # a Ray head of its own (tests/conftest.py)


@pytest.fixture(scope="module")
def head():
    temp_dir = short_temp_dir()
    node = start_head(temp_dir, num_cpus=1, dashboard=True)
    try:
        yield node
    finally:
        node.stop()
        left = node.pids_left()
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not left, f"processes of the test's Ray head still running: {left}"


def _jobs(address: str) -> list:
    return jobs.job_client(address).list_jobs()


def _system_python_without_torch() -> str | None:
    """A Python on this machine without klrl's dependencies (the system's), if there is one."""
    for py in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if Path(py).is_file() and subprocess.run(
                [py, "-c", "import torch"], capture_output=True, check=False).returncode:
            return py
    return None


@pytest.mark.parametrize("python", ["/no/such/python", "system"])
def test_the_clusters_python_is_checked_before_anything_is_uploaded(head, python, capsys):
    if python == "system" and (python := _system_python_without_torch()) is None:
        pytest.skip("no Python without torch on this machine")
    before = {j.submission_id for j in _jobs(head.dashboard)}
    assert main(["submit", "configs/tiny_cpu.yaml", "--address", head.dashboard, "--no-wait",
                 "--python", python]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    problem = "is not found there" if python.startswith("/no/") else "lacks torch"
    assert lines[0].startswith(f"error: the job's Python on the cluster cannot run klrl: "
                               f"`{python}` ")
    assert problem in lines[0] and "Give --python PATH" in lines[0]
    assert "uploading" not in out
    new = [j for j in _jobs(head.dashboard) if j.submission_id not in before]
    # the probe alone reached the cluster: no working_dir, no py_modules, nothing uploaded
    assert [(j.metadata, j.runtime_env.get("working_dir")) for j in new] == [
        ({"klrl": "python probe"}, None)]


def test_the_default_python_is_this_ones_where_the_cluster_has_it(head):
    assert jobs.cluster_python(head.dashboard, ["/no/such/python", sys.executable]) \
        == sys.executable


def test_a_job_carries_the_current_checkouts_tracked_files(head, clone, capsys):  # noqa: F811
    """The working_dir a job gets, listed by the job itself: the clone's tracked files as they
    are now; its untracked checkpoint and ignored run directory stay behind."""
    upload = project_upload(root=clone)
    spec = jobs.job_spec(clone / "configs" / "mine.yaml", [], upload=upload)
    listing = ("import os; print('FILES', sorted(os.path.relpath(os.path.join(d, f)) for d, _, "
               "fs in os.walk('.') for f in fs)); print('MINE', open('configs/mine.yaml').read())")
    spec = dataclasses.replace(spec, entrypoint=shlex.join([sys.executable, "-c", listing]))
    jobs.submit("", head.dashboard, [], wait=True, spec=spec)
    out = capsys.readouterr().out
    assert out.index(f"uploading {clone}: 3 tracked files") < out.index("submitted ")
    files = next(line for line in out.splitlines() if line.startswith("FILES"))
    assert files == "FILES " + str([".gitignore", "cluster/cli/job_entry.py",
                                    "configs/mine.yaml"])
    assert "MINE seed: 2" in out  # the working tree's version, not the commit's


def test_a_cluster_sweep_checks_the_python_before_its_first_run(head, tmp_path, capsys):
    """`klrl sweep --address`: the cluster's Python is checked once, before any run's job (or
    the sweep's directory) is made."""
    from cluster.config.loader import REPO_ROOT

    sweep = REPO_ROOT / "configs" / "sweeps" / "offpolicy_tiny.yaml"
    before = {j.submission_id for j in _jobs(head.dashboard)}
    assert main(["sweep", str(sweep), "--address", head.dashboard, "--python", "/no/such/python",
                 f"output_dir={tmp_path / 'runs'}", "--max-runs", "1"]) == 2
    err = capsys.readouterr().err
    assert "error: the job's Python on the cluster cannot run klrl: `/no/such/python` is not " \
           "found there" in err and len(err.strip().splitlines()) == 1, err
    assert [j.metadata for j in _jobs(head.dashboard) if j.submission_id not in before] == [
        {"klrl": "python probe"}]
    assert not (tmp_path / "runs").exists()
