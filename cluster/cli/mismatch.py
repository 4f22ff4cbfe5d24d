"""`python -m cluster.cli.mismatch SWEEP_FILE [key=value ...] [--out DIR] [--no-runs]`: the
learner/sampler mismatch table of a sweep (cluster/sweeps/mismatch.py)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cluster.sweeps import mismatch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=mismatch.COMMAND,
                                description=mismatch.__doc__.split("\n\n")[0])
    p.add_argument("sweep", metavar="SWEEP_FILE")
    p.add_argument("overrides", nargs="*", help="sweep file overrides (e.g. output_dir=DIR)")
    p.add_argument("--out", default=None, help="where mismatch.md goes (default "
                   "docs/sweeps/<sweep name>)")
    p.add_argument("--no-runs", action="store_true", help="tabulate the runs there are; run none")
    args = p.parse_args(argv)
    return mismatch.write_mismatch(args.sweep, args.overrides,
                                   out=Path(args.out) if args.out else None,
                                   run=not args.no_runs)


if __name__ == "__main__":
    sys.exit(main())
