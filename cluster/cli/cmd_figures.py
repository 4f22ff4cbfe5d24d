"""`klrl figures` (`make figures`): regenerate the docs' figures about the embedded model and
the CPU demo on this machine (see cluster/experiments/figures.py)."""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from cluster.experiments.figures import BLOCKS, regenerate


def _seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated integers, got {text!r}") from None
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise argparse.ArgumentTypeError(f"distinct non-negative seeds, got {text!r}")
    return seeds


def _blocks(text: str) -> list[str]:
    blocks = [b.strip() for b in text.split(",") if b.strip()]
    unknown = sorted(set(blocks) - set(BLOCKS))
    if not blocks or unknown:
        raise argparse.ArgumentTypeError(f"choose from {', '.join(BLOCKS)}; got {text!r}")
    return blocks


def run(args) -> int:
    if args.work_dir:
        regenerate(args.seeds, args.only, Path(args.work_dir))
    else:
        with tempfile.TemporaryDirectory(prefix="klrl-figures-") as tmp:
            regenerate(args.seeds, args.only, Path(tmp))
    print("docs/demo.md, docs/model.md, docs/lora.md and docs/figures/*.json updated")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "figures", help="rerun the demo and rewrite the docs' demo and model figures",
        description="Run `klrl demo` at max_lag 0 and 2 and plain GRPO at max_lag 0 for each "
        "seed (about 5 minutes each on 2 cores), read the embedded model's build figures, build "
        "the default model under four sets of CPU kernels (the spread block, no timing), and "
        "rewrite the docs blocks between <!-- figures:NAME --> markers and "
        "docs/figures/NAME.json with what this machine measured.")
    p.add_argument("--seeds", type=_seeds, default=[0, 1, 2], metavar="LIST",
                   help="comma-separated run seeds (default 0,1,2)")
    p.add_argument("--only", type=_blocks, default=list(BLOCKS), metavar="LIST",
                   help=f"blocks to regenerate, comma-separated, from {', '.join(BLOCKS)} "
                   "(default all)")
    p.add_argument("--work-dir", default=None, metavar="DIR",
                   help="keep the runs and their logs here (default: a temporary directory)")
    p.set_defaults(func=run)
