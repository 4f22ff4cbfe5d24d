"""The `klrl` command line.

Each sub-command lives in its own module exposing `register(subparsers)`, which adds its
parser and sets `func` (called with the parsed namespace, returning an exit code). Command
modules import the modules that load torch, Ray, vLLM or DeepSpeed inside their functions
(each such import says so), so `klrl --help` and light commands such as `report` start fast.
"""
from __future__ import annotations

import argparse
import os
import re
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


def _dashed_override(args, extra: list[str], argv: list[str] | None) -> str | None:
    """An override written as an option (`--max_lag 2`, `--kl.beta=0.1`), which argparse
    leaves unrecognised: the one line that names the command and the key=value it meant (with
    `make demo ARGS=...` when make runs the command). None for any other unknown option."""
    if not hasattr(args, "overrides"):
        return None
    words = list(sys.argv[1:] if argv is None else argv)
    for flag in (e for e in extra if e.startswith("--")):
        key, sep, value = flag[2:].partition("=")
        if not re.fullmatch(r"[A-Za-z_][\w.]*", key) or key.replace("_", "-") in _options(args):
            continue
        at = words.index(flag)
        if not sep and at + 1 < len(words) and not words[at + 1].startswith("-"):
            value = words[at + 1]
        meant = f"{key}={value or 'VALUE'}"
        command = f"klrl {args.command}"
        if args.command == "demo":  # `make demo ARGS=...` runs it under make
            shown = f'make demo ARGS="{meant}"' if os.environ.get("MAKELEVEL") else (
                f"{command} {meant}")
        else:
            shown = f"{command} ... {meant}"
        return (f"{command}: {flag} is not an option; a setting is given as key=value, without "
                f"dashes: {shown}")
    return None


def _options(args) -> set[str]:
    """The long options of the command `args` came from, without their dashes."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {o[2:] for a in sub.choices[args.command]._actions for o in a.option_strings}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # Overrides may follow options (`submit CFG --address URL key=value`); argparse stops a
    # positional list at the first option, so collect the leftovers here.
    args, extra = parser.parse_known_args(argv)
    if extra:
        if hint := _dashed_override(args, extra, argv):
            print(f"error: {hint}", file=sys.stderr)
            return 2
        if not hasattr(args, "overrides") or any(e.startswith("-") for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
