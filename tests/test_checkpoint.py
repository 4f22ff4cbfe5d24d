"""Checkpoint atomicity and bookkeeping (cluster/train/checkpoint.py), and the signal policy
(cluster/train/stopping.py). No Ray: a process really is killed mid-write."""
import json
import multiprocessing
import os
import signal

import pytest

from cluster.train import checkpoint as ckpt
from cluster.train.run_meaning import resume_changes
from cluster.train.stopping import GracefulStop


def _resume_changes(saved: dict, current: dict) -> list[str]:
    return [str(c) for c in resume_changes(saved, current)]


def _state(step: int) -> ckpt.ControllerState:
    return ckpt.ControllerState(step=step, prompt_position=32 * step, wandb_id="abc",
                                reference_sha256="f" * 64, config={"seed": 0})


def _fake_learner(payload: bytes):
    def save(directory, tag):
        (directory / tag).mkdir()
        (directory / tag / "weights.bin").write_bytes(payload)
    return save


def _write_then_die(run_dir, step):
    """Child process: start checkpoint `step`, SIGKILL itself half-way through the learner save."""
    def save(directory, tag):
        (directory / tag).mkdir()
        (directory / tag / "weights.bin").write_bytes(b"half")
        os.kill(os.getpid(), signal.SIGKILL)
    ckpt.write_checkpoint(run_dir, _state(step), save, keep=3)


def test_roundtrip_and_keep_last_k(tmp_path):
    for step in (2, 4, 6, 8):
        path = ckpt.write_checkpoint(tmp_path, _state(step), _fake_learner(b"w%d" % step), keep=2)
        assert path.name == f"step_{step:09d}"
    kept = ckpt.complete_checkpoints(ckpt.checkpoint_root(tmp_path))
    assert [p.name for p in kept] == ["step_000000006", "step_000000008"]
    latest = ckpt.latest_checkpoint(tmp_path)
    assert ckpt.read_checkpoint(latest) == _state(8)
    assert (latest / ckpt.LEARNER_TAG / "weights.bin").read_bytes() == b"w8"


def test_killed_mid_write_leaves_the_previous_checkpoint_loadable(tmp_path):
    ckpt.write_checkpoint(tmp_path, _state(2), _fake_learner(b"good"), keep=3)
    child = multiprocessing.get_context("fork").Process(target=_write_then_die, args=(tmp_path, 4))
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    root = ckpt.checkpoint_root(tmp_path)
    assert (root / ".partial-step_000000004" / ckpt.LEARNER_TAG / "weights.bin").exists()
    latest = ckpt.latest_checkpoint(tmp_path)
    assert latest.name == "step_000000002" and ckpt.read_checkpoint(latest).step == 2
    assert (latest / ckpt.LEARNER_TAG / "weights.bin").read_bytes() == b"good"
    # the next write clears the debris and succeeds
    ckpt.write_checkpoint(tmp_path, _state(4), _fake_learner(b"next"), keep=3)
    assert not list(root.glob(".partial-*"))
    assert ckpt.read_checkpoint(ckpt.latest_checkpoint(tmp_path)).step == 4


def test_a_directory_without_the_marker_is_never_loaded(tmp_path):
    ckpt.write_checkpoint(tmp_path, _state(2), _fake_learner(b"good"), keep=3)
    fake = ckpt.checkpoint_root(tmp_path) / "step_000000009"
    fake.mkdir()
    (fake / "controller.json").write_text("{}")
    assert ckpt.latest_checkpoint(tmp_path).name == "step_000000002"
    with pytest.raises(FileNotFoundError, match="COMPLETE"):
        ckpt.read_checkpoint(fake)


def test_same_step_twice_is_written_once(tmp_path):
    first = ckpt.write_checkpoint(tmp_path, _state(3), _fake_learner(b"a"), keep=2)
    again = ckpt.write_checkpoint(tmp_path, _state(3), _fake_learner(b"b"), keep=2)
    assert first == again and (first / ckpt.LEARNER_TAG / "weights.bin").read_bytes() == b"a"


def test_reference_identity_is_the_weights_content(tmp_path, tiny_model_dir):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, copy)
    assert ckpt.model_sha256(copy) == ckpt.model_sha256(tiny_model_dir)
    weights = next(copy.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert ckpt.model_sha256(copy) != ckpt.model_sha256(tiny_model_dir)


def test_first_signal_asks_for_a_stop_second_stops_at_once():
    before = signal.getsignal(signal.SIGTERM)  # SIG_DFL, or Ray's once a test started Ray here
    with GracefulStop() as stop:
        assert stop() is None
        os.kill(os.getpid(), signal.SIGTERM)
        request = stop()
        assert request is not None and request.exit_code == 128 + signal.SIGTERM
        assert "SIGTERM" in str(request)
        with pytest.raises(KeyboardInterrupt, match="second signal"):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) == before  # restored


def test_a_checkpoint_from_before_an_option_existed_resumes_unless_it_is_set():
    """A saved config lacks the options added after it was written: they had their defaults,
    so resuming at the defaults changes nothing, and only a value set away from the default
    is a change (named with the saved side absent)."""
    from cluster.config.train_config import TrainConfig

    current = TrainConfig().model_dump(mode="json")
    saved = json.loads(json.dumps(current))
    del saved["learner"]["entropy_coef"], saved["model"]["trust_remote_code"], saved["data"]
    assert _resume_changes(saved, current) == []
    changed = TrainConfig(learner={"entropy_coef": 0.01}).model_dump(mode="json")
    assert _resume_changes(saved, changed) == ["learner.entropy_coef: 0.0 -> 0.01"]
    saved["kl"]["beta"] = 0.5
    assert _resume_changes(saved, current) == ["kl.beta: 0.5 -> 0.1"]


def test_what_a_resume_and_a_sweep_may_change():
    """cluster/train/run_meaning.py: every key changes a run's meaning unless listed FREE
    (logging, cadence, paths, resources, fault limits). A resume refuses the sampler's
    temperature or the evaluation's size as it refuses kl.beta (only the objective's sections
    were checked before), may move the run's end, and keeps its checkpoint's layout."""
    from cluster.config.train_config import TrainConfig
    from cluster.analysis.labels import flatten
    from cluster.train.run_meaning import FREE, RESUME_KEEPS, RESUME_MAY_CHANGE, meaning_changes

    keys = flatten(TrainConfig.model_validate({"learner": {"lora": {"rank": 8}}})
                   .model_dump(mode="json"))  # learner.lora's keys exist with LoRA on
    for key in (*FREE, *RESUME_KEEPS, *RESUME_MAY_CHANGE):  # each names a key or a section
        assert any(k == key or k.startswith(key + ".") for k in keys), key
    saved = TrainConfig().model_dump(mode="json")

    def changed(**update) -> TrainConfig:
        return TrainConfig.model_validate(saved | update).model_dump(mode="json")

    meaning = changed(rollout={"temperature": 0.7}, eval={"num_problems": 50}, max_lag=2)
    assert _resume_changes(saved, meaning) == [
        "max_lag: 0 -> 2", "rollout.temperature: 1.0 -> 0.7", "eval.num_problems: 200 -> 50"]
    free = changed(checkpoint_every=5, eval_every=3, output_dir="/elsewhere",
                   logging={"wandb_mode": "offline"}, faults={"max_worker_restarts": 9},
                   rollout={"threads_per_worker": 2}, learner={"threads_per_rank": 2})
    assert _resume_changes(saved, free) == [] and meaning_changes(saved, free) == []
    longer = changed(total_steps=500)
    assert _resume_changes(saved, longer) == []  # a resume may extend the run ...
    assert [str(c) for c in meaning_changes(saved, longer)] == ["total_steps: 100 -> 500"]
    ranks = changed(learner={"num_ranks": 2, "zero_stage": 1})  # ... but not re-shard its state
    assert _resume_changes(saved, ranks) == ["learner.num_ranks: 1 -> 2",
                                             "learner.zero_stage: 0 -> 1"]
    assert meaning_changes(saved, ranks) == []  # the same training on more ranks
