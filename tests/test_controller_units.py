"""Controller pieces that need no cluster: the prompt stream and the non-finite stop."""
import pytest

from cluster.config.loader import DEMO_CONFIG
from cluster.config.train_config import load_train_config
from cluster.train.controller import Controller
from cluster.train.prompts import PromptStream


def test_prompt_stream_is_deterministic_and_resumable():
    cfg = load_train_config(DEMO_CONFIG, [])
    a = PromptStream(cfg.task, seed=3)
    first, ids = a.next_batch(5)
    second, ids2 = a.next_batch(5)
    assert ids == [0, 1, 2, 3, 4] and ids2 == [5, 6, 7, 8, 9]
    resumed = PromptStream(cfg.task, seed=3, position=5)
    assert [p.uid for p in resumed.next_batch(5)[0]] == [p.uid for p in second]
    other_seed = PromptStream(cfg.task, seed=4)
    assert [p.uid for p in other_seed.next_batch(5)[0]] != [p.uid for p in first]


def test_prompt_stream_rejects_unknown_split():
    cfg = load_train_config(DEMO_CONFIG, ["task.train_split=nope"])
    with pytest.raises(ValueError, match="nope"):
        PromptStream(cfg.task, seed=0)


def test_consecutive_nonfinite_steps_stop_the_run_naming_the_step(tmp_path):
    cfg = load_train_config(DEMO_CONFIG, ["max_consecutive_nonfinite=3"])
    c = Controller(cfg, tmp_path / "run", tmp_path / "model")
    c.step = 7
    c._count_nonfinite(True)
    c._count_nonfinite(True)
    c._count_nonfinite(False)  # a good step resets the streak
    c._count_nonfinite(True)
    c._count_nonfinite(True)
    with pytest.raises(RuntimeError, match="3 consecutive.*step 8.*step 7"):
        c._count_nonfinite(True)
    assert c.nonfinite_total == 5


class _Part:
    """A stand-in for the log, the worker pool or the learner: records that it was stopped,
    in `order`, and raises `error` if given one."""

    def __init__(self, name, order, error=None):
        self.name, self.order, self.error = name, order, error

    def _stop(self):
        self.order.append(self.name)
        if self.error is not None:
            raise self.error

    close = kill_all = shutdown = _stop


def _controller_with_parts(tmp_path, log_error=None, learner_error=None):
    cfg = load_train_config(DEMO_CONFIG, [f"sync.shm_dir={tmp_path / 'shm'}"])
    c = Controller(cfg, tmp_path / "run", tmp_path / "model")
    order = []
    c.log = _Part("log", order, log_error)
    c.pool = _Part("pool", order)
    c.learner = _Part("learner", order, learner_error)
    published = tmp_path / "shm" / "klrl-run"  # what the shm transport leaves in /dev/shm
    published.mkdir(parents=True)
    (published / "v1.safetensors").write_bytes(b"w")
    return c, order, published


def test_shutdown_stops_every_part_when_one_fails_then_raises_the_first(tmp_path, capsys):
    c, order, published = _controller_with_parts(
        tmp_path, log_error=OSError("disk full"), learner_error=RuntimeError("rank gone"))
    with pytest.raises(OSError, match="disk full"):
        c._shutdown()
    assert order == ["log", "pool", "learner"] and not published.exists()
    err = capsys.readouterr().err
    assert "metrics log failed: OSError: disk full" in err and "RuntimeError: rank gone" in err


def test_a_failed_run_reports_its_own_error_not_the_shutdown_s(tmp_path, capsys):
    c, order, published = _controller_with_parts(tmp_path, log_error=OSError("disk full"))

    def start():
        raise RuntimeError("learner rank 1 died")

    c._start = start
    with pytest.raises(RuntimeError, match="rank 1 died"):
        c.run()
    assert order == ["log", "pool", "learner"] and not published.exists()
    assert "OSError: disk full" in capsys.readouterr().err
