"""`make gpu-smoke`: the GPU verdict in one lent window, as steps against a hard deadline
(cluster/bench/smoke.py runs them; docs/gpu.md, "The smoke run", says what each checks).

Two windows, each one call of at most 10 minutes after the payload's upload calls:
- `verdict` (the first window, most valuable first): unpack and precompile the payload, then
  sanity (versions; the attention backend and model runner vLLM picks for fp32 and bf16),
  the in-flight GPU test (which asserts Model Runner V2 ran), a short demo run in batch mode
  at max_lag 0 over cuda_ipc, a short in-flight demo at max_lag 2 with long responses, the
  cheap-output-path test, the TF32 probe (fp32 engine log-probs against HF fp32, with and
  without exact fp32 Triton dots), then the other gpu-marked tests in the time left;
- `perf` (the second window): unpack, then `klrl bench --device cuda`'s parts on the
  0.5B-shaped headline (end to end, engines, weight sync), each as `gpu_check --part` runs it.

Each step's cap is a guess until a window has run it (then read its `seconds` in the
results): the caps bound a step, the deadline bounds the call. With `--steps-file` the driver
runs a list of one's own instead (the tests use that with stand-in commands).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from cluster.bench.smoke import REPO_ROOT, Smoke, Step, exit_code, read_steps

DEFAULT_DEADLINE_S = 540  # a 600-s call: the driver's own start and the last pack around it
PY = sys.executable
PAYLOAD = ("bash", "cluster/bench/gpu_payload.sh", "unpack")
# The gpu-marked tests the first steps run on their own; the last step runs the others.
FIRST_TESTS = ("tests/test_in_flight_gpu.py", "tests/test_outputs.py")
OTHER_TESTS = ("tests/test_own_model.py", "tests/test_weight_sync.py",
               "tests/test_ipc_transfer.py", "tests/test_bench_gpu.py",
               "tests/test_learner_ranks.py", "tests/test_engine_options.py")


def pytest_step(name: str, what: str, files: tuple[str, ...], cap_s: float,
                min_s: float = 60) -> Step:
    """The gpu-marked tests of `files`, verbose (a killed run keeps its finished tests'
    outcomes in the log) with a JUnit report (every test's duration)."""
    return Step(name, what, (PY, "-m", "pytest", "-v", "-rs", "-m", "gpu", "-p",
                             "no:cacheprovider", "--junitxml={junit}", *files),
                cap_s=cap_s, min_s=min_s, needs_cuda=True, junit=True)


def probe(name: str, what: str, args: tuple[str, ...], cap_s: float, min_s: float) -> Step:
    return Step(name, what, (PY, "-m", "cluster.bench.gpu_probe", *args), cap_s=cap_s,
                min_s=min_s, needs_cuda=True)


UNPACK = Step("unpack", "the payload's chunks checked and unpacked, installed through a .pth "
              "file, byte-compiled (compileall) with the checkout", PAYLOAD, cap_s=150, min_s=30)

VERDICT = (
    UNPACK,
    probe("sanity", "versions, CUDA, FA3; the attention backend and model runner of an fp32 "
          "and a bf16 engine", ("sanity",), cap_s=150, min_s=60),
    pytest_step("in_flight_test", "an update lands in flight on Model Runner V2; every token "
                "keeps its version's log-prob", FIRST_TESTS[:1], cap_s=180),
    probe("demo_batch_lag0", "the demo model, batch mode, cuda_ipc, max_lag 0: start order, "
          "prefix-cache resets across syncs, fp32 default, log-ratio maxima",
          ("demo", "batch_lag0"), cap_s=180, min_s=90),
    probe("demo_in_flight_lag2", "in-flight updates at max_lag 2 with long responses: "
          "multi-version share > 0, preemptions, the lag bound",
          ("demo", "in_flight_lag2"), cap_s=180, min_s=90),
    pytest_step("cheap_output_test", "the rollout's cheap output path (flat log-probs, texts "
                "decoded by the worker) against vLLM's default", FIRST_TESTS[1:], cap_s=120),
    probe("tf32_probe", "fp32 engine log-probs against HF fp32, Triton dots in TF32 and in "
          "IEEE fp32", ("tf32",), cap_s=150, min_s=60),
    pytest_step("other_gpu_tests", "the other gpu-marked tests, most informative first",
                OTHER_TESTS, cap_s=600),
)

PERF = (UNPACK, *(
    Step(f"bench_{part}", what,
         (PY, "-m", "cluster.bench.gpu_check", "--part", part, "--json", "{work}/gpu-check.json",
          "--work-dir", "{work}/bench", "--seconds", "{timeout}"),
         cap_s=cap, min_s=min_s, needs_cuda=True)
    for part, what, cap, min_s in (
        ("e2e", "the 0.5B-shaped headline end to end at max_lag 0, 2 and 2 in flight", 330, 200),
        ("engines", "its rollout against raw vLLM and the floor, its learner against bare "
         "DeepSpeed, the rollout's cost outside the engine", 300, 150),
        ("sync", "its weight sync per transport against a device-to-device copy", 150, 90),
    )))

WINDOWS = {"verdict": VERDICT, "perf": PERF}


def cuda_missing() -> str | None:
    """Why there is no CUDA GPU, asked of a fresh interpreter: the payload this process
    started before may have brought the torch CUDA needs, and torch is imported only there."""
    code = ("import torch; print(torch.cuda.is_available() and 'yes' or "
            "'torch %s sees no CUDA GPU' % torch.__version__)")
    try:
        out = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=120,
                             cwd=REPO_ROOT)
    except (OSError, subprocess.SubprocessError) as e:
        return f"could not ask torch ({type(e).__name__})"
    last = (out.stdout.strip().splitlines() or [""])[-1]
    if out.returncode != 0:
        return f"torch does not import: {(out.stderr.strip().splitlines() or ['?'])[-1]}"
    return None if last == "yes" else last


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.bench.gpu_smoke",
                                     description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--window", choices=sorted(WINDOWS), default="verdict",
                        help="which window's steps (default: verdict)")
    parser.add_argument("--steps-file", type=Path, default=None,
                        help="run the steps of this JSON list instead (smoke.Step's fields)")
    parser.add_argument("--deadline-s", type=float, default=DEFAULT_DEADLINE_S,
                        help="seconds from the start to the last record; keep it below the "
                        "call's own limit")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-smoke-out")),
                        help="results.jsonl and smoke-logs.tar.gz (default: $OUT)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/klrl-smoke"),
                        help="the logs, details, runs and models (packed into the archive)")
    parser.add_argument("--site", default=os.environ.get("SITE", "/tmp/site"),
                        help="where the payload is unpacked (its versions are read there)")
    args = parser.parse_args(argv)
    steps = read_steps(args.steps_file) if args.steps_file else WINDOWS[args.window]
    window = args.steps_file.stem if args.steps_file else args.window
    smoke = Smoke(steps, args.out, args.work, args.deadline_s, window=window,
                  cuda_missing=cuda_missing, site=args.site)
    records = smoke.run()
    code = exit_code(records)
    print(f"[smoke] {len(records)} steps; {args.out / 'results.jsonl'}; exit {code}")
    return code


if __name__ == "__main__":
    sys.exit(main())
