"""ScoringPool: no scorer can crash or hang the run. Real worker processes, real faults
(tests/scorer_faults.py), timings bounded."""
from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import scorer_faults

from rewards import Problem, ScoreResult, ScoringPool
from rewards.arithmetic import make_problem

PROBLEM = make_problem(1, "+", 2)
TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def pool():
    with ScoringPool(workers=2, timeout_s=TIMEOUT_S, max_memory_mb=256) as p:
        yield p


def score(pool, completions, scorer=scorer_faults.misbehave) -> list[ScoreResult]:
    return pool.score(scorer, [PROBLEM] * len(completions), completions)


def test_healthy_batch_in_order_without_failures(pool):
    completions = ["yes" if i % 3 else "no" for i in range(60)]
    before = pool.failure_counts
    results = score(pool, completions, scorer_faults.yes_scorer)
    assert [r.reward for r in results] == [1.0 if c == "yes" else 0.0 for c in completions]
    assert all(r.failure is None for r in results)
    assert pool.failure_counts == before
    assert score(pool, []) == []


def test_every_fault_in_one_batch_is_isolated_and_counted(pool):
    faults = {
        "raise": "exception", "raise_hostile": "exception", "system_exit": "exception",
        "recursion": "exception", "hang": "timeout", "spin": "timeout",
        "alloc_unbounded": "memory", "alloc_huge": "memory", "exit": "crash",
        "segfault": "crash", "value:none": "invalid_value", "value:nan": "invalid_value",
    }
    completions = []
    for fault in faults:  # a healthy item on each side of every fault
        completions += ["ok", fault]
    completions.append("ok")
    before = pool.failure_counts
    results = score(pool, completions)

    for completion, result in zip(completions, results):
        if completion == "ok":
            assert (result.reward, result.failure) == (1.0, None)
        else:
            assert (result.reward, result.failure) == (0.0, faults[completion]), (
                completion, result)
    assert "ZeroDivisionError" in results[1].detail
    after = pool.failure_counts
    for kind in set(faults.values()):
        assert after.get(kind, 0) - before.get(kind, 0) == list(faults.values()).count(kind)
    # The pool replaced its killed and dead workers and goes on.
    assert [r.reward for r in score(pool, ["ok"] * 4)] == [1.0] * 4


@pytest.mark.parametrize("key,reward,failure", [
    ("none", 0.0, "invalid_value"), ("nan", 0.0, "invalid_value"),
    ("inf", 0.0, "invalid_value"), ("-inf", 0.0, "invalid_value"),
    ("str", 0.0, "invalid_value"), ("list", 0.0, "invalid_value"),
    ("dict", 0.0, "invalid_value"), ("complex", 0.0, "invalid_value"),
    ("huge_int", 0.0, "invalid_value"), ("object", 0.0, "invalid_value"),
    ("true", 1.0, None), ("int", 3.0, None), ("fraction", 0.25, None),
    ("decimal", 0.5, None), ("float", 0.75, None),
])
def test_return_values(pool, key, reward, failure):
    (result,) = score(pool, [f"value:{key}"])
    assert (result.reward, result.failure) == (reward, failure)
    assert isinstance(result.reward, float)


def test_memory_limit_is_relative_to_budget(pool):
    ok, too_much = score(pool, ["alloc:100", "alloc:400"])  # budget: 256 MiB
    assert (ok.reward, ok.failure) == (100.0, None)
    assert (too_much.reward, too_much.failure) == (0.0, "memory")


def test_leaking_worker_is_retired_not_grown():
    with ScoringPool(workers=1, timeout_s=TIMEOUT_S, max_memory_mb=256) as pool:
        results = score(pool, ["leak:100"] * 6)
    assert all(r.failure is None for r in results)
    pids = [r.reward for r in results]
    # 100 MiB kept per call: a worker is retired once it holds more than its 256 MiB budget.
    assert len(set(pids)) >= 2
    assert max(pids.count(p) for p in set(pids)) <= 3


def test_scorer_that_cannot_be_imported_by_workers_fails_per_item():
    ghost = types.ModuleType("ghost_scorer_module")  # in this process only, not on disk
    exec("def score(completion, problem):\n    return 1.0", ghost.__dict__)
    sys.modules["ghost_scorer_module"] = ghost
    try:
        with ScoringPool(workers=1, timeout_s=TIMEOUT_S) as pool:
            results = pool.score(ghost.score, [PROBLEM] * 2, ["a", "b"])
            healthy = score(pool, ["ok"])
    finally:
        del sys.modules["ghost_scorer_module"]
    assert [(r.reward, r.failure) for r in results] == [(0.0, "exception")] * 2
    assert "cannot load the scorer" in results[0].detail
    assert pool.failure_counts == {"exception": 2}
    assert healthy[0].reward == 1.0


def test_misuse_is_a_clear_error(pool):
    with pytest.raises(TypeError, match="module-level function"):
        pool.score(lambda c, p: 1.0, [PROBLEM], ["x"])
    with pytest.raises(ValueError, match="2 problems but 1 completions"):
        pool.score(scorer_faults.misbehave, [PROBLEM] * 2, ["ok"])
    with pytest.raises(ValueError):
        ScoringPool(workers=0)
    with pytest.raises(ValueError):
        ScoringPool(timeout_s=0)


def test_closed_pool_refuses_work_and_close_is_idempotent():
    pool = ScoringPool(workers=2)
    pids = [w.process.pid for w in pool._workers]
    assert all(Path(f"/proc/{pid}").exists() for pid in pids)
    pool.close()
    pool.close()
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)  # exited and reaped
    with pytest.raises(RuntimeError, match="closed"):
        pool.score(scorer_faults.misbehave, [PROBLEM], ["ok"])


def test_results_carry_problems_of_any_task(pool):
    problems = [Problem(uid=f"u{i}", task="t", split="s", prompt="p", answer=str(i))
                for i in range(5)]
    results = pool.score(scorer_faults.misbehave, problems, ["ok"] * 5)
    assert [r.reward for r in results] == [1.0] * 5


def test_a_failure_of_the_pool_itself_is_its_own_error_and_the_pool_recovers(monkeypatch):
    """An OS-level failure of the pool's machinery (here: waiting on its pipes) raises
    ScoringPoolError, the one exception callers may turn into failed items; the next batch
    is scored normally."""
    import rewards.pool
    from rewards import ScoringPoolError

    with ScoringPool(workers=1, timeout_s=TIMEOUT_S) as pool:
        def broken_wait(*args, **kwargs):
            raise OSError(24, "Too many open files")

        monkeypatch.setattr(rewards.pool, "wait", broken_wait)
        with pytest.raises(ScoringPoolError, match="Too many open files"):
            score(pool, ["ok"] * 3)
        monkeypatch.undo()
        assert [r.reward for r in score(pool, ["ok"] * 3)] == [1.0] * 3
