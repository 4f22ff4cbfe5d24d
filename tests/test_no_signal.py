"""No learning signal, flagged: the share of prompt groups without reward spread, logged every
step, and the warning once the task advantage has been zero for `logging.no_signal_steps`
steps in a row (cluster/train/learning_signal.py); the last test sees both in a real run of the
tiny random model on arithmetic, which it never solves (reward 0 at every step), with dynamic
sampling on: every group is dropped, a second batch drawn, and the step filled with flat
groups (cluster/train/dynamic_sampling.py through the real controller)."""
from __future__ import annotations

import pytest
import torch

from cluster.train.learning_signal import NoSignalWatch, signal_metrics


def _t(*values):
    return torch.tensor(values, dtype=torch.float32)


def test_the_share_of_groups_without_reward_spread():
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    assert signal_metrics(_t(1, 1, 0, 1, 0, 0, 5), groups) == {
        "reward/zero_spread_groups": pytest.approx(2 / 3)}  # group 3 has one sample: not counted
    assert signal_metrics(_t(1, 0), torch.tensor([0, 1])) == {}  # no group of two


def test_the_watch_warns_once_per_stretch_of_zero_advantages_and_says_what_to_check():
    watch, zero, some = NoSignalWatch(3), _t(0, 0, 0, 0), _t(0.5, -0.5, 0, 0)
    said = [watch.update(step, _t(0, 0, 0, 0), zero) for step in range(1, 6)]
    assert said[:2] == [None, None] and said[3:] == [None, None]  # once, at the third
    assert said[2].startswith("no learning signal for 3 steps in a row (steps 1-3): every "
                              "reward was 0. Check that the scorer rewards a right answer")
    assert watch.update(6, _t(1, 0, 0, 0), some) is None  # a signal: the count starts again
    said = [watch.update(step, _t(1, 1, 0, 0), zero) for step in range(7, 10)]
    assert said[2].startswith("no learning signal for 3 steps in a row (steps 7-9): within "
                              "every prompt group the rewards were equal (mean 0.500")
    assert "rollout.samples_per_prompt" in said[2]
    never = NoSignalWatch(0)
    assert all(never.update(s, _t(0, 0), _t(0, 0)) is None for s in range(100))


def test_the_warning_reaches_the_wandb_run(tmp_path):
    """RunLog.record_warning keeps the text in the wandb run's summary (offline here: as
    `wandb sync` would upload it)."""
    from wandb_records import records

    from cluster.config.train_config import load_train_config
    from cluster.train.run_log import RunLog

    cfg = load_train_config(None, ["logging.wandb_mode=offline", f"output_dir={tmp_path}"])
    with RunLog(cfg, tmp_path / "r") as log:
        log.log({"step": 1, "reward/mean": 0.0})
        log.record_warning("no_signal", "no learning signal for 2 steps")
    offline = next((tmp_path / "r" / "wandb").glob("offline-run-*"))
    summaries = [r.summary for r in records(offline) if r.WhichOneof("record_type") == "summary"]
    assert any(u.key == "warning/no_signal" and "no learning signal" in u.value_json
               for s in summaries for u in s.update)


@pytest.mark.slow
def test_a_run_without_reward_says_so(tiny_model_dir, tmp_path, ray_cluster, capsys):
    from cluster.config.loader import DEMO_CONFIG
    from cluster.config.train_config import load_train_config
    from cluster.train.run import train
    from cluster.train.run_log import read_metrics

    cfg = load_train_config(DEMO_CONFIG, [
        f"model.path={tiny_model_dir}", f"output_dir={tmp_path}", "run_name=silent",
        "total_steps=2", "max_lag=0", "eval_every=0", "eval.num_problems=8", "eval.samples=0",
        "eval.out_of_domain=null", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4",
        "logging.wandb_mode=disabled", "logging.no_signal_steps=2",
        "dynamic_sampling.enabled=true", "dynamic_sampling.max_batches_per_step=2"])
    run_dir, _ = train(cfg)
    rows = [m for m in read_metrics(run_dir) if m["step"] > 0]
    assert [(m["reward/mean"], m["reward/zero_spread_groups"]) for m in rows] == [(0, 1)] * 2
    for m in rows:  # every group dropped, one more batch drawn, the step filled: full batches
        assert m["dynamic_sampling/dropped_share"] == 1
        assert m["dynamic_sampling/extra_batches"] == 1
        assert m["dynamic_sampling/extra_samples"] == 16
        assert m["dynamic_sampling/filled_zero_spread"] == 4
        assert m["response/sequences"] == 16 and m["lag/max"] == 0
    err = capsys.readouterr().err
    assert "warning: no learning signal for 2 steps in a row (steps 1-2): every reward was " \
           "0." in err
