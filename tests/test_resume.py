"""Exact resume and exact learner restart, end to end with real Ray + vLLM + DeepSpeed on the
tiny random model.

At max_lag 0, 4 steps in one go and 2 steps + resume + 2 steps must give bit-identical
parameters: the learner state (weights, AdamW moments, LR schedule, RNG) comes back from the
DeepSpeed checkpoint, the workers are re-synced to the checkpoint's version, the prompt
stream restarts at the saved data position and every sampling seed is a function of
(seed, data position). A half-written newer checkpoint lying around must be ignored, and
the samples table and the hf/ exports hold each step once, as if the run had gone in one go.

The resumed half also loses its learner rank (SIGKILL, in its train step of step 4, once step 3
is logged): the run restarts the learner from the checkpoint of step 2 in the run, redoes
step 3, and must still end bit-identical to the run that went in one go, with every per-step
metric the same and each step's rows once (one run carries both: each costs a Ray + vLLM +
DeepSpeed start).
"""
import json
import os
import signal
import threading
import time

import psutil
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


class LearnerKiller(threading.Thread):
    """SIGKILLs this process's learner rank (its Ray cluster is this process's own: every rank is
    a descendant) once `run_dir` has logged `after_step` and the rank runs a train step (Ray
    titles the process `ray::LearnerRank.train_step` then): the next step's train step dies."""

    def __init__(self, run_dir, after_step: int):
        super().__init__(daemon=True)
        self.run_dir, self.after_step = run_dir, after_step
        self.killed: list[int] = []
        self.done = threading.Event()

    def run(self):
        while not self.done.is_set() and not self.killed:
            if max((m["step"] for m in _rows(self.run_dir)), default=-1) >= self.after_step:
                for p in psutil.Process(os.getpid()).children(recursive=True):
                    try:
                        if p.cmdline()[:1] == ["ray::LearnerRank.train_step"]:
                            p.send_signal(signal.SIGKILL)
                            self.killed.append(p.pid)
                            break
                    except psutil.Error:
                        continue
            time.sleep(0.01)


def _rows(run_dir) -> list[dict]:
    try:
        return read_metrics(run_dir)
    except FileNotFoundError:
        return []


# Metrics that measure the machine (times, throughput, engine idling) or count faults: the rest
# of a step's row is decided by the run alone.
MACHINE = ("time/", "throughput/", "faults/", "rollout/engine_idle_share")


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
    killer = LearnerKiller(half, after_step=3)
    killer.start()
    try:
        resumed, _ = train(_cfg(tiny_model_dir, out, "halves", 4, "checkpoint_every=2",
                                "hf_every=1"), resume=True)
    finally:
        killer.done.set()
        killer.join()
    assert killer.killed, "the learner rank was never seen in a train step after step 3"
    return straight, half, resumed


def test_half_resume_half_equals_one_go_bit_for_bit(runs):
    straight, _, resumed = runs
    a, b = _final_params(straight), _final_params(resumed)
    assert a.keys() == b.keys() and a
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # the runs did learn something (otherwise equality would prove nothing)
    assert max(m.get("grad/norm", 0) for m in read_metrics(straight)) > 0


def test_resumed_and_restarted_metrics_continue_the_log(runs):
    straight, half, resumed = runs
    assert resumed == half
    steps = [m["step"] for m in read_metrics(resumed)]
    assert steps == [0, 1, 2, 3, 4], steps  # each step once: nothing lost, nothing doubled
    one_go = {m["step"]: m for m in read_metrics(straight)}
    for m in read_metrics(resumed):
        # the first half ended at step 2, and a run evaluates at its end
        extra = ("eval/",) if m["step"] == 2 else ()
        decided = {k: v for k, v in m.items() if not k.startswith((*MACHINE, *extra))}
        assert decided == {k: v for k, v in one_go[m["step"]].items()
                           if not k.startswith(MACHINE)}, m["step"]
    last = read_metrics(resumed)[-1]  # step 3 was logged, lost with the rank, and redone
    assert last["faults/learner_restarts"] == 1 and last["faults/learner_steps_lost"] == 1


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
    assert state.learner_restarts == 1 and state.learner_steps_lost == 1
    ids = {d.name.rsplit("-", 1)[-1] for d in (half / "wandb").glob("offline-run-*")}
    assert ids == {state.wandb_id}, ids
    assert json.loads((kept[0] / "controller.json").read_text())["config"]["total_steps"] == 2


def test_resume_refuses_a_changed_objective(runs, tiny_model_dir):
    _, half, _ = runs
    cfg = _cfg(tiny_model_dir, half.parent, "halves", 6, "checkpoint_every=2", "kl.beta=0.5")
    with pytest.raises(ConfigError, match="kl"):
        train(cfg, resume=True)
