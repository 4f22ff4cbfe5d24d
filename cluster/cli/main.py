"""The `klrl` command line.

Each sub-command lives in its own module exposing `register(subparsers)`, which adds its
parser and sets `func` (called with the parsed namespace, returning an exit code). Command
modules import heavy libraries (Ray, vLLM, DeepSpeed) inside their functions, so
`klrl --help` and light commands such as `kl-table` start fast.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# Order is the order shown in `klrl --help`.
COMMAND_MODULES = [
    "cluster.cli.cmd_train",
    "cluster.cli.cmd_model",
    "cluster.cli.cmd_kl_table",
    "cluster.cli.cmd_sweep",
    "cluster.cli.cmd_bench",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="klrl",
        description="Distributed asynchronous RL for LLMs with exact, tested KL regularisation.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # Overrides may follow options (`submit CFG --address URL key=value`); argparse stops a
    # positional list at the first option, so collect the leftovers here.
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not hasattr(args, "overrides") or any(e.startswith("-") for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
