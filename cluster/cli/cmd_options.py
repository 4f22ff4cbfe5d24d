"""`klrl options`: every `klrl train` option with its default and meaning (the option table of
docs/configuration.md is this output; `--docs` rewrites it)."""
from __future__ import annotations

from pathlib import Path

from cluster.config.options import options_markdown, replace_block

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def run(args) -> int:
    table = options_markdown()
    if not args.docs:
        print(table)
        return 0
    PAGE.write_text(replace_block(PAGE.read_text(), "options", table))
    print(f"{PAGE}: option table rewritten ({table.count(chr(10)) - 1} options)")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "options", help="list every klrl train option with its default and meaning",
        description="Print the table of every `klrl train` option (YAML key or key=value "
        "override), rendered from the config classes' own field descriptions.")
    p.add_argument("--docs", "--readme", dest="docs", action="store_true",
                   help="rewrite the table between <!-- options --> markers in "
                   "docs/configuration.md "
                   "(for developers, after adding or changing an option)")
    p.set_defaults(func=run)
