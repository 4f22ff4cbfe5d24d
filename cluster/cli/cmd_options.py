"""`klrl options`: every `klrl train` option with its default and meaning (the README's
option table is this output; `--readme` rewrites it)."""
from __future__ import annotations

from pathlib import Path

from cluster.config.options import options_markdown, replace_block

README = Path(__file__).resolve().parents[2] / "README.md"


def run(args) -> int:
    table = options_markdown()
    if not args.readme:
        print(table)
        return 0
    README.write_text(replace_block(README.read_text(), "options", table))
    print(f"{README}: option table rewritten ({table.count(chr(10)) - 1} options)")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "options", help="list every klrl train option with its default and meaning",
        description="Print the table of every `klrl train` option (YAML key or key=value "
        "override), rendered from the config classes' own field descriptions.")
    p.add_argument("--readme", action="store_true",
                   help="rewrite the table between <!-- options --> markers in README.md "
                   "(for developers, after adding or changing an option)")
    p.set_defaults(func=run)
