"""Scoring in worker processes, so that no scorer can take the run down.

Each item runs in a worker process under a wall-clock deadline and an address-space limit.
Whatever the scorer does (raise, hang, allocate without bound, kill its process, return None,
NaN, inf or a non-number) the item gets reward 0.0 and a failure kind, counted in
`failure_counts`; a hung worker is SIGKILLed and a dead one replaced. `score` itself raises
`ScoringPoolError` only when the pool's own machinery fails (a process or pipe cannot be
made); any other exception from it is the caller's mistake (see `score`).

Why not `concurrent.futures.ProcessPoolExecutor`: it cannot kill one hung task, and one dead
worker breaks the whole executor (BrokenProcessPool). Workers are started with "spawn", which
is safe whatever threads the parent runs (Ray, torch, vLLM) and behaves the same everywhere.
"""
from __future__ import annotations

import math
import multiprocessing
import numbers
import os
import pickle
import signal
import threading
import time
from collections import Counter, deque
from collections.abc import Sequence
from multiprocessing.connection import wait
from typing import Any

from rewards.records import Problem, Scorer, ScoreResult

LOAD_TIMEOUT_S = 60.0  # worker start-up plus importing the scorer's module (sympy: seconds)
# Items sent to a worker in one message. Their replies (a few hundred bytes each) must fit in
# the pipe's buffer (64 KiB on Linux), so that a worker never blocks on a parent that is busy.
MAX_CHUNK = 64
_DETAIL_CHARS = 300
# Thread pools (BLAS, OpenMP) reserve address space per thread; keep workers single-threaded
# so the address-space limit measures what the scorer allocates.
_SINGLE_THREAD_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


class ScoringPoolError(RuntimeError):
    """The pool itself could not score the batch: starting a worker process or using a pipe
    failed at the OS level (no item was scored by a scorer that failed; that is a per-item
    failure, never raised)."""


class ScoringPool:
    """A pool of scoring worker processes with a per-item timeout and memory limit.

        with ScoringPool(workers=2, timeout_s=5.0, max_memory_mb=1024) as pool:
            results = pool.score(task.scorer, problems, completions)  # list[ScoreResult]

    workers: processes scoring in parallel.
    timeout_s: wall-clock limit for one item; past it the worker is killed ("timeout").
    max_memory_mb: address space one item may allocate beyond what its worker already holds
        (RLIMIT_AS; "memory" when exceeded). A worker that keeps more than this after an item
        (a leaking scorer) is retired and replaced.

    The scorer must be picklable by reference (a module-level function) and importable in a
    fresh interpreter; see `rewards.load_scorer`. Workers are daemonic, so a scorer cannot
    start processes of its own. `score` is serialised by a lock (one batch at a time).
    """

    def __init__(self, workers: int = 2, timeout_s: float = 5.0, max_memory_mb: int = 1024):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if max_memory_mb < 1:
            raise ValueError(f"max_memory_mb must be >= 1, got {max_memory_mb}")
        self.timeout_s = float(timeout_s)
        self.max_memory_mb = int(max_memory_mb)
        self._context = multiprocessing.get_context("spawn")
        self._failures: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._closed = False
        self._workers = [self._start_worker() for _ in range(workers)]

    @property
    def failure_counts(self) -> dict[str, int]:
        """Failures by kind since the pool was made (cumulative)."""
        return dict(self._failures)

    def score(self, scorer: Scorer, problems: Sequence[Problem],
              completions: Sequence[str]) -> list[ScoreResult]:
        """Score `completions[i]` against `problems[i]`; results in input order.

        Raises ScoringPoolError when the pool's processes or pipes fail; TypeError for a
        scorer that cannot be sent to the workers, ValueError for mismatched lengths and
        RuntimeError for a closed pool (the caller's mistakes)."""
        if len(problems) != len(completions):
            raise ValueError(f"{len(problems)} problems but {len(completions)} completions")
        try:
            scorer_blob = pickle.dumps(scorer)
        except Exception as e:
            raise TypeError(f"scorer {scorer!r} cannot be sent to scoring workers (use a "
                            f"module-level function): {e}") from e
        with self._lock:
            if self._closed:
                raise RuntimeError("ScoringPool is closed")
            try:
                results = self._run(scorer_blob, list(problems), list(completions))
            except OSError as e:  # fork/spawn, a pipe or wait() failed: the pool, not a scorer
                self._drop_unfinished()
                raise ScoringPoolError(f"the scoring pool failed: {_describe(e)}") from e
        self._failures.update(r.failure for r in results if r.failure is not None)
        return results

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for worker in self._workers:
            worker.stop()
        self._workers = []

    def __enter__(self) -> ScoringPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # ------------------------------------------------------------------ scheduling

    def _start_worker(self) -> _Worker:
        return _Worker(self._context, self.max_memory_mb)

    def _replace(self, worker: _Worker) -> None:
        worker.kill()  # hung, dead or retiring: nothing to wait for
        self._workers[self._workers.index(worker)] = self._start_worker()

    def _drop_unfinished(self) -> None:
        """After a failed batch: replace the workers still holding its items, so that the
        next batch starts clean (best effort: one that cannot be replaced now is replaced
        when sending to it fails)."""
        for worker in list(self._workers):
            if worker.items:
                worker.items.clear()
                try:
                    self._replace(worker)
                except OSError:
                    pass

    def _run(self, scorer_blob: bytes, problems: list[Problem],
             completions: list[str]) -> list[ScoreResult]:
        results: list[ScoreResult | None] = [None] * len(problems)
        todo = deque(range(len(problems)))

        def finish(worker: _Worker, result: ScoreResult) -> None:
            """`result` for the worker's current item; the next one's clock starts now."""
            results[worker.items.popleft()] = result
            worker.deadline = time.monotonic() + self.timeout_s if worker.items else None

        def replace(worker: _Worker, failure: ScoreResult | None = None) -> None:
            """Replace `worker`: its current item gets `failure` (when given), the items sent
            after it go back to the front of the queue."""
            if failure is not None:
                finish(worker, failure)
            todo.extendleft(reversed(worker.items))
            worker.items.clear()
            self._replace(worker)

        def send(worker: _Worker, message: tuple, limit_s: float) -> None:
            try:
                worker.send(message, limit_s)
            except (OSError, ValueError):  # the idle worker had died (e.g. OOM killer)
                replace(worker, _failure("crash", "scoring worker died before the item"))

        def send_chunk(worker: _Worker) -> None:
            chunk = [(problems[i], completions[i]) for i in worker.items]
            send(worker, ("score", scorer_blob, chunk), self.timeout_s)

        def dispatch(worker: _Worker) -> None:
            # Chunks, not single items: one message per item each way costs more than the
            # scoring itself for cheap scorers. Items are scored in order, each under its own
            # deadline (restarted as each result arrives), so the per-item limits still hold.
            idle = sum(1 for w in self._workers if not w.items)
            size = max(1, min(MAX_CHUNK, -(-len(todo) // max(1, idle))))
            worker.items.extend(todo.popleft() for _ in range(min(size, len(todo))))
            if scorer_blob in worker.loaded:
                send_chunk(worker)
            else:
                send(worker, ("load", scorer_blob), max(LOAD_TIMEOUT_S, self.timeout_s))

        while todo or any(w.items for w in self._workers):
            for worker in list(self._workers):
                if not worker.items and todo:
                    dispatch(worker)
            busy = [w for w in self._workers if w.items]
            if not busy:
                continue
            next_deadline = min(w.deadline for w in busy)
            wait([w.conn for w in busy] + [w.process.sentinel for w in busy],
                 timeout=max(0.0, next_deadline - time.monotonic()))
            for worker in busy:
                # Poll rather than trust wait()'s answer: a reply that arrived while this loop
                # was replacing another worker is a result, not a timeout.
                while worker.items and (worker.conn.poll() or not worker.process.is_alive()):
                    if not self._collect(worker, scorer_blob, finish, replace, send_chunk):
                        break
                if worker.items and time.monotonic() >= worker.deadline:
                    phase = "loading the scorer" if worker.loading else "scoring"
                    limit = LOAD_TIMEOUT_S if worker.loading else self.timeout_s
                    replace(worker, _failure("timeout", f"{phase} took over {limit:g} s"))
        return [r if r is not None else _failure("crash", "lost") for r in results]

    def _collect(self, worker: _Worker, scorer_blob: bytes, finish, replace, send_chunk) -> bool:
        """Handle one message of a worker whose pipe is readable or whose process has ended.
        Returns False when the worker was replaced (its remaining items went back to the queue)."""
        try:
            if not worker.conn.poll():
                raise EOFError
            message = worker.conn.recv()
        except (EOFError, OSError):
            worker.process.join(timeout=1.0)
            code = worker.process.exitcode
            replace(worker, _failure("crash", f"scoring worker died (exit code {code})"))
            return False
        kind = message[0]
        if kind == "loaded":
            worker.loaded.add(scorer_blob)
            send_chunk(worker)
        elif kind == "load_failed":
            while worker.items:  # every item of the chunk needs the scorer
                finish(worker, _failure("exception", f"cannot load the scorer: {message[1]}"))
        else:  # "scored"
            _, reward, failure, detail, retire = message
            finish(worker, ScoreResult(reward=reward, failure=failure, detail=detail))
            if retire:  # it exits without reading the rest of its chunk
                replace(worker)
                return False
        return True


class _Worker:
    """Parent-side handle of one worker process and the item it is working on."""

    def __init__(self, context: Any, max_memory_mb: int):
        self.conn, child_conn = context.Pipe(duplex=True)
        self.process = context.Process(target=_worker_main, args=(child_conn, max_memory_mb),
                                       daemon=True, name="klrl-scorer")
        self.process.start()
        child_conn.close()
        self.loaded: set[bytes] = set()  # pickled scorers this worker has imported
        self.items: deque[int] = deque()   # sent to it, not yet answered; the first is running
        self.deadline: float | None = None  # of the first item
        self.loading = False

    def send(self, message: tuple, limit_s: float) -> None:
        self.loading = message[0] == "load"
        self.deadline = time.monotonic() + limit_s
        self.conn.send(message)

    def stop(self) -> None:
        """Ask an idle worker to exit, then make sure it has."""
        if self.process.is_alive() and not self.items:
            try:
                self.conn.send(None)
                self.process.join(timeout=1.0)
            except (OSError, ValueError):
                pass
        self.kill()

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5.0)
        self.conn.close()
        if self.process.exitcode is not None:
            self.process.close()  # release its file descriptors now, not at garbage collection


# ---------------------------------------------------------------------- worker process


def _worker_main(conn: Any, max_memory_mb: int) -> None:
    """Serve ("load", scorer_blob) and ("score", scorer_blob, [(problem, completion), ...])
    until None: one ("scored", ...) reply per item, in order, as each is done."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    for name in _SINGLE_THREAD_ENV:
        os.environ[name] = "1"
    scorers: dict[bytes, Scorer] = {}
    budget = max_memory_mb * 1024 * 1024
    baseline = _address_space()
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        if message[0] == "load":
            try:
                scorers[message[1]] = pickle.loads(message[1])
                conn.send(("loaded",))
            except BaseException as e:  # noqa: BLE001 - any failure to import is reported
                conn.send(("load_failed", _describe(e)))
            baseline = max(baseline, _address_space())  # imports are not a leak
            continue
        _, blob, chunk = message
        current = _address_space()
        for problem, completion in chunk:
            reward, failure, detail = _score_limited(scorers[blob], completion, problem, budget,
                                                     current)
            current = _address_space()  # reading it costs more than most scorers: once per item
            retire = current > baseline + budget  # the scorer keeps what it allocated
            conn.send(("scored", reward, failure, detail, retire))
            if retire:
                return


def _score_limited(scorer: Scorer, completion: str, problem: Problem, budget: int,
                   current: int) -> tuple[float, str | None, str | None]:
    """Run the scorer under an address-space limit of (current + budget) bytes, `current`
    being this process's address space now."""
    limited = current > 0 and _set_address_limit(current + budget)
    try:
        value = scorer(completion, problem)
    except MemoryError as e:
        return 0.0, "memory", _describe(e)
    except BaseException as e:  # noqa: BLE001 - SystemExit from a scorer is a failure too
        return 0.0, "exception", _describe(e)
    finally:
        if limited:
            _set_address_limit(None)
    return _as_reward(value)


def _as_reward(value: Any) -> tuple[float, str | None, str | None]:
    """A finite float, or an "invalid_value" failure. bool and numpy/torch scalars count."""
    if not isinstance(value, numbers.Real) and not (
        hasattr(type(value), "__float__") and getattr(value, "ndim", 0) == 0
        and not isinstance(value, (str, bytes))
    ):
        return 0.0, "invalid_value", f"scorer returned {type(value).__name__}, not a number"
    try:
        reward = float(value)
    except Exception as e:  # noqa: BLE001 - e.g. an int too large for a float
        return 0.0, "invalid_value", _describe(e)
    if not math.isfinite(reward):
        return 0.0, "invalid_value", f"scorer returned {reward}"
    return reward, None, None


def _address_space() -> int:
    """This process's virtual memory size in bytes (0 where /proc is unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def _set_address_limit(limit: int | None) -> bool:
    """Set the soft RLIMIT_AS (None: back to the hard limit). False where unsupported."""
    try:
        import resource
    except ImportError:  # not on POSIX: the timeout still bounds the scorer
        return False
    try:
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        if limit is None:
            soft = hard
        else:
            soft = limit if hard == resource.RLIM_INFINITY else min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        return True
    except (ValueError, OSError):
        return False


def _describe(e: BaseException) -> str:
    try:
        text = f"{type(e).__name__}: {e}"
    except Exception:  # noqa: BLE001 - a hostile __str__
        text = type(e).__name__
    return text[:_DETAIL_CHARS]


def _failure(kind: str, detail: str) -> ScoreResult:
    return ScoreResult(reward=0.0, failure=kind, detail=detail)
