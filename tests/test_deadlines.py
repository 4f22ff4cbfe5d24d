"""Deadlines of waits on the learner and rollout workers (cluster/train/deadlines.py): the
derivation from measured durations, and the wait loop, on a fake clock (no Ray, no waiting);
and the process group's timeout in two real gloo processes (slow: DeepSpeed).
The real stack (SIGSTOP of a learner rank or a worker) is in tests/test_faults.py."""
from __future__ import annotations

import errno
import multiprocessing
import time

import pytest

from cluster.config.loader import ConfigError
from cluster.config.sections import FaultConfig
from cluster.config.train_config import load_train_config
from cluster.train.deadlines import (
    WINDOW,
    Deadline,
    HangPolicy,
    Hung,
    LearnerDeadlines,
    LearnerHung,
    WaitTimes,
    Watch,
    deadline_for,
    wait_all,
)
from learner.process_group import remove_shm_buffers

POLICY = HangPolicy(multiple=5, floor_s=10, startup_s=300, startup_waits=3)


def deadline(durations, ceiling=3600.0) -> Deadline:
    return deadline_for("train step", durations, POLICY, ceiling, "faults.learner_timeout_s")


def test_the_first_waits_get_the_startup_allowance():
    for measured in ([], [1.0], [1.0, 1.0]):
        d = deadline(measured)
        assert d.seconds == 300 and "faults.hang_startup_s=300 until 3 train steps" in d.basis


def test_a_multiple_of_the_median_once_enough_are_measured():
    d = deadline([8.0, 9.0, 8.4, 30.0])  # one slow step does not move the median much
    assert d.seconds == pytest.approx(5 * 8.7) and d.basis == "5x median train step 8.7 s"
    # a 1-second step: caught in a minute at most, at the floor
    d = deadline([1.0] * 10)
    assert d.seconds == 10 and "raised to faults.hang_floor_s=10" in d.basis


def test_a_ten_minute_step_is_never_cut_off_and_the_ceiling_wins():
    assert deadline([600.0] * 5).seconds == 3000  # 5x: well above the step
    d = deadline([600.0] * 5, ceiling=1800)
    assert d.seconds == 1800 and "capped at faults.learner_timeout_s=1800" in d.basis
    assert deadline([], ceiling=100).seconds == 100  # nor the start-up allowance


def test_the_median_follows_the_recent_waits():
    times = WaitTimes("generate", POLICY, 3600, "faults.generate_timeout_s")
    for _ in range(WINDOW):
        times.record(100.0)
    for _ in range(WINDOW):  # the run's steps got faster: the old ones are forgotten
        times.record(4.0)
    assert times.deadline().seconds == 20


class FakeRay:
    """ray.wait / ray.get over refs that finish at given (fake) times; time passes only in
    `wait`, as it would while blocked."""

    def __init__(self, done_at: dict, errors=()):
        self.now, self.done_at, self.errors = 0.0, done_at, set(errors)

    def clock(self) -> float:
        return self.now

    def wait(self, pending, num_returns, timeout):
        first = min((self.done_at[r] for r in pending), default=float("inf"))
        self.now = min(first, self.now + timeout) if first > self.now else self.now
        ready = [r for r in pending if self.done_at[r] <= self.now][:num_returns]
        return ready, [r for r in pending if r not in ready]

    def get(self, refs):
        for r in refs:
            if r in self.errors:
                raise RuntimeError(f"{r} failed")
        return [f"value of {r}" for r in refs]


DEADLINE = Deadline(10, 100, "5x median train step 2.0 s")


def run_wait(fake, refs, probe):
    lines = []
    values = wait_all(refs, DEADLINE, "the learner", "train step 7", probe, wait=fake.wait,
                      get=fake.get, clock=fake.clock, log=lines.append)
    return values, lines


def test_a_slow_but_live_wait_goes_on_and_is_logged_once():
    fake, probes = FakeRay({"a": 1.0, "b": 35.0}), []
    values, lines = run_wait(fake, ["a", "b"], lambda: probes.append(fake.now))
    assert values == ["value of a", "value of b"] and fake.now == 35
    assert probes == [10, 20, 30]  # probed at the deadline, then once per deadline
    assert len(lines) == 1 and "train step 7 has taken 10 s, past its deadline" in lines[0]


def test_a_part_found_hung_at_the_deadline_raises_with_its_name():
    fake = FakeRay({"a": float("inf")})
    with pytest.raises(Hung) as caught:
        run_wait(fake, ["a"], lambda: ("learner rank 0", "it does not answer"))
    assert str(caught.value) == ("learner rank 0 did not finish train step 7 within 10 s: it "
                                 "does not answer (deadline: 5x median train step 2.0 s)")
    assert fake.now == 10


def test_the_ceiling_holds_for_a_live_part():
    fake = FakeRay({"a": float("inf")})
    with pytest.raises(Hung, match="within 100 s: still running at the ceiling"):
        run_wait(fake, ["a"], lambda: None)


def test_a_watch_catches_a_wedged_part_before_the_deadline_and_is_quiet_otherwise():
    """A rollout worker's engine progress is watched apart from the probe (worker_pool.py):
    a check that finds the part hung raises at once under its own limit; one that finds
    nothing leaves the deadline's probing as it was."""
    limit = Deadline(4, 4, "faults.engine_stall_s=4")
    fake, checks = FakeRay({"a": float("inf")}), []

    def check():
        checks.append(fake.now)
        return ("rollout worker 0", "its engine has been in one step for 5 s") if fake.now >= 6 \
            else None

    with pytest.raises(Hung) as caught:
        wait_all(["a"], DEADLINE, "rollout worker 0", "generate", lambda: None,
                 watch=Watch(2, check, limit), wait=fake.wait, get=fake.get, clock=fake.clock,
                 log=lambda line: None)
    assert checks == [2, 4, 6] and fake.now == 6  # before the 10 s deadline
    assert str(caught.value) == ("rollout worker 0 did not finish generate within 6 s: its "
                                 "engine has been in one step for 5 s (deadline: "
                                 "faults.engine_stall_s=4)")
    fake, probes, checks = FakeRay({"a": 1.0, "b": 35.0}), [], []
    values = wait_all(["a", "b"], DEADLINE, "rollout worker 0", "generate",
                      lambda: probes.append(fake.now),
                      watch=Watch(3, lambda: checks.append(fake.now), limit),
                      wait=fake.wait, get=fake.get, clock=fake.clock, log=lambda line: None)
    assert values == ["value of a", "value of b"] and probes == [10, 20, 30]
    assert checks == [3 * k for k in range(1, 12)]


def test_a_failed_call_raises_at_once_without_waiting_for_the_others():
    fake = FakeRay({"a": float("inf"), "b": 2.0}, errors={"b"})
    with pytest.raises(RuntimeError, match="b failed"):
        run_wait(fake, ["a", "b"], lambda: None)
    assert fake.now == 2


class FakeGroup:
    def __init__(self, healths):
        self.version, self.healths = 10, healths

    def health(self, timeout):
        return self.healths


def learner_wait(monkeypatch, group, done_at, method="train_step"):
    """LearnerDeadlines waiting on refs that finish at `done_at` (fake time)."""
    import cluster.train.deadlines as module

    fake = FakeRay(done_at)
    monkeypatch.setattr(module, "wait_all", lambda *a, **kw: wait_all(
        *a, wait=fake.wait, get=fake.get, clock=fake.clock, log=lambda line: None, **kw))
    deadlines = LearnerDeadlines(FaultConfig(hang_floor_s=5, hang_startup_s=20))
    return deadlines(group, list(done_at), method), deadlines


def test_a_learner_rank_that_answers_without_progress_stops_the_run(monkeypatch):
    with pytest.raises(LearnerHung) as caught:
        learner_wait(monkeypatch, FakeGroup([0.5, 25.0]), {"r0": float("inf"), "r1": float("inf")})
    stop = caught.value
    assert not stop.write_checkpoint and stop.exit_code == 1
    assert str(stop).startswith("learner rank 1 did not finish train step 11 within 20 s: it "
                                "answers but made no progress for 25 s")
    with pytest.raises(LearnerHung, match="learner rank 0 did not finish the weight publish of "
                                          "version 10 within 20 s: it does not answer"):
        learner_wait(monkeypatch, FakeGroup([None, 1.0]), {"r0": float("inf")}, "export_weights")


def test_learner_waits_are_measured_per_kind(monkeypatch):
    values, deadlines = learner_wait(monkeypatch, FakeGroup([1.0]), {"r0": 3.0})
    assert values == ["value of r0"] and list(deadlines.times) == ["train step"]


def test_fault_options_are_bounded_and_the_old_timeout_keeps_its_meaning_as_the_ceiling():
    cfg = load_train_config(None, ["faults.generate_timeout_s=120"])
    assert cfg.faults.generate_timeout_s == 120
    with pytest.raises(ConfigError, match="hang_multiple"):
        load_train_config(None, ["faults.hang_multiple=1"])
    with pytest.raises(ConfigError, match="hang_floor_s"):
        load_train_config(None, ["faults.hang_floor_s=0"])


def _rank(rank: int, ports, out) -> None:
    import torch
    import torch.distributed as dist

    from learner.process_group import host_store, init_process_group

    store = None
    if rank == 0:  # hosts the rendezvous, as a learner's rank 0 does, and tells rank 1 where
        store = host_store("127.0.0.1", 2, collective_timeout_s=2)
        ports.put(store.port)
        ports.put(store.port)  # one for rank 1, one for the test (its shm cleanup)
    port = store.port if store else ports.get(timeout=60)
    init_process_group(False, rank, 2, "127.0.0.1", port, store, collective_timeout_s=2)
    if rank == 1:  # never joins the collective, and stays alive
        time.sleep(30)
        return
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
        out.put(("returned", time.monotonic() - t0))
    except Exception as exc:  # noqa: BLE001 - the point: it raises
        out.put((type(exc).__name__, time.monotonic() - t0))


@pytest.mark.slow
def test_a_stuck_collective_raises_within_the_process_groups_timeout():
    """learner.process_group.init_process_group's timeout (faults.learner_timeout_s in a run)
    reaches gloo: a collective a rank never joins raises in the rank waiting in it."""
    ctx = multiprocessing.get_context("spawn")
    out, ports = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, ports, out), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    port = None
    try:
        outcome, waited = out.get(timeout=120)
        port = ports.get(timeout=5)
    finally:
        for p in procs:
            p.kill()
            p.join()
        if port is not None:
            remove_shm_buffers("127.0.0.1", port)  # DeepSpeed's CPU all-reduce buffers (RAM)
    assert outcome != "returned" and 1.5 < waited < 15, (outcome, waited)


def test_the_rendezvous_port_is_held_from_the_moment_it_is_chosen():
    """Rank 0 listens on the port the OS gave it before anyone learns the number, so no other
    process can take it in between (a free port picked first and bound later can be taken
    meanwhile: EADDRINUSE)."""
    import socket

    from learner.process_group import host_store

    store = host_store("127.0.0.1", 2, collective_timeout_s=5)
    with socket.socket() as s, pytest.raises(OSError) as err:
        s.bind(("127.0.0.1", store.port))
    assert err.value.errno == errno.EADDRINUSE
