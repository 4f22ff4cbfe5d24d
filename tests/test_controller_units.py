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
