"""Checkpoint atomicity and bookkeeping (cluster/train/checkpoint.py), and the signal policy
(cluster/train/stopping.py). No Ray: a process really is killed mid-write."""
import json
import multiprocessing
import os
import signal

import pytest

from cluster.train import checkpoint as ckpt
from cluster.train.stopping import GracefulStop


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
    assert ckpt.objective_changes(saved, current) == []
    changed = TrainConfig(learner={"entropy_coef": 0.01}).model_dump(mode="json")
    assert ckpt.objective_changes(saved, changed) == ["learner.entropy_coef: 0.0 -> 0.01"]
    saved["kl"]["beta"] = 0.5
    assert ckpt.objective_changes(saved, current) == ["kl.beta: 0.5 -> 0.1"]
