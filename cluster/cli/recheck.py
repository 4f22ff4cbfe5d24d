"""`python -m cluster.cli.recheck DIR/runs.csv --preregistration FILE [--out FILE.md]`: a
committed report's runs.csv re-read under the current rules (cluster/analysis/recheck.py)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cluster.analysis import recheck


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=recheck.COMMAND,
                                description=recheck.__doc__.split("\n\n")[0])
    p.add_argument("csv", type=Path, help="a report's runs.csv")
    p.add_argument("--preregistration", required=True, help="the pre-registration it followed")
    p.add_argument("--sweep", default=None, help="its sweep (default: the CSV's directory name)")
    p.add_argument("--out", type=Path, default=None, help="write the markdown here")
    args = p.parse_args(argv)
    text = recheck.recheck_page(args.csv, args.preregistration, args.sweep, args.out)
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
