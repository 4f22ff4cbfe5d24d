"""`WorkerPool`: the rollout workers, replaced when they die or hang.

A worker whose call fails with a dead actor, or hangs (cluster/train/deadlines.py: past the
deadline derived from the run's measured calls of that kind, it does not answer a health call;
in a generate or evaluate call, its engine has been in one step past `faults.engine_stall_s`
while the process answers, a wedged engine; or past the ceiling `faults.generate_timeout_s`,
live or not), is killed and replaced by a fresh one on the same model; the run's
recovery (cluster/train/recovery.py) says whether the transport can take a new worker and
re-syncs the current weights into it (checking the version) before the failed call is sent
again. Replaying a generation request is exact: the request
carries its own seed. Every replacement counts against `faults.max_worker_restarts` over the
whole run; the failure after the last allowed restart raises `WorkerRestartsExhausted`.

Invariant: one fault costs one restart. Every call is a `WorkerCall` that remembers which
incarnation of its worker it was sent to; a call whose worker has since been replaced (the
other batches in flight at max_lag >= 1, a queued weight load) is sent again to the
replacement, which already holds the current weights, without another restart.

With continuous generation (`rollout.in_flight_updates`; the mode says so,
actors/generation/) the generate calls run side by side on a worker, in its concurrency group
"generate" (max_lag + 1 threads), beside its weight loads and evaluations (the default group,
one at a time, in order). A generate call sent again goes to that group
on the replacement too, with its own arguments: its `min_version` is at most the version the
replacement was re-synced to, so the replacement starts it at once. Each generate call sent
again counts its samples in `reissued_samples` (logged as faults/reissued_samples): a fault
loses no request silently.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError

from actors.records import RolloutBatch
from cluster.config.train_config import TrainConfig
from cluster.train.deadlines import (
    PROBE_S,
    Deadline,
    HangPolicy,
    Hung,
    WaitTimes,
    Watch,
    wait_all,
)
from cluster.train.stopping import RunStopped

START = "worker start-up"  # the kind of wait of a worker's start (deadlines.py)
# How long a replacement waits for the process of the worker it replaces to be gone before it
# starts its engine anyway (saying so): SIGKILL takes effect at once, unless the process is in
# an uninterruptible wait on the device, which the GPU driver bounds.
GONE_TIMEOUT_S = 60.0
# The calls that drive a worker's engine: their engine's progress is watched (`_engine_watch`).
ENGINE_CALLS = ("generate", "evaluate")


class WorkerRestartsExhausted(RunStopped):
    """A worker failed and cannot be replaced: the restarts are used up, the replacement hung
    in its start, or the sync transport cannot take a new worker."""


@dataclass
class WorkerCall:
    """`method(*args)` sent to incarnation `incarnation` of worker `worker`; `ref` its result."""

    worker: int
    incarnation: int
    method: str
    args: tuple
    ref: Any


@dataclass
class InFlight:
    """One global batch being generated: one generate call per rollout worker (the
    controller's pipeline holds these; the weight sync's books queue loads behind them)."""

    calls: list[WorkerCall]      # replayed with their own seeds if a worker is replaced
    start_position: int          # data position of its first prompt (resume replays from here)
    requested_at_version: int    # with in-flight updates, its calls' min_version


def start_worker(cfg: TrainConfig, model_dir: Path, index: int, worker_class: type | None = None):
    """Rollout worker `index` as a Ray actor with the GPUs its engine uses (with tensor
    parallelism, num_gpus_per_worker = tensor_parallel_size: RolloutConfig's rule), loading
    the model and tokenizer at model.revision with model.trust_remote_code. worker_class: a
    subclass of RolloutWorker to start instead (`klrl bench`'s timed worker)."""
    from actors.rollout_worker import RolloutWorker

    r = cfg.worker_rollout  # dtype and threads resolved (TrainConfig's rules)
    # "health": a thread of its own, so that `version` answers the hang probe while a
    # generate call runs; every other call runs in the default group, one at a time, in order,
    # unless the generation mode has a group for it (continuous: "generate", the max_lag + 1
    # batches in flight generated side by side; WorkerPool.call sends them there).
    groups = {"health": 1} | r.generation.concurrency_groups(cfg.max_lag)
    # OMP_NUM_THREADS from the start (Ray would set it to num_cpus): OpenMP reads it once, and
    # the threads Ray runs calls on keep that value whatever torch.set_num_threads says on
    # another (vLLM's CPU attention checks that the two agree).
    return ray.remote(concurrency_groups=groups)(worker_class or RolloutWorker).options(
        num_cpus=r.num_cpus_per_worker, num_gpus=r.num_gpus_per_worker,
        runtime_env={"env_vars": {"OMP_NUM_THREADS": str(r.threads)}},
        resources=cfg.ray.worker_resources or None).remote(
        model_dir=str(model_dir), rollout_cfg=r, sync_cfg=cfg.sync, task_cfg=cfg.task,
        worker_index=index, seed=cfg.seed, revision=cfg.model.revision,
        trust_remote_code=cfg.model.trust_remote_code,
        lora_rank=cfg.learner.lora.rank if cfg.learner.lora is not None else None)


class WorkerPool:
    """Owns the rollout worker actors: starts them, sends their calls and takes the results
    under each kind of call's deadline, and replaces a worker that dies or hangs (module
    docstring), within `faults.max_worker_restarts` and what the sync transport allows."""

    def __init__(self, cfg: TrainConfig, model_dir: Path, recovery):
        """`recovery`: the run's (recovery.Recovery): `why_no_worker_replacement()` and
        `worker_replaced(worker)`, the re-sync of a replacement."""
        self.cfg, self.model_dir, self.recovery = cfg, Path(model_dir), recovery
        self.mode = cfg.rollout.generation  # how generate calls are sent (actors/generation/)
        self.restarts = 0
        self.reissued_samples = 0  # samples of generate calls sent again to a replacement
        self.incarnation = [0] * cfg.rollout.num_workers  # bumped when worker i is replaced
        # Deadlines per kind of call ("generate", "evaluate", START), measured over
        # all workers together: they run the same engine on the same kind of batch.
        self.times: dict[str, WaitTimes] = {}
        # Actor creation returns at once: the engines start while the caller starts the
        # learner, and `wait_started` surfaces their start-up errors.
        self.workers = [start_worker(cfg, model_dir, i) for i in range(cfg.rollout.num_workers)]
        # (node id, pid) of each worker's process, once it is up: what a replacement waits for
        self.processes: list[tuple[str, int] | None] = [None] * cfg.rollout.num_workers

    def wait_started(self) -> None:
        """Block until every worker's engine is up (raises its start-up error), within the
        ceiling (a starting actor cannot be probed: `_wait`)."""
        starts = [w.version.remote() for w in self.workers]
        for i, ref in enumerate(starts):
            try:
                self._wait(i, ref, START, "its start")
            except Hung as hang:
                raise RunStopped(str(hang)) from None
            self._note_process(i)

    def _note_process(self, i: int) -> None:
        try:
            self.processes[i] = ray.get(self.workers[i].process.options(
                concurrency_group="health").remote(), timeout=PROBE_S)
        except (GetTimeoutError, RayActorError):
            self.processes[i] = None  # not known: a replacement of it does not wait

    def __len__(self) -> int:
        return len(self.workers)

    def call(self, i: int, method: str, *args) -> WorkerCall:
        """Start `method(*args)` on worker i, in the concurrency group the generation mode
        gives it (continuous: a generate call in the worker's group "generate"; module
        docstring)."""
        remote = getattr(self.workers[i], method)
        if options := self.mode.call_options(method):
            remote = remote.options(**options)
        return WorkerCall(i, self.incarnation[i], method, args, remote.remote(*args))

    def is_current(self, call: WorkerCall) -> bool:
        """Whether the worker `call` was sent to is still in the pool (not replaced since)."""
        return self.incarnation[call.worker] == call.incarnation

    def result(self, call: WorkerCall):
        """The value of `call`. If its worker was replaced meanwhile, the call is sent again
        to the replacement; if the worker dies or hangs now, it is replaced (one restart) and
        the call sent again, until it succeeds or restarts run out."""
        i = call.worker
        while True:
            if not self.is_current(call):
                call = self._reissue(call)
            t0 = time.monotonic()
            try:
                value = self._wait(i, call.ref, call.method, call.method)
            except (RayActorError, Hung) as exc:
                if not self.is_current(call):
                    continue  # replaced while we waited: no new restart for the same fault
                self.restart(i, exc.detail if isinstance(exc, Hung) else
                             f"died during {call.method}: {type(exc).__name__}")
                continue
            # A generate call's measure: the controller's wait, or the engine time the worker
            # reports when that is longer (at max_lag > 0 a batch is often done before the
            # controller asks for it, so the wait alone would understate the call).
            waited = time.monotonic() - t0
            self._times(call.method).record(max(waited, value.gen_seconds) if isinstance(
                value, RolloutBatch) else waited)
            return value

    def _reissue(self, call: WorkerCall) -> WorkerCall:
        """`call` sent again, to the replacement of its worker; a generate call's samples are
        counted (`reissued_samples`)."""
        if call.method == "generate":
            samples = len(call.args[0]) * self.cfg.rollout.samples_per_prompt
            self.reissued_samples += samples
            print(f"rollout worker {call.worker}: a generate call of {samples} samples sent "
                  "to the replaced worker is sent again to its replacement", file=sys.stderr)
        return self.call(call.worker, call.method, *call.args)

    def wait_done(self, calls: list[WorkerCall]) -> None:
        """Wait until `calls` (to one worker) have finished, one way or another, without taking
        their values: a worker that died has answered (its death is handled when the values
        are taken); one that hangs is replaced (one restart)."""
        for call in calls:
            if not self.is_current(call):
                continue
            try:
                self._wait(call.worker, call.ref, call.method, call.method)
            except RayActorError:
                continue
            except Hung as hang:
                if self.is_current(call):
                    self.restart(call.worker, hang.detail)

    def _wait(self, i: int, ref, kind: str, what: str):
        """The value of `ref`, a call to worker i, under the deadline of `kind` (Hung past it).
        A starting worker cannot be probed (Ray runs no call before its constructor returns,
        and loading a large model may take long): its start is bounded by the ceiling alone."""
        def probe():
            why = self.unresponsive(i, min(PROBE_S, deadline.seconds))
            return (f"rollout worker {i}", why) if why else None

        if kind == START:
            ceiling = self.cfg.faults.generate_timeout_s
            deadline = Deadline(ceiling, ceiling, f"faults.generate_timeout_s={ceiling:g}")
        else:
            deadline = self._times(kind).deadline()
        watch = self._engine_watch(i) if kind in ENGINE_CALLS else None
        return wait_all([ref], deadline, f"rollout worker {i}", what, probe, watch=watch)[0]

    def _engine_watch(self, i: int) -> Watch:
        """Worker i's engine progress, checked through a call that drives its engine: a step
        under way longer than faults.engine_stall_s is a wedged engine (hung, though the
        process answers: actors/generation/progress.py). Checked every half of that, so a
        wedge is caught within 1.5x it."""
        stall_s = self.cfg.faults.engine_stall_s
        limit = Deadline(stall_s, stall_s, f"faults.engine_stall_s={stall_s:g}")
        every_s = stall_s / 2

        def check():
            try:  # within the interval: a frozen worker must not hold up the deadline's probe
                progress = ray.get(self.workers[i].engine_progress.options(
                    concurrency_group="health").remote(), timeout=min(PROBE_S, every_s))
            except (GetTimeoutError, RayActorError):
                return None  # not answering: the deadline's probe judges that (frozen, dead)
            if progress.step_running_s <= stall_s:
                return None
            return f"rollout worker {i}", (
                f"it answers, but its engine has been in one step for "
                f"{progress.step_running_s:.1f} s after {progress.steps} steps (wedged)")

        return Watch(every_s, check, limit)

    def unresponsive(self, i: int, within_s: float = PROBE_S) -> str | None:
        """Why worker i is hung (it does not answer a health call within `within_s`, or it
        died), or None when it answers: the health group runs beside a busy call."""
        try:
            ray.get(self.workers[i].version.options(concurrency_group="health").remote(),
                    timeout=within_s)
        except GetTimeoutError:
            return "it does not answer (frozen or dead)"
        except RayActorError:
            return "it died"
        return None

    def _times(self, kind: str) -> WaitTimes:
        if kind not in self.times:
            self.times[kind] = WaitTimes(kind, HangPolicy.of(self.cfg.faults),
                                         self.cfg.faults.generate_timeout_s,
                                         "faults.generate_timeout_s")
        return self.times[kind]

    def restart(self, i: int, reason: str) -> None:
        """Replace worker i (dead or hung) and let the recovery re-sync its weights."""
        t0 = time.perf_counter()
        self._replace(i, reason)
        self.recovery.worker_replaced(self.workers[i])
        print(f"rollout worker {i} {reason}; replaced and re-synced in "
              f"{time.perf_counter() - t0:.1f}s ({self._restart_count()})", file=sys.stderr)

    def settle(self, calls: list[WorkerCall]) -> None:
        """A learner restart that keeps the workers (recovery.py): their calls in flight
        (`calls`, generate calls and weight loads) belong to the lost steps. The generate calls
        not yet started are cancelled (Ray drops a queued actor call; one that runs finishes),
        then every call is waited for, one way or another, without taking its value (a
        cancelled or failed one has answered: the owner loads the checkpoint's weights over
        whatever it left). A worker that dies or hangs meanwhile is replaced (one restart)
        without a re-sync: the owner re-syncs every worker next. Weight loads are not
        cancelled: with in-flight updates a running generate call may wait for its version."""
        for call in calls:
            if call.method == "generate" and self.is_current(call):
                ray.cancel(call.ref)
        for call in calls:
            if not self.is_current(call):
                continue  # its worker was replaced during this wait
            try:
                self._wait(call.worker, call.ref, call.method, call.method)
                continue
            except Hung as hang:
                reason = hang.detail
            except RayActorError as exc:
                reason = f"died during {call.method}: {type(exc).__name__}"
            except RayError:
                continue  # cancelled, or failed: it has answered
            self._replace(call.worker, reason)
            print(f"rollout worker {call.worker} {reason}; replaced during the learner restart "
                  f"({self._restart_count()})", file=sys.stderr)

    def _replace(self, i: int, reason: str) -> None:
        """Kill worker i (dead or hung) and start a new one on the same model, counting one
        restart; WorkerRestartsExhausted when none is left or the transport cannot take a new
        worker."""
        limit = self.cfg.faults.max_worker_restarts
        if why := self.recovery.why_no_worker_replacement():
            # the config allowed no restart under this transport (TrainConfig): say why
            raise WorkerRestartsExhausted(f"rollout worker {i} {reason}; {why}, so the run "
                                          "stops here")
        if self.restarts >= limit:
            raise WorkerRestartsExhausted(
                f"rollout worker {i} {reason}; all faults.max_worker_restarts={limit} restarts "
                "are used up, so the run stops here")
        self.restarts += 1
        ray.kill(self.workers[i], no_restart=True)
        # vLLM sizes a new engine's memory from what the whole GPU has free when it starts
        # (`gpu_memory_utilization` is checked against free memory, then profiled device-wide):
        # on a GPU shared with the old engine, starting while that process still exits fails
        # the check or shrinks the KV cache. ray.kill returns before the process is gone.
        if self.processes[i] is not None:
            node, pid = self.processes[i]
            if not wait_gone(node, pid, GONE_TIMEOUT_S):
                print(f"rollout worker {i}: its process {pid} is still there {GONE_TIMEOUT_S:.0f}"
                      " s after it was killed; starting the replacement anyway",
                      file=sys.stderr)
        self.workers[i] = start_worker(self.cfg, self.model_dir, i)
        self.incarnation[i] += 1
        # Wait for the engine to be up first: the owner's re-sync has sync.timeout_s for the
        # load alone, which an engine start (the slow part on CPU) must not eat into. A
        # replacement that hangs in its start stops the run (no restart of a restart).
        try:
            self._wait(i, self.workers[i].version.remote(), START, "its start")
        except Hung as hang:
            raise WorkerRestartsExhausted(
                f"the replacement of rollout worker {i} {hang.detail}") from None
        self._note_process(i)

    def _restart_count(self) -> str:
        return f"restart {self.restarts}/{self.cfg.faults.max_worker_restarts}"

    def kill_all(self) -> None:
        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.workers = []


def process_gone(pid: int) -> bool:
    """Whether process `pid` of this machine has exited (a zombie has: its memory, GPU
    contexts included, is released at exit; only its entry waits to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True


def _poll_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not process_gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def wait_gone(node_id: str, pid: int, timeout_s: float) -> bool:
    """Wait until process `pid` of Ray node `node_id` has exited, at most `timeout_s`: here
    when it is this process's node, else from a small task placed on that node. True when it
    is gone."""
    if node_id == ray.get_runtime_context().get_node_id():
        return _poll_gone(pid, timeout_s)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0)(_poll_gone).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
    try:
        return ray.get(task.remote(pid, timeout_s), timeout=timeout_s + 30)
    except (GetTimeoutError, RayError):
        return False
