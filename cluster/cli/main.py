"""The `klrl` command line.

Each sub-command lives in its own module exposing `register(subparsers)`, which adds its
parser and sets `func` (called with the parsed namespace, returning an exit code). Command
modules import the modules that load torch, Ray, vLLM or DeepSpeed inside their functions
(each such import says so), so `klrl --help` and light commands such as `report` start fast.
"""
from __future__ import annotations

import argparse
import sys

from cluster.cli import (
    cmd_bench,
    cmd_dashboard,
    cmd_figures,
    cmd_kl_fixed_points,
    cmd_kl_table,
    cmd_model,
    cmd_options,
    cmd_slurm,
    cmd_sweep,
    cmd_train,
)
from cluster.train.provenance import version_line

# Order is the order shown in `klrl --help`.
COMMANDS = [cmd_train, cmd_options, cmd_model, cmd_kl_table, cmd_kl_fixed_points, cmd_sweep,
            cmd_dashboard, cmd_slurm, cmd_bench, cmd_figures]


class _Version(argparse.Action):
    """--version, with the git commit looked up only when asked (not on every command)."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_line())
        parser.exit()


class _Parser(argparse.ArgumentParser):
    """argparse whose mistakes are one line, as every refusal of klrl is (exit 2, the fix
    named), rather than the usage block, which `--help` shows. Sub-command parsers are of
    this class too (argparse makes them of their parent's)."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="klrl",
        description="Distributed asynchronous RL for LLMs with exact, tested KL regularisation.",
    )
    parser.add_argument("--version", action=_Version, nargs=0,
                        help="print klrl's version and git commit, then exit")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.register(subparsers)
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
