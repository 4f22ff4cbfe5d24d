"""Controller pieces that need no cluster: the prompt stream, the non-finite stop, the
metrics of a batch taken from the workers, and shutdown."""
import pytest

from actors.records import POOL_ERROR, Rollout, RolloutBatch
from cluster.config.loader import DEMO_CONFIG
from cluster.config.train_config import load_train_config
from cluster.train.controller import Controller, InFlight
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
    # the config already refuses it (tests/test_configs.py); a task config built unchecked too
    task = load_train_config(DEMO_CONFIG, []).task.model_copy(update={"train_split": "nope"})
    with pytest.raises(ValueError, match="no split 'nope'"):
        PromptStream(task, seed=0)


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
        c.recovery.stop_parts()
    assert order == ["log", "pool", "learner"] and not published.exists()
    err = capsys.readouterr().err
    assert "metrics log failed: OSError: disk full" in err and "RuntimeError: rank gone" in err


def test_a_learner_restart_that_keeps_the_workers_stops_the_learner_alone(tmp_path):
    """The workers, the log and the weights published to the workers stay: loads queued on a
    kept worker still read the published file until the restart has settled them."""
    c, order, published = _controller_with_parts(tmp_path)
    c.recovery.stop_parts(keep_log=True, keep_workers=True)
    assert order == ["learner"] and (published / "v1.safetensors").exists()
    c.recovery.stop_parts()
    assert order == ["learner", "log", "pool", "learner"] and not published.exists()


def test_a_failed_run_reports_its_own_error_not_the_shutdown_s(tmp_path, capsys):
    c, order, published = _controller_with_parts(tmp_path, log_error=OSError("disk full"))

    def start():
        raise RuntimeError("learner rank 1 died")

    c._start = start
    with pytest.raises(RuntimeError, match="rank 1 died"):
        c.run()
    assert order == ["log", "pool", "learner"] and not published.exists()
    assert "OSError: disk full" in capsys.readouterr().err


class _AnsweringPool:
    """Workers that have answered: `result` returns the batch of each call (a worker index)."""

    def __init__(self, batches):
        self.batches = batches

    def result(self, call):
        return self.batches[call]


def _batch(worker, problems, failure=None):
    rollouts = [Rollout(problem=p, group_id=i, prompt_ids=[1], response_ids=[2, 3],
                        behaviour_logprobs=[-0.5, -0.5], policy_version=0, finish_reason="stop",
                        reward=0.0 if failure else 1.0, score_failure=failure, worker=worker)
                for i, p in enumerate(problems)]
    return RolloutBatch(rollouts=rollouts, policy_version=0, worker=worker, gen_seconds=0.5,
                        num_response_tokens=2 * len(rollouts))


def test_failed_scoring_pools_are_logged_as_faults(tmp_path):
    cfg = load_train_config(DEMO_CONFIG, ["rollout.num_workers=2"])
    c = Controller(cfg, tmp_path / "run", tmp_path / "model")
    problems, _ = c.prompts.next_batch(4)
    c.pool = _AnsweringPool([_batch(0, problems[:2], POOL_ERROR), _batch(1, problems[2:])])
    c.pending.append(InFlight(calls=[0, 1], start_position=0, requested_at_version=0))
    rollouts, metrics = c._take_batch()
    assert len(rollouts) == 4 and metrics["faults/scoring_pool_errors"] == 1
    assert metrics["reward/score_failures"] == 2 and metrics["reward/mean"] == 0.5


class _ProbedPool:
    """Workers whose health probe answers or not (`why`); `restart` records its reason."""

    def __init__(self, why):
        self.why, self.restarted = why, []

    def unresponsive(self, i):
        return self.why

    def restart(self, i, reason):
        self.restarted.append((i, reason))


def _late_load(tmp_path, why):
    from actors.weight_sync import WeightUpdate
    from cluster.train.weight_sync_state import PendingSync
    from cluster.train.worker_pool import WorkerCall

    c = Controller(load_train_config(DEMO_CONFIG, []), tmp_path / "run", tmp_path / "model")
    c.weights.pool = _ProbedPool(why)
    update = WeightUpdate(6, "shm", 0, path="v6.safetensors")
    c.weights._on_late_load(
        PendingSync(WorkerCall(0, 0, "load_weights", (update,), None), None, 0.0), timeout=2.0)
    return c.weights.pool.restarted


def test_a_load_past_its_timeout_on_a_frozen_worker_replaces_the_worker(tmp_path):
    """A worker frozen in (or right before) a weight load is hung, as one frozen in generate:
    replaced (one restart), with the same wording the hang messages use."""
    [(worker, reason)] = _late_load(tmp_path, "it does not answer (frozen or dead)")
    assert worker == 0 and reason == ("did not finish its load of weights version 6 within 2 s: "
                                      "it does not answer (frozen or dead) "
                                      "(deadline: sync.timeout_s=2)")


def test_a_load_past_its_timeout_on_a_live_worker_fails_the_run(tmp_path):
    """A live worker whose load is that slow has a broken sync; a new worker would not mend it."""
    with pytest.raises(TimeoutError, match="worker 0 did not load weights version 6 within "
                                           "sync.timeout_s=2 of being able to start"):
        _late_load(tmp_path, None)


def test_learner_restarts_count_the_steps_they_cost_and_stop_past_the_limit():
    from cluster.train.learner_restarts import LearnerRestarts, LearnerRestartsExhausted

    restarts = LearnerRestarts(limit=2)
    restarts.take("rank 0 died", step=11, back_to=8)
    line = restarts.describe("step_000000008", 11, 8, 1.0, workers_kept=True)
    assert line.startswith("learner restarted from step_000000008 in 1.0s (restart 1/2; "
                           "rollout workers kept, rewound to its weights): "), line
    assert line.endswith("steps 9-11 are redone (3 lost; 3 over the run)"), line
    assert "rollout workers started again" in restarts.describe("step 0", 11, 8, 1.0,
                                                                workers_kept=False)
    restarts.take("rank 0 died", step=8, back_to=8)  # died again before a step was done
    assert restarts.metrics() == {"faults/learner_restarts": 2, "faults/learner_steps_lost": 3}
    with pytest.raises(LearnerRestartsExhausted) as stop:
        restarts.take("rank 1 died", step=9, back_to=8)
    assert str(stop.value) == ("rank 1 died; all faults.max_learner_restarts=2 learner restarts "
                               "are used up, so the run stops here")
    assert not stop.value.write_checkpoint  # a broken group cannot write one: the last is kept
    assert restarts.count == 2


def test_only_a_broken_learner_group_is_restarted_and_never_on_a_broken_invariant():
    from types import SimpleNamespace

    from ray.exceptions import RayTaskError

    from cluster.train.deadlines import LearnerHung
    from cluster.train.learner_restarts import failure_line, heals
    from cluster.train.stopping import RunStopped

    broken, whole = SimpleNamespace(broken=True, failure="train_step on rank 1"), \
        SimpleNamespace(broken=False, failure=None)
    oom = RayTaskError("train_step", "traceback", RuntimeError("CUDA out of memory")) \
        .as_instanceof_cause()
    invariant = RayTaskError("train_step", "traceback", AssertionError("lag bound")) \
        .as_instanceof_cause()
    hung = LearnerHung("learner rank 0 did not finish train step 3 within 70 s: it does not "
                       "answer; its last complete checkpoint is kept")
    assert heals(oom, broken) and heals(hung, broken)
    assert not heals(oom, whole)  # e.g. a worker's error while the learner is fine
    assert not heals(invariant, broken) and not heals(RunStopped("SIGTERM"), broken)
    assert not heals(ValueError("x"), broken) and not heals(oom, None)
    assert failure_line(hung, broken) == ("learner rank 0 did not finish train step 3 within "
                                          "70 s: it does not answer")
    assert failure_line(oom, broken).startswith("the learner failed (train_step on rank 1): ")


def test_an_error_from_a_ray_actor_is_told_by_its_own_type_message_and_call():
    """Ray's own first line of a RayTaskError names only the process (pid, ip, actor id); the
    line a command prints is the original error's, with the call it was raised in, also when
    an actor's call failed on another actor's error. Errors of the driver stay as they are."""
    from types import SimpleNamespace

    from ray.exceptions import RayTaskError

    from cluster.train.error_line import error_line
    from cluster.train.learner_restarts import failure_line

    setup = RayTaskError("setup", "Traceback ...\nRuntimeError: sizes differ",
                         RuntimeError("sizes differ\nfor details see above"),
                         proctitle="ray::LearnerRank.setup", pid=7, ip="10.0.0.1",
                         actor_repr="<learner.rank.LearnerRank object>").as_instanceof_cause()
    assert "ray::LearnerRank.setup()" in str(setup).splitlines()[0]  # all it printed before
    assert error_line(setup) == "RuntimeError in LearnerRank.setup: sizes differ"
    outer = RayTaskError("train_step", "Traceback ...", setup,
                         proctitle="ray::LearnerGroup.train_step").as_instanceof_cause()
    assert error_line(outer) == "RuntimeError in LearnerGroup.train_step: sizes differ"
    no_title = RayTaskError("generate", "Traceback ...", ValueError("bad"), proctitle="python")
    assert error_line(no_title) == "ValueError in generate: bad"
    assert error_line(OSError("disk full\nmore"), limit=4) == "OSError: disk"
    assert failure_line(setup, SimpleNamespace(failure="setup on rank 0")) == (
        "the learner failed (setup on rank 0): RuntimeError in LearnerRank.setup: sizes differ")
