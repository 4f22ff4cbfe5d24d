"""Faults injected into real `klrl train` processes (Ray + vLLM + DeepSpeed on loopback).

Each test starts the real command line in a subprocess, injects faults from outside (SIGKILL
or SIGSTOP of a rollout worker while Ray shows it running `generate`, a worker's engine step
blocked in its live process, SIGSTOP and SIGKILL of a learner rank, SIGTERM to the driver, a
scorer made slow on purpose) and checks the outcome: the run goes on (a part replaced or
restarted), or stops with a clear message, the right exit code and a loadable checkpoint, and
never leaves a process behind. Each run costs a Ray + vLLM +
DeepSpeed start, so each carries several faults; its docstring lists what it asserts. The
deadline arithmetic itself is tested without processes in tests/test_deadlines.py.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest

from cluster.train import checkpoint as ckpt
from cluster.train.run_log import read_metrics

pytestmark = pytest.mark.slow
XDIST_GROUP = "own-processes"  # runs of their own processes (tests/conftest.py)

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent


class TrainProcess:
    """`python -m cluster.cli train ...` in a subprocess, with every descendant it ever had
    recorded (to prove none outlives it) and a way to kill descendants by Ray process title."""

    def __init__(self, tmp_path: Path, name: str, *args: str, env: dict | None = None):
        self.run_dir = tmp_path / name
        self.log = tmp_path / f"{name}.log"
        env = os.environ | (env or {}) | {
            "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        with open(self.log, "a") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "cluster.cli", "train", *args],
                                         cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.seen: dict[int, float] = {}  # pid -> create time, of every descendant seen
        self.killed: list[str] = []
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._record_descendants, daemon=True)
        self._watch.start()

    def _record_descendants(self) -> None:
        while not self._stop.is_set():
            for p in self._descendants():
                self.seen.setdefault(p.pid, p.create_time())
            # Each pass reads every process's /proc entry (about 3 ms of CPU with the ~100 a
            # run has here): at 5 Hz the recorder takes little of the 2 cores from the tests
            # running beside it. What it proves: no descendant alive at a pass outlives the run.
            time.sleep(0.2)

    def _descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return []

    def steps_done(self) -> int:
        try:
            return max((m["step"] for m in read_metrics(self.run_dir)), default=-1)
        except (FileNotFoundError, ValueError):
            return -1

    def wait_for_step(self, step: int, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while self.steps_done() < step:
            assert self.proc.poll() is None, f"exited early:\n{self.output()}"
            assert time.monotonic() < deadline, f"no step {step} in {timeout}s:\n{self.output()}"
            time.sleep(0.1)

    def kill_titled(self, title: str, times: int = 1, timeout: float = 120,
                    sig: int = signal.SIGKILL) -> None:
        """Send `sig` (SIGKILL; SIGSTOP freezes) to descendants whose process title starts with
        `title` (Ray titles an actor process `ray::Class.method` while it runs that method),
        until `times` of them have had it in all."""
        deadline = time.monotonic() + timeout
        while len(self.killed) < times:
            assert time.monotonic() < deadline, f"never saw {title!r}:\n{self.output()}"
            if self.proc.poll() is not None:
                return
            for p, name in self._titled(title):
                try:
                    if p.status() != psutil.STATUS_STOPPED:  # frozen: had its signal
                        self.killed.append(name)
                        p.send_signal(sig)
                        break
                except psutil.Error:
                    continue
            time.sleep(0.01)

    def pids_titled(self, title: str) -> set[int]:
        """The live descendants whose process title starts with `title`."""
        return {p.pid for p, _ in self._titled(title)}

    def _titled(self, title: str):
        """(process, its title) of each live descendant whose title starts with `title`."""
        for p in self._descendants():
            try:
                cmdline = p.cmdline()  # read once: a dying process's changes under us
            except psutil.Error:
                continue
            if cmdline and cmdline[0].startswith(title):
                yield p, cmdline[0]

    def wait_for_output(self, text: str, timeout: float = 240) -> str:
        """The first line of the command's output that holds `text`, once there is one."""
        deadline = time.monotonic() + timeout
        while True:
            found = [ln for ln in self.output().splitlines() if text in ln]
            if found:
                return found[0]
            assert self.proc.poll() is None, f"exited early:\n{self.output()}"
            assert time.monotonic() < deadline, f"no {text!r} in {timeout}s:\n{self.output()}"
            time.sleep(0.1)

    def finish(self, timeout: float = 300) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self._stop.set()
            self._watch.join()

    def output(self) -> str:
        return self.log.read_text()

    def leftovers(self, grace: float = 30) -> list[str]:
        """Descendants still alive `grace` seconds after the command exited."""
        assert self.seen, "the watcher recorded none of the run's processes: nothing to check"
        deadline = time.monotonic() + grace
        while True:
            alive = []
            for pid, created in self.seen.items():
                try:
                    p = psutil.Process(pid)
                    if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                        alive.append(" ".join(p.cmdline()) or p.name())
                except psutil.Error:
                    continue
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.5)


def tiny_args(model_dir, out, name, steps, *extra) -> list[str]:
    return ["configs/tiny_cpu.yaml", f"model.path={model_dir}", f"output_dir={out}",
            f"run_name={name}", f"total_steps={steps}", "eval_every=0", "eval.num_problems=8",
            "eval.samples=0", "eval.out_of_domain=null", "rollout.prompts_per_step=4",
            "rollout.samples_per_prompt=4", "learner.lr=1e-3", "logging.wandb_mode=disabled",
            "task.reward=scorers:short_answers", *extra]


# Deadlines that fit these runs (steps of the tiny model are short): 5x the median of the
# waits measured so far, at least 5 s, from the first measured wait of each kind on (60 s
# before it). A hang is then caught within the 5 s floor plus a 5 s probe.
FAST_DEADLINES = ("faults.hang_floor_s=5", "faults.hang_startup_waits=1",
                  "faults.hang_startup_s=60")
# floor, probe, and slack: the suite runs two real stacks side by side on 2 cores. What
# matters is seconds, against the hour of the faults.*_timeout_s ceilings.
CAUGHT_WITHIN_S = 5 + 5 + 15


def caught_within(out: str, part: str) -> int:
    """The seconds `part`'s hang message says it waited."""
    found = re.search(rf"{part} did not finish .*? within (\d+) s: it does not answer", out)
    assert found, out
    return int(found.group(1))


# A wedged engine (a step that never ends in a process that answers) is caught within 1.5x
# faults.engine_stall_s (its progress is checked every half of it), plus the same slack.
ENGINE_STALL_S = 8
WEDGE_CAUGHT_WITHIN_S = 1.5 * ENGINE_STALL_S + 15


def test_frozen_worker_is_replaced_a_slow_live_one_is_not_a_wedged_engine_is_and_restarts_stop(
        tmp_path, tiny_model_dir):
    """One run at max_lag 0, four faults (each run costs a Ray + vLLM + DeepSpeed start).
    1. A rollout worker frozen (SIGSTOP) in generate is replaced within its deadline (one
       restart) and re-synced exactly: at max_lag 0 the learner's log-probs equal the
       sampler's only if the new worker holds the learner's weights.
    2. One generate call made slower than its deadline (a scorer sleeps 8 s once) by a worker
       that stays live is waited on and logged, not cut off: no restart.
    3. A wedged engine: the test hook of actors/generation/progress.py blocks one engine step
       forever in the live worker (its process answers every probe); its progress stops, so
       it is replaced within faults.engine_stall_s (one restart), long before the one-hour
       faults.generate_timeout_s, and the run goes on, re-synced exactly.
    4. A killed worker then uses up faults.max_worker_restarts=2: the run stops with a
       checkpoint, exit 1, no process left (the wedged one included)."""
    marker, wedge = tmp_path / "slow_once", tmp_path / "wedge"
    run = TrainProcess(tmp_path, "restarts", *tiny_args(
        tiny_model_dir, tmp_path, "restarts", 50, "faults.max_worker_restarts=2",
        "task.reward=scorers:short_answers_slow_once", "task.scorer_timeout_s=60",
        f"faults.engine_stall_s={ENGINE_STALL_S}", *FAST_DEADLINES),
        env={"KLRL_TEST_SLOW_ONCE": str(marker), "KLRL_TEST_WEDGE_ENGINE": str(wedge)})
    run.wait_for_step(2)
    run.kill_titled("ray::RolloutWorker.generate", sig=signal.SIGSTOP)
    run.wait_for_step(5)  # trained on by the replacement
    out = run.output()
    assert "re-synced" in out and "(restart 1/2)" in out, out
    assert caught_within(out, "rollout worker 0") <= CAUGHT_WITHIN_S

    slow_from = run.steps_done()
    (tmp_path / "slow_once.tmp").write_text("8")
    (tmp_path / "slow_once.tmp").rename(marker)
    run.wait_for_step(slow_from + 3)
    out = run.output()
    assert not marker.exists() and "past its deadline" in out and "but is live" in out, out
    assert "(restart 2/" not in out

    wedged_from = run.steps_done()
    (tmp_path / "wedge.tmp").write_text("")
    (tmp_path / "wedge.tmp").rename(wedge)
    line = run.wait_for_output("its engine has been in one step")
    found = re.search(r"rollout worker 0 did not finish generate within (\d+) s: it answers, "
                      r"but its engine has been in one step for ([\d.]+) s after \d+ steps "
                      rf"\(wedged\) \(deadline: faults.engine_stall_s={ENGINE_STALL_S}\); "
                      r"replaced and re-synced in .*\(restart 2/2\)", line)
    assert found and not wedge.exists(), line
    stalled, waited = float(found.group(2)), int(found.group(1))
    # the step may have begun a moment before the controller's wait on its call did
    assert ENGINE_STALL_S < stalled <= waited + 1 and waited <= WEDGE_CAUGHT_WITHIN_S, line
    run.wait_for_step(wedged_from + 3)  # trained on by the replacement

    run.kill_titled("ray::RolloutWorker.generate", times=2)
    assert run.finish() == 1, run.output()
    assert not run.leftovers()
    out = run.output()
    assert "faults.max_worker_restarts=2" in out and "run stopped" in out, out
    steps = [m for m in read_metrics(run.run_dir) if m["step"] > 0]
    assert [m["step"] for m in steps] == list(range(1, len(steps) + 1)) and len(steps) >= 10
    assert steps[-1]["faults/worker_restarts"] == 2
    assert all(m["rollout/preempted"] == 0 for m in steps)  # batch-level: nothing in flight
    assert max(m["time/wait_for_rollouts"] for m in steps[slow_from:]) >= 8  # past 5 s
    for m in steps:
        assert abs(m["is/ratio_max"] - 1) < 1e-3 and abs(m["is/ratio_min"] - 1) < 1e-3, m
    latest = ckpt.latest_checkpoint(run.run_dir)
    assert latest is not None and f"checkpoint: {latest}" in out
    state = ckpt.read_checkpoint(latest)
    assert state.step >= 10 and state.worker_restarts == 2
    assert not (run.run_dir / "final").exists()


def test_async_run_rides_out_a_worker_death_and_a_frozen_worker_then_sigterm_checkpoints_it(
        tmp_path, tiny_model_dir):
    """max_lag 2: a killed worker and then a frozen (SIGSTOP) one are replaced, one restart
    each (the frozen one within its deadline): the batches still in flight are sent again to
    the replacement, at no extra restart. The signal is sent to a process titled `generate`,
    which may have gone on to its weight load by the time it lands (a fresh-clone run once
    froze it there): a frozen load is caught as a hang too, by its sync.timeout_s. Also: each
    load's sync.timeout_s counts from when it could start, not from when it was queued behind
    slow generate calls (each takes over 1.6 s here, and a load waits behind up to two of
    them, against a 2 s sync timeout); and with generation slower than training a load queued
    behind 2 batches still finds its shm file (the controller confirms older loads before
    publishing: the transport keeps two versions). Then SIGTERM: the run checkpoints, stops
    with 128 + SIGTERM and no process left, its local Ray cluster takes its session directory
    (logs, sockets) away with it (runs do not pile them up, issue 48), and its checkpoint
    holds the restarts counted so far, which `--resume` counts on from (resuming itself is
    tests/test_resume.py's, in a process and under SLURM; a finished run's session:
    tests/test_own_model.py)."""
    ray_tmp = Path(tempfile.mkdtemp(prefix="klrl-ray-", dir="/tmp"))  # short: socket paths
    env = {"RAY_TMPDIR": str(ray_tmp)}
    run = TrainProcess(tmp_path, "async", *tiny_args(
        tiny_model_dir, tmp_path, "async", 12, "max_lag=2", "sync.timeout_s=2",
        "task.reward=scorers:short_answers_slowly", *FAST_DEADLINES), env=env)
    run.wait_for_step(3)  # the worker runs 2 batches behind the learner until it is killed
    run.kill_titled("ray::RolloutWorker.generate")
    run.wait_for_step(6)
    run.kill_titled("ray::RolloutWorker.generate", times=2, sig=signal.SIGSTOP)
    run.wait_for_step(8)  # trained on by the second replacement
    run.proc.send_signal(signal.SIGTERM)
    assert run.finish() == 128 + signal.SIGTERM, run.output()
    assert not run.leftovers()
    out = run.output()
    assert "stopped by SIGTERM" in out, out
    assert "died during generate" in out and "(restart 2/3)" in out, out
    assert caught_within(out, "rollout worker 0") <= CAUGHT_WITHIN_S
    state = ckpt.read_checkpoint(ckpt.latest_checkpoint(run.run_dir))
    stopped_at = state.step
    assert 8 <= stopped_at < 12 and state.worker_restarts == 2
    assert (ray_tmp / "ray").is_dir(), "the run's Ray cluster was not started under RAY_TMPDIR"
    assert not list((ray_tmp / "ray").glob("session_*")), "the stopped run left Ray's session"
    shutil.rmtree(ray_tmp, ignore_errors=True)
    metrics = read_metrics(run.run_dir)
    # each step once, step 0 the eval
    assert [m["step"] for m in metrics] == list(range(stopped_at + 1))
    steps = metrics[1:]
    assert steps[-1]["faults/worker_restarts"] == 2
    assert max(m["lag/max"] for m in steps) <= 2
    assert [m["rollout/policy_version"] for m in steps] == [m["step"] - 1 - m["lag/mean"]
                                                            for m in steps]


def _shm_buffers_of(run: TrainProcess) -> set[str]:
    """The /dev/shm all-reduce buffers this run's learner ranks have mapped (other runs on the
    machine make buffers of their own, so a glob alone would see theirs)."""
    found = set()
    for p in run._descendants():
        try:
            if p.cmdline()[:1] and p.cmdline()[0].startswith("ray::LearnerRank"):
                found |= {m.path for m in p.memory_maps()
                          if m.path.startswith("/dev/shm/deepspeed_allreduce_buffer_")}
        except psutil.Error:
            continue
    return found


def test_frozen_learner_rank_is_restarted_in_the_run_and_a_kill_past_the_limit_stops_it(
        tmp_path, tiny_model_dir):
    """max_lag 2, faults.max_learner_restarts=1 (each run costs a Ray + vLLM + DeepSpeed start,
    so one run carries both learner faults).
    1. Before them, a scorer that hangs on some items is timed out, scores them 0 and counts
       them: the run goes on.
    2. A learner rank frozen mid-run (SIGSTOP: what a stuck collective or a wedged GPU leaves)
       is caught within its deadline (one line naming the rank and the call), the learner
       group is started again from the last complete checkpoint, the rollout workers keep
       their engines (the same processes, rewound to the checkpoint's weights), and the run
       goes on; the frozen rank is gone and its /dev/shm buffers (RAM, which it cannot free
       itself) removed.
    3. The new rank killed (SIGKILL: a crash) uses up the restarts: the run stops at once with
       one line, keeps its last checkpoint, prints the --resume command, exits 1, and leaves
       no process and none of the killed rank's buffers behind.
    Through both, the guarantees of resume hold in the run: each step's row once (the lost
    steps' rows replaced), the lag bound, each batch's data position once."""
    run = TrainProcess(tmp_path, "learner", *tiny_args(
        tiny_model_dir, tmp_path, "learner", 50, "max_lag=2", "checkpoint_every=2",
        "faults.max_learner_restarts=1", "task.scorer_timeout_s=1",
        "task.reward=scorers:short_answers_hanging_on_some", *FAST_DEADLINES))
    run.wait_for_step(4)
    assert sum(m.get("reward/score_failures", 0) for m in read_metrics(run.run_dir)) > 0
    frozen_buffers = _shm_buffers_of(run)
    assert frozen_buffers, "the learner made no /dev/shm buffer to check"
    workers = run.pids_titled("ray::RolloutWorker")
    assert len(workers) == 1, workers
    run.kill_titled("ray::LearnerRank", sig=signal.SIGSTOP)
    frozen_after = run.steps_done()
    restarted = run.wait_for_output("learner restarted from ", timeout=600)  # a whole start
    out = run.output()
    assert caught_within(out, "learner rank 0") <= CAUGHT_WITHIN_S
    [line] = [ln for ln in out.splitlines() if "learner rank 0 did not finish" in ln]
    assert "deadline:" in line and line.endswith("; restarting the learner"), line
    back_to = int(re.search(r"from step_0*(\d+) ", restarted).group(1))
    assert 2 <= back_to <= frozen_after + 1 and back_to % 2 == 0, restarted
    assert "(restart 1/1; rollout workers kept, rewound to its weights)" in restarted, restarted
    run.wait_for_step(frozen_after + 2)
    assert run.pids_titled("ray::RolloutWorker") == workers, "the worker was started again"
    assert not [b for b in frozen_buffers if Path(b).exists()], "the frozen rank's buffers left"

    killed_buffers = _shm_buffers_of(run)
    assert killed_buffers, "the new learner made no /dev/shm buffer to check"
    run.kill_titled("ray::LearnerRank", times=2)
    assert run.finish() == 1, run.output()
    assert not run.leftovers()
    assert not [b for b in killed_buffers if Path(b).exists()], "the killed rank's buffers left"
    out = run.output()
    [line] = [ln for ln in out.splitlines() if ln.startswith("run stopped: ")]
    assert "the learner failed" in line and "rank 0" in line, line
    assert line.endswith("all faults.max_learner_restarts=1 learner restarts are used up, so "
                         "the run stops here"), line
    latest = ckpt.latest_checkpoint(run.run_dir)
    assert latest is not None and f"checkpoint: {latest}" in out
    assert f"continue with: klrl train --resume {run.run_dir}" in out
    state = ckpt.read_checkpoint(latest)
    assert state.learner_restarts == 1 and state.prompt_position == 4 * state.step

    steps = [m for m in read_metrics(run.run_dir) if m["step"] > 0]
    assert [m["step"] for m in steps] == list(range(1, len(steps) + 1))  # each once
    assert len(steps) >= frozen_after + 2
    assert max(m["lag/max"] for m in steps) <= 2
    assert [m["rollout/policy_version"] for m in steps] == [m["step"] - 1 - m["lag/mean"]
                                                            for m in steps]
    redone = [m for m in steps if m["step"] > back_to]
    assert all(m["faults/learner_restarts"] == 1 for m in redone)
    # the steps trained after the checkpoint: those logged, and one more if the rank froze
    # after its train step returned (in the weight publish, before the row was written)
    [lost] = {m["faults/learner_steps_lost"] for m in redone}
    assert lost in (frozen_after - back_to, frozen_after + 1 - back_to), (lost, frozen_after)
