"""`python -m cluster.cli.final_eval RUN_DIR ... --problems N --seed S [--sets A,B] [--base]`:
the final checkpoint's evaluation of each run (cluster/sweeps/final_eval.py), one process per
call as `make results` runs it."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cluster.sweeps import final_eval


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cluster.cli.final_eval",
                                description=final_eval.__doc__.split("\n\n")[0])
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--problems", type=int, required=True, help="problems per evaluation set")
    p.add_argument("--seed", type=int, required=True, help="seed of the problems")
    p.add_argument("--sets", default="in_domain,out_of_domain",
                   help="comma-separated evaluation sets (default in_domain,out_of_domain)")
    p.add_argument("--base", action="store_true", help="then also the model the first run "
                   "started from, into its sweep directory's base_eval.json")
    args = p.parse_args(argv)
    final_eval.evaluate_runs([Path(d) for d in args.run_dirs], args.problems, args.seed,
                             [s for s in args.sets.split(",") if s], base=args.base)
    return 0


if __name__ == "__main__":
    sys.exit(main())
