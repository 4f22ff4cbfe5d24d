"""`klrl figures` (`make figures`): regenerate the docs' figures about the embedded model and
the CPU demo on this machine (see cluster/publish/figures.py)."""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from cluster.publish.figures import BLOCKS, plan, regenerate


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


def _work_dir_refusal(work_dir: Path, seeds, blocks) -> str | None:
    """Why --work-dir cannot take this call's runs (None when it can): a file, a place where
    no directory can be made, or runs of the same names already there (a second `klrl demo`
    of a name refuses to overwrite the first, after the blocks before it were rewritten)."""
    from cluster.train.door.paths import check_creatable

    try:
        check_creatable(work_dir, "--work-dir")
    except ValueError as exc:
        return str(exc)
    taken = [r.name for r in plan(seeds, blocks) if (work_dir / "runs" / r.name).exists()]
    if taken:
        return (f"--work-dir={work_dir} already holds run(s) {', '.join(taken[:3])}"
                + (f" and {len(taken) - 3} more" if len(taken) > 3 else "")
                + "; give a new --work-dir, or none (a temporary one)")
    return None


def run(args) -> int:
    if args.work_dir and (why := _work_dir_refusal(Path(args.work_dir), args.seeds, args.only)):
        print(f"error: {why}", file=sys.stderr)
        return 2
    try:
        if args.work_dir:
            regenerate(args.seeds, args.only, Path(args.work_dir))
        else:
            with tempfile.TemporaryDirectory(prefix="klrl-figures-") as tmp:
                regenerate(args.seeds, args.only, Path(tmp))
    except RuntimeError as exc:  # a demo run failed: its log is named in the message
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print("docs/demo.md, docs/model.md, docs/lora.md and docs/figures/*.json updated")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "figures", help="rerun the demo and rewrite the docs' demo and model figures",
        description="Run `klrl demo` at max_lag 0 and 2, plain GRPO at max_lag 0 and the demo "
        "with rank-8 LoRA for each seed (about 3 minutes each on 2 cores), read the embedded "
        "model's build figures, build the default model under four sets of CPU kernels (the "
        "spread block, no timing), and "
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
