"""`klrl bench`: throughput against the raw engines and the ideal (see cluster/bench/run.py)."""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path


def run(args) -> int:
    # Ray, torch, vLLM and DeepSpeed: loaded when the benchmark runs, not at `klrl --help`.
    from cluster.bench.run import FULL, QUICK, check_result, print_tables, run_bench, write_json

    plan = QUICK if args.quick else FULL
    if args.work_dir:
        result = run_bench(plan, Path(args.work_dir))
    else:
        with tempfile.TemporaryDirectory(prefix="klrl-bench-") as tmp:
            result = run_bench(plan, Path(tmp))
    print_tables(result)
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}")
    bad = check_result(result)
    if bad:
        print(f"error: figures missing or not positive: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="measure overheads against raw vLLM/DeepSpeed, "
                              "weight-sync latency and async overlap efficiency",
                              description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--json", default=None, metavar="PATH", help="also write every figure as JSON here")
    p.add_argument("--quick", action="store_true", help="tiny model and batch, one repetition each "
                   "(about a minute; checks the machinery, the figures are noisy)")
    p.add_argument("--work-dir", default=None, metavar="DIR", help="keep the models and run "
                   "directories here (default: a temporary directory, deleted afterwards)")
    p.set_defaults(func=run)
