"""`make gpu-check`: klrl's GPU check as one command that stops itself within a time budget.

A lent GPU machine comes for a bounded window (docs/gpu.md: 15 minutes there, start-up and
uploads included, at most 10 minutes a call), so the check runs its parts most informative
first and starts a part only where its estimated length fits in what is left of the budget
(default `DEFAULT_BUDGET_S`, 8 minutes); a part still running at the end of the budget is
stopped with everything it started. The JSON is written after every part (each part merges
its `klrl bench` sections into it as `klrl bench --only` does), so whatever ran survives a
killed call, and its `gpu_check` record says what each part did. Run again with that JSON
(another call, another window) and the check goes on with the parts not yet run: a part that
passed or failed is not run again, one stopped at the budget or not started is.

The parts (`PARTS`), each `klrl bench --device cuda` on the GPU plan's headline workload (the
random model of Qwen2.5-0.5B's shape) but the tests:
- tests: the gpu-marked tests, in `gpu.GPU_TEST_ORDER` (in-flight updates on a GPU first);
- e2e: end to end at max_lag 0 and 2, and 2 with in-flight updates (the bench then says
  whether anything was in flight);
- engines: the rollout against raw vLLM and against the floor without log-probs, the learner
  against bare DeepSpeed, and the 256 x 64 rollout's cost outside the engine (demo model);
- sync: weight sync per transport, cuda_ipc included, per GB against a device-to-device copy.
Each runs in a process of its own (`python -m cluster.bench.gpu_check --part NAME`), in a
process session of its own, so that stopping it stops its Ray cluster and engines too.

The estimates (`CheckPart.estimate_s`) are ESTIMATES for one H100, made from the steps' times
of the GPU runs at fe1eb56 and cc124fa (an engine's start about 45 s, a training run's start
about 100 s, the 0.5B-shaped model's steps 2.6-6 s); no GPU has run this check yet. A part
stopped at the budget is estimated again at its stopped length plus a quarter.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.bench.results import read_json, write_json

DEFAULT_BUDGET_S = 480
# Kept back from the budget for the stopped part's clean-up (SIGTERM, 15 s, SIGKILL) and the
# last write of the JSON.
MARGIN_S = 30
FINISHED = ("passed", "failed")  # a part in either state is not run again
STOPPED_EXIT = 75  # a part's process: it stopped itself at its time (the tests) and wrote it


@dataclass(frozen=True)
class CheckPart:
    """One part of the check: `bench_part` of `klrl bench --device cuda` on a slice of the GPU
    plan (`plan_for`), with the seconds it is estimated to take on one H100 (module
    docstring: an estimate)."""

    name: str
    what: str
    estimate_s: int
    bench_part: str


PARTS = (
    CheckPart("tests", "the gpu-marked tests, in-flight updates on a GPU first", 390, "tests"),
    CheckPart("e2e", "the headline end to end at max_lag 0, 2 and 2 in flight", 450, "e2e"),
    CheckPart("engines", "the headline's rollout against raw vLLM and the no-log-prob floor, "
              "its learner against bare DeepSpeed, the rollout's cost outside the engine",
              330, "engines"),
    CheckPart("sync", "weight sync of the headline per transport (cuda_ipc included) against "
              "a device-to-device copy", 150, "sync"),
)


def part_named(name: str) -> CheckPart:
    found = [p for p in PARTS if p.name == name]
    if not found:
        raise ValueError(f"no check part {name!r}: {', '.join(p.name for p in PARTS)}")
    return found[0]


def plan_for(part: CheckPart, plan):
    """The slice of the GPU bench plan `plan` that `part` measures: its headline workload
    alone (the 256 x 64 outside-engine rollout with the engines), none for the tests."""
    if part.bench_part == "tests":
        return dataclasses.replace(plan, workloads=(), outside=None)
    head = tuple(w for w in plan.workloads if w.name == plan.headline)
    outside = plan.outside if part.bench_part == "engines" else None
    return dataclasses.replace(plan, workloads=head, outside=outside)


def needed_s(part: CheckPart, before: dict[str, Any]) -> float:
    """How long `part` is expected to take, given its record from earlier calls: its
    estimate, or a quarter more than it ran before it was once stopped at a budget."""
    return max(part.estimate_s, 1.25 * before.get("stopped_after_s", 0))


# --------------------------------------------------------------------------- the runner


def run_check(json_path: Path, budget_s: float, run_part: Callable[[CheckPart, float], int | None],
              clock: Callable[[], float] = time.monotonic) -> dict[str, Any]:
    """Run the parts not yet finished in `json_path`'s record, in `PARTS` order, within
    `budget_s`; write the JSON (the parts' sections and the record) after every part.
    `run_part(part, seconds)` runs one part for at most that long and returns its exit code,
    None where it was stopped (`STOPPED_EXIT` where it stopped itself). Returns the
    record."""
    start = clock()
    result = read_json(json_path) if json_path.is_file() else {"device": "cuda"}
    record = result.get("gpu_check") or {"parts": {}, "calls": []}
    call: dict[str, Any] = {"started_at": time.strftime("%Y-%m-%d %H:%M:%S"),
                            "budget_s": budget_s, "ran": []}
    record["calls"].append(call)

    def save() -> None:
        latest = read_json(json_path) if json_path.is_file() else {"device": "cuda"}
        write_json(latest | {"gpu_check": record}, json_path)

    for part in PARTS:
        before = record["parts"].get(part.name, {})
        if before.get("status") in FINISHED:
            continue
        left = budget_s - (clock() - start) - MARGIN_S
        need = needed_s(part, before)
        if need > left:
            record["parts"][part.name] = {
                **{k: v for k, v in before.items() if k == "stopped_after_s"},
                "status": "not started",
                "why": f"needs about {need:.0f} s, {max(left, 0):.0f} s of the budget left",
                "estimate_s": part.estimate_s}
            save()
            continue
        print(f"[gpu-check] {part.name}: {part.what} (about {need:.0f} s, {left:.0f} s left)",
              flush=True)
        # what a call killed from outside leaves: the part it was in (run again next time)
        record["parts"][part.name] = {**{k: v for k, v in before.items()
                                         if k == "stopped_after_s"},
                                      "status": "running", "estimate_s": part.estimate_s}
        save()
        t0 = clock()
        code = run_part(part, left)
        seconds = clock() - t0
        stopped = code in (None, STOPPED_EXIT)
        status = "stopped" if stopped else "passed" if code == 0 else "failed"
        record["parts"][part.name] = {"status": status, "seconds": round(seconds, 1),
                                      "returncode": code, "estimate_s": part.estimate_s}
        if stopped or "stopped_after_s" in before:
            record["parts"][part.name]["stopped_after_s"] = round(
                max(seconds if stopped else 0, before.get("stopped_after_s", 0)), 1)
        call["ran"].append(part.name)
        print(f"[gpu-check] {part.name}: {status} in {seconds:.0f} s", flush=True)
        save()
    save()
    return record


def remaining(record: dict[str, Any]) -> list[str]:
    """The parts a later call still has to run."""
    return [p.name for p in PARTS
            if record["parts"].get(p.name, {}).get("status") not in FINISHED]


def child_part_runner(json_path: Path, work_dir: Path, log_path: Path | None,
                      python: str = sys.executable) -> Callable[[CheckPart, float], int | None]:
    """`run_part` for `run_check`: each part in a process session of its own
    (`python -m cluster.bench.gpu_check --part NAME`), its output appended to `log_path`
    (or this process's), stopped with everything it started at its time."""
    from cluster.bench.gpu import run_bounded
    from cluster.config.loader import REPO_ROOT

    def run(part: CheckPart, seconds: float) -> int | None:
        command = [python, "-m", "cluster.bench.gpu_check", "--part", part.name,
                   "--json", str(json_path), "--work-dir", str(work_dir),
                   "--seconds", str(int(seconds))]
        if log_path is None:
            code, out = run_bounded(command, seconds, cwd=REPO_ROOT)
            print(out, end="", flush=True)
            return code
        with open(log_path, "a") as log:
            log.write(f"\n===== {part.name} ({time.strftime('%H:%M:%S')}) =====\n")
            log.flush()
            return run_bounded(command, seconds, cwd=REPO_ROOT, log=log)[0]

    return run


def measure_part(part: CheckPart, json_path: Path, work_dir: Path, seconds: float) -> int:
    """One part, in the process `child_part_runner` starts: its bench sections merged into
    `json_path`; exit 1 where a figure it measures is missing or a test failed,
    `STOPPED_EXIT` where the tests were stopped at their time (a later call runs them again)."""
    from cluster.bench.results import check_result, merge
    from cluster.bench.run import FULL, gpu_plan, run_bench

    plan = plan_for(part, gpu_plan(FULL))
    # the tests stop themselves before this process is stopped, to record what they did
    result = run_bench(plan, work_dir, (part.bench_part,),
                       tests_timeout_s=max(60.0, seconds - MARGIN_S))
    merged = merge(read_json(json_path), result) if json_path.is_file() else result
    write_json(merged, json_path)
    if (result.get("gpu_tests") or {}).get("timed_out"):
        return STOPPED_EXIT
    bad = check_result(result)
    if bad:
        print(f"[gpu-check] {part.name}: missing, failed or not positive: {', '.join(bad)}",
              file=sys.stderr)
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.bench.gpu_check",
                                     description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--json", default="gpu-check.json", type=Path,
                        help="the check's JSON: read to go on where an earlier call stopped, "
                        "written after every part (delete it to start afresh)")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help="seconds this call may take; keep it below the call's own limit")
    parser.add_argument("--log", type=Path, default=None,
                        help="append every part's output to this file (default: print it)")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/klrl-gpu-check"),
                        help="the random models and runs (kept: a later part reuses them)")
    parser.add_argument("--part", default=None, help=argparse.SUPPRESS)  # the child's
    parser.add_argument("--seconds", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    from cluster.bench.gpu import cuda_missing

    missing = cuda_missing()
    if missing:
        print(f"error: the GPU check needs a CUDA GPU: {missing}", file=sys.stderr)
        return 2
    if args.part is not None:
        return measure_part(part_named(args.part), args.json, args.work_dir, args.seconds)
    record = run_check(args.json, args.budget_s,
                       child_part_runner(args.json, args.work_dir, args.log))
    left = remaining(record)
    failed = [n for n, r in record["parts"].items() if r["status"] == "failed"]
    print(f"[gpu-check] wrote {args.json}; failed: {', '.join(failed) or 'none'}; still to "
          f"run: {', '.join(left) or 'none'}" + (" (run again with this JSON)" if left else ""))
    return 1 if failed else 3 if left else 0


if __name__ == "__main__":
    sys.exit(main())
