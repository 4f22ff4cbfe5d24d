"""`klrl submit` against a real `ray start --head` on loopback (Ray job submission, token auth)."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.cli.main import main

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """A separate Ray cluster started by the CLI, as a user would on a head node."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")  # job drivers use this python
    dash = _free_port()
    subprocess.run([str(BIN / "ray"), "start", "--head", "--num-cpus=4", f"--port={_free_port()}",
                    "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--include-dashboard=true",
                    "--node-ip-address=127.0.0.1"],
                   check=True, env=env, capture_output=True, timeout=180)
    try:
        yield f"http://127.0.0.1:{dash}"
    finally:
        subprocess.run([str(BIN / "ray"), "stop", "--force"], capture_output=True, timeout=120)


def test_submit_runs_a_training_job(ray_head, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    out = tmp_path / "runs"
    rc = main(["submit", "configs/tiny_cpu.yaml", "--address", ray_head,
               f"model.path={tiny_model_dir}", f"output_dir={out}", "run_name=submitted",
               "total_steps=1", "eval_every=0", "eval.num_problems=8", "eval.out_of_domain=null",
               "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
               "logging.wandb_mode=disabled"])
    assert rc == 0
    lines = (out / "submitted" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines]
    assert steps == [0, 1]
    assert (out / "submitted" / "final" / "config.json").is_file()


def test_submit_rejects_a_bad_config_before_submitting(capsys):
    assert main(["submit", "configs/tiny_cpu.yaml", "--address", "http://127.0.0.1:1", "max_lag=-1"]) == 2
    assert "max_lag" in capsys.readouterr().err
