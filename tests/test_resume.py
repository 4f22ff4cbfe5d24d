"""Exact resume, end to end with real Ray + vLLM + DeepSpeed on the tiny random model.

At max_lag 0, 4 steps in one go and 2 steps + resume + 2 steps must give bit-identical
parameters: the learner state (weights, AdamW moments, LR schedule, RNG) comes back from the
DeepSpeed checkpoint, the workers are re-synced to the checkpoint's version, the prompt
stream restarts at the saved data position and every sampling seed is a function of
(seed, data position). A half-written newer checkpoint lying around must be ignored, and
the samples table and the hf/ exports hold each step once, as if the run had gone in one go.
"""
import json

import pytest
import torch
from safetensors.torch import load_file
from tiny_runs import tiny_run_config

from cluster.config.loader import ConfigError
from cluster.train import checkpoint as ckpt
from cluster.train.run import train
from cluster.train.run_log import read_metrics, read_samples, samples_path

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def _ray(ray_cluster):  # the runs share the session's cluster (a run joins a running one)
    pass


def _cfg(tiny_model_dir, out, name, steps, *extra):
    return tiny_run_config(tiny_model_dir, out, name, steps, "learner.warmup_steps=2",
                           "logging.samples_every=1", "logging.samples_per_log=2", *extra)


def _final_params(run_dir) -> dict:
    out = {}
    for f in sorted((run_dir / "final").glob("*.safetensors")):
        out |= load_file(f)
    return out


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    straight, _ = train(_cfg(tiny_model_dir, out, "straight", 4))
    half, _ = train(_cfg(tiny_model_dir, out, "halves", 2, "checkpoint_every=2", "hf_every=1"))
    # debris of a later checkpoint whose writer was killed: must be ignored
    root = ckpt.checkpoint_root(half)
    (root / ".partial-step_000000003" / "learner").mkdir(parents=True)
    (root / "step_000000003").mkdir()
    # ... and of a step 3 that was logged and exported before the process died
    with open(samples_path(half), "a") as f:
        f.write(json.dumps({"step": 3, "response": "from the lost attempt"}) + "\n")
    (ckpt.hf_root(half) / "step_000000003").mkdir()
    (ckpt.hf_root(half) / "step_000000003" / "lost").write_text("")
    resumed, _ = train(_cfg(tiny_model_dir, out, "halves", 4, "checkpoint_every=2", "hf_every=1"),
                       resume=True)
    return straight, half, resumed


def test_half_resume_half_equals_one_go_bit_for_bit(runs):
    straight, _, resumed = runs
    a, b = _final_params(straight), _final_params(resumed)
    assert a.keys() == b.keys() and a
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # the runs did learn something (otherwise equality would prove nothing)
    assert max(m.get("grad/norm", 0) for m in read_metrics(straight)) > 0


def test_resumed_metrics_continue_the_log(runs):
    straight, half, resumed = runs
    assert resumed == half
    steps = [m["step"] for m in read_metrics(resumed)]
    assert steps == [0, 1, 2, 3, 4], steps  # each step once: nothing lost, nothing doubled
    one_go = {m["step"]: m for m in read_metrics(straight)}
    for m in read_metrics(resumed):
        if m["step"] > 0:
            assert m["reward/mean"] == one_go[m["step"]]["reward/mean"]
            assert m["kl/pi_ref"] == one_go[m["step"]]["kl/pi_ref"]


def test_resumed_samples_and_exports_hold_each_step_once(runs):
    straight, _, resumed = runs
    rows = read_samples(resumed)
    assert [r["step"] for r in rows] == [1, 1, 2, 2, 3, 3, 4, 4]
    assert rows == read_samples(straight)  # exact resume: the same samples, the lost row gone
    exports = ckpt.hf_exports(resumed)
    assert [p.name for p in exports] == [f"step_00000000{s}" for s in (1, 2, 3, 4)]
    assert (exports[2] / "config.json").is_file() and not (exports[2] / "lost").exists()


def test_resume_keeps_the_wandb_run_and_checkpoints(runs):
    _, half, _ = runs
    kept = ckpt.complete_checkpoints(ckpt.checkpoint_root(half))
    assert [p.name for p in kept] == ["step_000000002", "step_000000004"]
    state = ckpt.read_checkpoint(kept[-1])
    assert state.step == 4 and state.prompt_position == 16 and state.wandb_id
    ids = {d.name.rsplit("-", 1)[-1] for d in (half / "wandb").glob("offline-run-*")}
    assert ids == {state.wandb_id}, ids
    assert json.loads((kept[0] / "controller.json").read_text())["config"]["total_steps"] == 2


def test_resume_refuses_a_changed_objective(runs, tiny_model_dir):
    _, half, _ = runs
    cfg = _cfg(tiny_model_dir, half.parent, "halves", 6, "checkpoint_every=2", "kl.beta=0.5")
    with pytest.raises(ConfigError, match="kl"):
        train(cfg, resume=True)
