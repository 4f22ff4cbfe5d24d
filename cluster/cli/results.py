"""`make results SWEEP=FILE [ARGS=...]` (`python -m cluster.cli.results`): its arguments; the
steps are cluster/sweeps/results.py's."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cluster.sweeps import results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="make results SWEEP=FILE",
                                description=results.__doc__.split("\n\n")[0])
    p.add_argument("sweep", metavar="SWEEP_FILE")
    p.add_argument("overrides", nargs="*", help="sweep file overrides, as for `klrl sweep` "
                   "(e.g. output_dir=/root/klrl-confirm)")
    p.add_argument("--keep", default=None, metavar="DIR", help="keep each finished run's "
                   "records (not its weights) in DIR as soon as it is evaluated, and put the "
                   "runs kept there back into the sweep directory before the sweep starts: a "
                   "sweep that outlives its machine goes on where it stopped on the next one "
                   "(one run at a time; cluster/sweeps/keep.py)")
    p.add_argument("--out", default=None, help="where the report goes (default "
                   "docs/sweeps/<sweep name>)")
    args = p.parse_args(argv)
    return results.make_results(args.sweep, args.overrides,
                                keep=Path(args.keep) if args.keep else None,
                                out=Path(args.out) if args.out else None)


if __name__ == "__main__":
    sys.exit(main())
