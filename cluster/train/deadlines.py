"""Deadlines for every wait on the learner and the rollout workers, derived from the run.

A hung part (a rank frozen or stuck in a collective, a worker whose process stopped) must stop
the run, or be replaced, in minutes; a slow but healthy one must never be cut off. Each kind of
wait (a train step, a publish, a checkpoint, a generate call, ...) keeps the durations it has
measured, and gets two limits:

- the *deadline*: `faults.hang_multiple` x the median of its last `WINDOW` measured durations,
  at least `faults.hang_floor_s`; before `faults.hang_startup_waits` of them are measured (the
  start-up and the first steps, whose times say little), `faults.hang_startup_s` instead.
- the *ceiling* (`faults.learner_timeout_s`, `faults.generate_timeout_s`): no wait goes past it.

When the deadline passes, the part is probed (`wait_all`'s `probe`): one that answers (and, for
a train step, has made progress within the deadline) is slow but live, so the wait goes on,
probed again each deadline, up to the ceiling; one that does not is hung (`Hung`). The
ceiling wins over the floor and the start-up allowance: no deadline exceeds it. A rollout
worker's engine is also watched through the wait, apart from the probe and sooner than its
deadline (`Watch`): a step under way past `faults.engine_stall_s` is a wedged engine, hung
although the process answers.
"""
from __future__ import annotations

import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cluster.train.stopping import RunStopped

# The median of the last 50 waits of a kind: it follows a run whose steps grow (longer responses).
WINDOW = 50
# How long a probed part has to answer: a live process answers a health call in milliseconds.
PROBE_S = 10.0


@dataclass(frozen=True)
class HangPolicy:
    """The `faults` options that derive deadlines (cluster.config.sections.FaultConfig)."""

    multiple: float
    floor_s: float
    startup_s: float
    startup_waits: int

    @classmethod
    def of(cls, faults) -> HangPolicy:
        return cls(faults.hang_multiple, faults.hang_floor_s, faults.hang_startup_s,
                   faults.hang_startup_waits)


@dataclass(frozen=True)
class Deadline:
    """Invariant: 0 < seconds <= ceiling_s. `basis` says where `seconds` came from."""

    seconds: float
    ceiling_s: float
    basis: str


def deadline_for(kind: str, durations: Sequence[float], policy: HangPolicy, ceiling_s: float,
                 ceiling_option: str) -> Deadline:
    """The deadline of the next wait of `kind`, given its measured `durations` (oldest first)."""
    recent = list(durations)[-WINDOW:]
    if len(recent) < policy.startup_waits:
        seconds = max(policy.startup_s, policy.floor_s)
        basis = (f"faults.hang_startup_s={policy.startup_s:g} until "
                 f"{policy.startup_waits} {kind}s are measured")
    else:
        median = statistics.median(recent)
        seconds = max(policy.multiple * median, policy.floor_s)
        basis = f"{policy.multiple:g}x median {kind} {median:.1f} s"
        if seconds > policy.multiple * median:
            basis += f", raised to faults.hang_floor_s={policy.floor_s:g}"
    if seconds >= ceiling_s:
        seconds, basis = ceiling_s, f"{basis}, capped at {ceiling_option}={ceiling_s:g}"
    return Deadline(seconds, ceiling_s, basis)


class WaitTimes:
    """The measured durations of one kind of wait, and its next deadline."""

    def __init__(self, kind: str, policy: HangPolicy, ceiling_s: float, ceiling_option: str):
        self.kind, self.policy = kind, policy
        self.ceiling_s, self.ceiling_option = ceiling_s, ceiling_option
        self.durations: deque[float] = deque(maxlen=WINDOW)

    def deadline(self) -> Deadline:
        return deadline_for(self.kind, self.durations, self.policy, self.ceiling_s,
                            self.ceiling_option)

    def record(self, seconds: float) -> None:
        self.durations.append(seconds)


class Hung(Exception):
    """A wait passed its deadline on a part that is not live, or passed its ceiling.
    `part` names what hung ("learner rank 0"), `what` the call ("train step 11")."""

    def __init__(self, part: str, what: str, waited_s: float, why: str, deadline: Deadline):
        self.part, self.what, self.waited_s, self.why = part, what, waited_s, why
        self.deadline = deadline
        super().__init__(f"{part} {self.detail}")

    @property
    def detail(self) -> str:
        """The message without the part's name."""
        return (f"did not finish {self.what} within {self.waited_s:.0f} s: {self.why} "
                f"(deadline: {self.deadline.basis})")


# probe() -> None when every part waited on is live, else (the hung part, why).
Probe = Callable[[], "tuple[str, str] | None"]


@dataclass(frozen=True)
class Watch:
    """A check `wait_all` runs every `every_s` seconds of a wait, before and beside its
    deadline: a part it finds hung (check() -> (part, why), as a probe) is hung at once, under
    `limit` (what the check enforces, for the message). A rollout worker's engine progress
    (a step under way past faults.engine_stall_s) is watched so, apart from its probe."""

    every_s: float
    check: Probe
    limit: Deadline


def wait_all(refs: list, deadline: Deadline, part: str, what: str, probe: Probe, *,
             watch: Watch | None = None, wait: Callable | None = None,
             get: Callable | None = None, clock: Callable[[], float] = time.monotonic,
             log: Callable[[str], None] | None = None) -> list[Any]:
    """The values of `refs` (Ray object refs), raising the first error as soon as it happens
    (the other ranks of a group may be blocked forever in a collective with a failed one).
    Raises Hung when `deadline` passes and `probe` finds a part hung, when `watch` finds one
    hung (checked every `watch.every_s`), or at the ceiling.
    `wait`/`get`/`clock` default to ray.wait, ray.get and the monotonic clock (tests fake them)."""
    if wait is None or get is None:
        import ray

        wait, get = wait or ray.wait, get or ray.get
    log = log or _stderr
    start = clock()
    check_at, ceiling_at, said = start + deadline.seconds, start + deadline.ceiling_s, False
    watch_at = start + watch.every_s if watch else float("inf")
    pending = list(refs)
    while pending:
        timeout = max(0.0, min(check_at, ceiling_at, watch_at) - clock())
        ready, pending = wait(pending, num_returns=1, timeout=timeout)
        if ready:
            get(ready)  # raises a failed call's exception now
            continue
        now = clock()
        if now >= ceiling_at:
            raise Hung(part, what, now - start, "still running at the ceiling", deadline)
        if watch and now >= watch_at:
            if (hung := watch.check()) is not None:
                raise Hung(hung[0], what, clock() - start, hung[1], watch.limit)
            watch_at = clock() + watch.every_s
        if now < check_at:
            continue
        hung = probe()
        if hung is not None:
            raise Hung(hung[0], what, clock() - start, hung[1], deadline)
        if not said:  # the deadline fired on a live part: say so once, then keep waiting
            log(f"{part}: {what} has taken {now - start:.0f} s, past its deadline "
                f"({deadline.basis}), but is live: waiting on, up to {deadline.ceiling_s:g} s")
            said = True
        check_at = clock() + deadline.seconds
    return get(refs)


class LearnerHung(RunStopped):
    """A learner rank hung: the run stops at once, keeping its last complete checkpoint (a hung
    group cannot write one)."""

    def __init__(self, message: str):
        super().__init__(message, write_checkpoint=False)


# LearnerRank's methods, as deadlines name their kinds of wait. "node_info" is the ranks' first
# call: it waits for Ray to place and construct them (no call, the probe included, runs before),
# which may mean waiting for nodes to join, so only the ceiling bounds it.
LEARNER_KINDS = {"node_info": "learner placement", "setup": "learner start-up",
                 "train_step": "train step", "export_weights": "weight publish",
                 "save_checkpoint": "checkpoint",
                 "load_checkpoint": "checkpoint load", "save_hf": "Hugging Face export"}


class LearnerDeadlines:
    """LearnerGroup's `wait`: each call on the ranks waits under the deadline of its kind; a
    hung rank stops the run (LearnerHung). A rank is live if it answers `health` and, in a
    train step (the one call that reports progress), has made progress within the deadline."""

    def __init__(self, faults):
        self.policy, self.ceiling_s = HangPolicy.of(faults), faults.learner_timeout_s
        self.times: dict[str, WaitTimes] = {}

    def __call__(self, group, refs: list, method: str) -> list:
        kind = LEARNER_KINDS.get(method, method)
        times = self.times.setdefault(kind, WaitTimes(kind, self.policy, self.ceiling_s,
                                                      "faults.learner_timeout_s"))
        deadline = times.deadline()
        if method == "node_info":
            deadline = Deadline(self.ceiling_s, self.ceiling_s,
                                f"faults.learner_timeout_s={self.ceiling_s:g}")
        what = {"train_step": f"train step {group.version + 1}", "export_weights":
                f"the weight publish of version {group.version}"}.get(method, kind)

        def probe():
            for rank, idle in enumerate(group.health(min(PROBE_S, deadline.seconds))):
                if idle is None:
                    return f"learner rank {rank}", "it does not answer (frozen or dead)"
                if method == "train_step" and idle > deadline.seconds:
                    return f"learner rank {rank}", (f"it answers but made no progress for "
                                                    f"{idle:.0f} s (stuck in a collective?)")
            return None

        t0 = time.monotonic()
        try:
            values = wait_all(refs, deadline, "the learner", what, probe)
        except Hung as hang:
            raise LearnerHung(f"{hang}; its last complete checkpoint is kept") from None
        times.record(time.monotonic() - t0)
        return values


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
