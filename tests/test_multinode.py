"""A real two-node Ray cluster on this machine, and a training run submitted to it as a user
would: a head (`ray start --head --block`, custom resource `head`, dashboard) and a second node
(`ray start --address=HEAD --block`, resource `node2`), each its own raylet, object store and
temp dir on loopback.

One `klrl submit` job (the suite's only end-to-end submission: a vLLM engine start is the
expensive part, so one run checks everything) runs `klrl train` on the cluster with its
rollout worker on node 2 and its learner on the head (`ray.worker_resources` /
`ray.learner_resources`), weights moving between the two object stores
(`sync.transport: object_store`). Its config file and its plug-in scorer lie outside the
repository (uploaded with the job), and the scorer's reward is made of variables given by
`--env` and `--runtime-env`, so the run's rewards show that they arrived. Checked: where each
actor ran (the dashboard's state API), the lag bound, exact weight sync across nodes
(importance ratios 1 within 1e-4 at max_lag 0), secrets never printed, a job name that is
taken, and a resource that no node has. Nothing is left running afterwards. The job is
submitted with `--max-resubmits 1` and its first driver SIGKILLed as soon as it appears (a lost
driver, killed early so that the loss costs little): klrl submit sees it, submits the job again
(`NAME-r1`, `--resume-if-started`), and that job does the run.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from contextlib import redirect_stderr, redirect_stdout
from io import StringIO
from pathlib import Path

import psutil
import pytest
from ray_nodes import REPO, short_temp_dir, start_head, start_worker

from cluster.cli.main import main
from cluster.launchers.ray_jobs import auth_headers
from cluster.train.run_log import read_metrics

pytestmark = pytest.mark.slow
XDIST_GROUP = "own-processes"  # runs of their own processes (tests/conftest.py)

SECRET = "hunter2-" + uuid.uuid4().hex[:8]  # must reach the job and never be printed
SCORER = f'''
import os

def score(completion, problem):
    """Reward = A (from --env, this shell's value) + B (from --runtime-env), if the secret
    given inline with --env arrived too; a missing variable raises (a counted failure)."""
    assert os.environ["KLRL_PROBE_SECRET"] == "{SECRET}"
    return float(os.environ["KLRL_PROBE_A"]) + float(os.environ["KLRL_PROBE_B"])
'''


@pytest.fixture(scope="module")
def cluster():
    """Head and node 2, stopped (their process trees only) at the end; no process of either
    may outlive the module."""
    temp_dir = short_temp_dir()
    nodes = []
    try:
        nodes.append(start_head(temp_dir, num_cpus=1, resources={"head": 1}, dashboard=True))
        nodes.append(start_worker(nodes[0], num_cpus=1, resources={"node2": 1}))
        yield nodes[0]
    finally:
        for node in reversed(nodes):
            node.stop()
        left = [p for node in nodes for p in node.pids_left()]
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not left, f"processes of the test's Ray nodes still running: {left}"


class DriverKiller(threading.Thread):
    """SIGKILLs the first job driver (`python -m cluster.cli.job_entry ...`) that appears in the
    head node's process tree (this test's own Ray cluster), once."""

    def __init__(self, head):
        super().__init__(daemon=True)
        self.head, self.killed, self.done = head, [], threading.Event()

    def run(self):
        while not self.done.is_set() and not self.killed:
            try:
                tree = psutil.Process(self.head.proc.pid).children(recursive=True)
            except psutil.Error:
                return
            for p in tree:
                try:
                    cmdline = p.cmdline()
                    if "cluster.cli.job_entry" in cmdline and "python" in Path(cmdline[0]).name:
                        p.send_signal(signal.SIGKILL)
                        self.killed.append(" ".join(cmdline))
                        break
                except psutil.Error:
                    continue
            time.sleep(0.05)


@pytest.fixture(scope="module")
def submitted(cluster, tiny_model_dir, tmp_path_factory):
    """`klrl submit --max-resubmits 1` of a 2-step run from a config and a scorer outside the
    repository, its first driver killed."""
    outside = tmp_path_factory.mktemp("outside")
    (outside / "klrl_probe_scorer.py").write_text(SCORER)
    config = outside / "two_nodes.yaml"
    config.write_text(f"""base: {REPO / "configs" / "tiny_cpu.yaml"}
task: {{reward: "klrl_probe_scorer:score"}}
total_steps: 2
max_lag: 0
eval_every: 0
eval: {{num_problems: 4, samples: 0, out_of_domain: null}}
rollout: {{prompts_per_step: 2, samples_per_prompt: 4}}
learner: {{lr: 1.0e-3}}
sync: {{transport: object_store}}
ray: {{worker_resources: {{node2: 1}}, learner_resources: {{head: 1}}}}
logging: {{wandb_mode: disabled}}
""")
    runtime_env = outside / "runtime_env.yaml"
    runtime_env.write_text('env_vars: {KLRL_PROBE_B: "0.125"}\n')
    out = tmp_path_factory.mktemp("runs")
    name = "klrl-test-" + uuid.uuid4().hex[:8]
    mp = pytest.MonkeyPatch()
    mp.setenv("KLRL_PROBE_A", "0.25")
    mp.syspath_prepend(str(outside))  # klrl submit uploads what it finds here
    mp.delenv("RAY_ADDRESS", raising=False)
    killer = DriverKiller(cluster)
    killer.start()
    try:  # the job's logs, followed by main(), are part of what is checked for the secret
        stdout, stderr = StringIO(), StringIO()
        with redirect_stdout(stdout), redirect_stderr(stderr):
            rc = main(["submit", str(config), "--address", cluster.dashboard,
                       "--env", "KLRL_PROBE_A", "--env", f"KLRL_PROBE_SECRET={SECRET}",
                       "--runtime-env", str(runtime_env), "--job-name", name,
                       "--max-resubmits", "1",
                       f"model.path={tiny_model_dir}", f"output_dir={out}", "run_name=two"])
    finally:
        mp.undo()
        killer.done.set()
        killer.join()
    return {"rc": rc, "out": stdout.getvalue(), "err": stderr.getvalue(), "name": name,
            "run_dir": out / "two", "config": config, "killed": killer.killed}


def _state(head, path: str) -> list[dict]:
    """The dashboard's state API (what `ray list ...` reads), over HTTP with the token."""
    request = urllib.request.Request(f"{head.dashboard}/api/v0/{path}", headers=auth_headers())
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())["data"]["result"]["result"]


def test_a_job_whose_driver_is_lost_is_resubmitted_and_finishes_its_run(submitted):
    assert submitted["killed"], "the first job's driver was never seen"
    out = submitted["out"]
    assert submitted["rc"] == 0, out[-3000:] + submitted["err"][-3000:]
    [line] = [ln for ln in out.splitlines() if "resubmitting it" in ln]
    assert line.startswith(f"job {submitted['name']}: its driver was killed (SIGKILL"), line
    assert line.endswith("(resubmission 1/1)"), line
    assert f"submitted {submitted['name']}-r1: " in out and "--resume-if-started" in out, out
    assert f"job {submitted['name']}-r1: SUCCEEDED" in out, out[-3000:]


def test_submitted_job_gets_its_env_runtime_env_and_outside_files(submitted):
    assert submitted["rc"] == 0, submitted["out"][-3000:] + submitted["err"][-3000:]
    steps = [m for m in read_metrics(submitted["run_dir"]) if m["step"] > 0]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:  # every completion scored A + B by the uploaded scorer, none failed
        assert m["reward/score_failures"] == 0 and m["reward/mean"] == pytest.approx(0.375), m
    assert SECRET not in submitted["out"] + submitted["err"]
    assert (submitted["run_dir"] / "final" / "config.json").is_file()


def test_worker_on_node2_learner_on_head_exact_sync(cluster, submitted):
    assert submitted["rc"] == 0
    node_of = {n["node_id"]: n for n in _state(cluster, "nodes?detail=1")}
    assert len(node_of) == 2 and sum(n["is_head_node"] for n in node_of.values()) == 1
    actors = _state(cluster, "actors?detail=1")
    placed: dict[str, set] = {}
    for a in actors:
        if a["class_name"] in ("RolloutWorker", "LearnerRank"):
            placed.setdefault(a["class_name"], set()).add(a["node_id"])
    assert len(placed.get("RolloutWorker", ())) == 1, actors
    assert len(placed.get("LearnerRank", ())) == 1, actors
    (worker_node,), (learner_node,) = placed["RolloutWorker"], placed["LearnerRank"]
    worker, learner = node_of[worker_node], node_of[learner_node]
    assert not worker["is_head_node"] and "node2" in worker["resources_total"]
    assert learner["is_head_node"] and "head" in learner["resources_total"]
    # The lag bound, and weights that crossed object stores exactly: at max_lag 0 the
    # learner's probabilities equal the sampler's (step 2 samples with step 1's weights,
    # sent from the head's object store to node 2's).
    trained = [m for m in read_metrics(submitted["run_dir"]) if m["step"] > 0]
    assert [m["step"] for m in trained] == [1, 2]
    for m in trained:
        assert m["lag/max"] == 0 and m["policy_version"] == m["step"], m
        assert abs(m["is/ratio_min"] - 1) < 1e-4 and abs(m["is/ratio_max"] - 1) < 1e-4, m


def test_a_job_name_that_is_taken_is_refused(cluster, submitted, capsys):
    rc = main(["submit", "configs/tiny_cpu.yaml", "--address", cluster.dashboard, "--no-wait",
               "--job-name", submitted["name"]])
    err = capsys.readouterr().err
    assert rc == 2 and f"--job-name {submitted['name']}" in err and "already" in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_a_failed_job_exits_1_with_its_error(cluster, tmp_path, capsys):
    """A mistake only the cluster can see (a model path that does not exist there) fails the
    job in its pre-flight; klrl submit relays the job's last line and says where its logs are."""
    rc = main(["submit", "configs/tiny_cpu.yaml", "--address", cluster.dashboard,
               f"model.path={tmp_path / 'no_model'}", f"output_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert rc == 1, err
    last = err.strip().splitlines()[-1]
    assert "ended FAILED" in last and "model.path=" in last, err
    assert "ray job logs raysubmit_" in last, err


def test_a_resource_no_node_has_is_refused_before_the_run(cluster, tiny_model_dir, tmp_path):
    """`klrl train` with ray.address joins the cluster and refuses at once (exit 2, no run
    directory) a request that Ray would leave pending forever. RAY_AUTH_MODE=token: Ray 2.60
    turns token auth on for `ray start --head`, and a driver that names an address uses the
    token only when told to."""
    env = dict(os.environ, RAY_AUTH_MODE="token", PYTHONPATH=str(REPO))
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "train", "configs/tiny_cpu.yaml",
         f"model.path={tiny_model_dir}", f"output_dir={tmp_path}", "run_name=r",
         f"ray.address={cluster.address}", "ray.worker_resources={gpu_node: 1}"],
        check=False, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "ray.worker_resources" in proc.stderr and "gpu_node=1" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "r").exists()
