"""The table of every `klrl train` option, rendered from `TrainConfig` itself (field names,
defaults and descriptions), so the documentation cannot drift from the code: `klrl options`
prints it and `klrl options --docs` rewrites the block of docs/configuration.md between
`<!-- options -->` markers, which a test compares with this rendering."""
from __future__ import annotations

import re
from collections.abc import Iterator

from pydantic import BaseModel

from cluster.config.train_config import TrainConfig
from rewards.config import EVAL_SETS

# Sections whose value is one record a user sets whole (e.g. eval.in_domain: {task, split}),
# listed as one row rather than field by field.
WHOLE_VALUES = EVAL_SETS


def option_rows(model: type[BaseModel] = TrainConfig,
                prefix: str = "") -> Iterator[tuple[str, str, str]]:
    """(dotted key, default, description) of every option, sub-configs flattened in order."""
    for name, field in model.model_fields.items():
        nested = [a for a in (field.annotation, *getattr(field.annotation, "__args__", ()))
                  if isinstance(a, type) and issubclass(a, BaseModel)]
        if nested and name not in WHOLE_VALUES:
            yield from option_rows(nested[0], prefix + name + ".")
            continue
        default = field.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):
            default = default.model_dump()
        shown = repr(default) if isinstance(default, str) and not default else str(default)
        yield prefix + name, shown, field.description or ""


def options_markdown() -> str:
    """The markdown table of `option_rows` (pipes in descriptions escaped)."""
    lines = ["| key | default | meaning |", "|---|---|---|"]
    for key, default, description in option_rows():
        description = description.replace("|", "\\|")
        lines.append(f"| `{key}` | `{default}` | {description} |")
    return "\n".join(lines)


def replace_block(text: str, marker: str, body: str) -> str:
    """`text` with the lines between `<!-- marker -->` and `<!-- /marker -->` replaced by
    `body` (the markers stay); ValueError if the markers are missing."""
    pattern = re.compile(rf"(<!-- {re.escape(marker)} -->\n).*?(<!-- /{re.escape(marker)} -->)",
                         re.DOTALL)
    if not pattern.search(text):
        raise ValueError(f"no <!-- {marker} --> ... <!-- /{marker} --> block")
    return pattern.sub(lambda m: m.group(1) + body.rstrip("\n") + "\n" + m.group(2), text)


def read_block(text: str, marker: str) -> str:
    """The lines between `<!-- marker -->` and `<!-- /marker -->`, without the markers."""
    match = re.search(rf"<!-- {re.escape(marker)} -->\n(.*?)<!-- /{re.escape(marker)} -->",
                      text, re.DOTALL)
    if match is None:
        raise ValueError(f"no <!-- {marker} --> ... <!-- /{marker} --> block")
    return match.group(1).rstrip("\n")
