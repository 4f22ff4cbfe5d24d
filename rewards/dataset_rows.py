"""Rows of a dataset named on the Hugging Face hub or stored in a local file, turned into
Problems by a task's row converter, with malformed rows skipped and counted (never a crash).

Hub datasets and parquet files go through `datasets.load_dataset`. JSON Lines files are read
line by line with the stdlib instead: `datasets`' json builder rejects a whole file for one
bad line or one field whose type differs between rows, and here such a row must only be
skipped.

A dataset in another schema than the task's is read through a column mapping (source column
-> the task's column, e.g. GSM8K's {"question": "problem", "answer": "solution"} for the
math task), applied to each row before the task's converter sees it.
"""
from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from rewards.records import Problem

logger = logging.getLogger(__name__)

LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")
DATA_DIR = Path(__file__).parent / "data"

RowConverter = Callable[[Any, int], Problem]
"""(row, index) -> Problem; raises ValueError, TypeError or KeyError for a malformed row."""


class DatasetSource(BaseModel):
    """Where one split's rows come from: a local file (.jsonl, .json or .parquet) or a hub
    dataset `name` with an optional `config` (subset) and the hub `split` to read, and the
    `columns` to rename (source column -> the task's column) before a row is converted."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1)
    config: str | None = None
    split: str = "train"
    columns: dict[str, str] = Field(default_factory=dict, max_length=1000)

    @field_validator("columns")
    @classmethod
    def _check_columns(cls, columns: dict[str, str]) -> dict[str, str]:
        if any(not k or not v for k, v in columns.items()):
            raise ValueError(f"column names must not be empty: {columns}")
        if len(set(columns.values())) != len(columns):
            raise ValueError(f"two columns are renamed to the same name: {columns}")
        return columns

    def with_columns(self, columns: dict[str, str] | None) -> DatasetSource:
        """This source with a task-wide column mapping, unless it has its own."""
        if not columns or self.columns:
            return self
        return DatasetSource(**{**self.model_dump(), "columns": columns})

    @classmethod
    def coerce(cls, value: str | dict | DatasetSource, default_split: str) -> DatasetSource:
        """A source from a config value: a path or hub name (str), or a mapping of fields."""
        if isinstance(value, DatasetSource):
            return value
        if isinstance(value, str):
            return cls(name=value, split=default_split)
        if isinstance(value, dict):
            return cls(**{"split": default_split, **value})
        raise TypeError(f"a dataset source is a path, a hub name or a mapping, not {value!r}")

    @property
    def is_local(self) -> bool:
        return self.name.endswith(LOCAL_SUFFIXES) or Path(self.name).is_file()

    def label(self) -> str:
        """How messages name this source: the path, or name[config]:split."""
        if self.is_local:
            return self.name
        return f"{self.name}" + (f"[{self.config}]" if self.config else "") + f":{self.split}"

    def short_label(self) -> str:
        """The same without directories, for problem uids (stable across machines)."""
        return Path(self.name).name if self.is_local else self.label()


class MalformedRows(ValueError):
    """Not one usable row in a dataset."""


@dataclass(frozen=True)
class RowCount:
    """What reading one dataset found: its rows, the malformed ones skipped, the first error."""

    label: str
    rows: int
    malformed: int
    first_error: str | None

    @property
    def fraction(self) -> float:
        return self.malformed / self.rows if self.rows else 0.0


_counts: ContextVar[list[RowCount] | None] = ContextVar("klrl_row_counts", default=None)


@contextmanager
def counting_rows() -> Iterator[list[RowCount]]:
    """A list that receives the RowCount of every dataset `load_problems` reads inside the
    block (the pre-start check reads a run's local files through its tasks, then judges the
    counts against task.max_malformed_fraction)."""
    token = _counts.set([])
    try:
        yield _counts.get()
    finally:
        _counts.reset(token)


def resolve_local_paths(value: Any, base: Path) -> Any:
    """`value` (task options: nested dicts, lists, strings) with every relative local dataset
    path made absolute against `base`, so that it names the same file in every process of a
    run whatever its working directory. A string is such a path when it ends in one of
    LOCAL_SUFFIXES, or holds a separator and names a file under `base` (the rule of
    `DatasetSource.is_local`, without the bare names that mean something else, such as
    "fixture"); `~` is expanded. Anything else is returned as it is."""
    if isinstance(value, dict):
        return {k: resolve_local_paths(v, base) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve_local_paths(v, base) for v in value]
    if not isinstance(value, str) or not value.strip():
        return value
    path = Path(value).expanduser()
    if not (value.endswith(LOCAL_SUFFIXES) or ("/" in value and (base / path).is_file())):
        return value
    return str(path if path.is_absolute() else base / path)


def rename_columns(row: Any, columns: dict[str, str]) -> Any:
    """`row` with its columns renamed by `columns` (source -> target); a renamed column
    replaces a column already called `target`, and the others are kept. Not a mapping: the
    row unchanged (the converter rejects it)."""
    if not columns or not isinstance(row, dict):
        return row
    out = {k: v for k, v in row.items() if k not in columns}
    out.update({target: row[source] for source, target in columns.items() if source in row})
    return out


def _row_error(index: int, row: Any, columns: dict[str, str], exc: Exception) -> str:
    """Why row `index` was refused, for people: a column the `columns` mapping renames but the
    row lacks is named as the user wrote it (not as the task's column it was to become),
    with the row's columns; otherwise the converter's error."""
    if isinstance(row, dict) and (absent := [c for c in columns if c not in row]):
        renamed = ", ".join(f"{c!r} (renamed by `columns` to {columns[c]!r})" for c in absent)
        return (f"row {index}: no column {renamed}; the row's columns are "
                f"{', '.join(map(str, row)) or 'none'}")
    return f"row {index}: {type(exc).__name__}: {str(exc)[:200]}"


def load_problems(source: DatasetSource, convert: RowConverter) -> tuple[list[Problem], int]:
    """(problems, number of malformed rows skipped), each row renamed by `source.columns`
    before `convert` sees it. Logs one warning with the count and the first error when any
    row is skipped; raises MalformedRows when none is usable."""
    problems, skipped, first_error, total = [], 0, None, 0
    for index, row in enumerate(_read_rows(source)):
        total += 1
        try:
            if isinstance(row, _BadLine):
                raise ValueError(f"not JSON: {row.error}")  # noqa: TRY004 - counted like a bad row
            problems.append(convert(rename_columns(row, source.columns), index))
        except (ValueError, TypeError, KeyError, ValidationError) as e:
            skipped += 1
            first_error = first_error or _row_error(index, row, source.columns, e)
    if skipped and problems:  # with none usable, the error below says it all
        logger.warning("%s: skipped %d malformed row(s) of %d; first: %s",
                       source.label(), skipped, total, first_error)
    if (counts := _counts.get()) is not None:
        counts.append(RowCount(source.label(), total, skipped, first_error))
    if not total:
        raise MalformedRows(f"{source.label()}: the dataset holds no rows")
    if not problems:
        hint = (f" (check the task option `columns`, {source.columns}: each key is a column of "
                "the dataset, renamed to the task's column)") if source.columns else (
            " (a dataset in another schema needs the task option `columns`: {its column: the "
            "task's column})")
        raise MalformedRows(f"{source.label()}: no usable rows ({total} rows, {skipped} "
                            f"malformed{'; first: ' + first_error if first_error else ''}){hint}")
    return problems, skipped


def sample_problems(problems: list[Problem], split: str, n: int | None,
                    rng: random.Random) -> list[Problem]:
    """Pick `n` problems of a loaded split. n=None: all, in dataset order. An evaluation split
    gives min(n, available) distinct problems; "train" cycles through seeded shuffles (epochs)
    when n is larger than the dataset."""
    if n is None:
        return list(problems)
    if split != "train":
        return rng.sample(problems, min(n, len(problems)))
    out: list[Problem] = []
    while len(out) < n:
        epoch = list(problems)
        rng.shuffle(epoch)
        out.extend(epoch[: n - len(out)])
    return out


def require_text(row: dict, key: str, max_chars: int = 100_000) -> str:
    """row[key] as a non-empty string (numbers are converted: some datasets store answers
    as ints), else ValueError/KeyError naming the field."""
    value = row[key]
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise TypeError(f"field {key!r} is {type(value).__name__}, not text")
    text = str(value).strip()
    if not text:
        raise ValueError(f"field {key!r} is empty")
    if len(text) > max_chars:
        raise ValueError(f"field {key!r} longer than {max_chars} characters")
    return text


class _BadLine:
    def __init__(self, error: str):
        self.error = error


def _read_rows(source: DatasetSource) -> Iterator[Any]:
    if not source.is_local:
        import datasets  # heavy (pyarrow, pandas): only when a hub dataset is asked for

        yield from datasets.load_dataset(source.name, source.config, split=source.split)
        return
    path = Path(source.name)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file {path} does not exist")
    if path.suffix == ".parquet":
        import datasets

        yield from datasets.load_dataset("parquet", data_files=str(path), split="train")
    elif path.suffix == ".json":
        rows = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(rows, list):
            raise ValueError(f"{path}: a .json dataset must hold a list of rows")
        yield from rows
    else:  # JSON Lines (any other suffix is read as JSON Lines too)
        with path.open(encoding="utf-8", errors="replace") as lines:
            for line in lines:
                if not line.strip():
                    continue  # blank lines are not rows
                try:
                    yield json.loads(line)
                except ValueError as e:
                    yield _BadLine(str(e)[:200])
