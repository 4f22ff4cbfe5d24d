"""Loading configs: YAML file + `key.sub=value` overrides -> validated pydantic model.

OmegaConf merges the file and the dotted overrides (and parses override values as YAML
scalars: `kl.beta=0.05`, `kl.truncate=null`, `max_lag=2`); pydantic then validates the plain
dict, so every field has a type, bounds and a docstring in one place. Errors name the field
and the file.
"""
from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)

REPO_ROOT = Path(__file__).resolve().parents[2]  # a Ray job's working_dir (cluster/train/jobs.py)
DEMO_CONFIG = REPO_ROOT / "configs" / "tiny_cpu.yaml"  # `klrl demo`, the benchmarks


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the field."""


def parse_overrides(overrides: list[str]) -> dict:
    """['a.b=1', 'c=x'] -> nested dict, with YAML scalar parsing of values."""
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r} is not of the form key.sub=value")
    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist(list(overrides)), resolve=True)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"bad override: {exc}") from None


def merge(base: dict, overrides: list[str]) -> dict:
    try:
        merged = OmegaConf.merge(OmegaConf.create(base), OmegaConf.create(parse_overrides(overrides)))
        return OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"cannot apply overrides {overrides}: {exc}") from None


def read_yaml(path: str | Path, _seen: tuple = ()) -> dict:
    """Read a YAML mapping. A top-level `base: other.yaml` (relative to this file) is read
    first and this file's keys are merged over it, so variants only state what differs."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    if "base" in data:
        base_path = (path.parent / str(data.pop("base"))).resolve()
        if base_path in _seen:
            raise ConfigError(f"{path}: circular base: {base_path}")
        base = read_yaml(base_path, _seen + (base_path,))
        data = OmegaConf.to_container(OmegaConf.merge(OmegaConf.create(base), OmegaConf.create(data)))
    return data


def validate(model: type[M], data: dict, source: str = "config") -> M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            field = ".".join(str(p) for p in err["loc"]) or "(top level)"
            got = f" (got {err['input']!r})" if "input" in err and not isinstance(err["input"], dict) else ""
            lines.append(f"  {field}: {err['msg']}{got}")
        raise ConfigError(f"{source}: invalid configuration\n" + "\n".join(lines)) from None


def load_config(model: type[M], path: str | Path | None, overrides: list[str] = ()) -> M:
    """Read `path` (or start from the model's defaults), apply overrides, validate."""
    base = read_yaml(path) if path is not None else {}
    return validate(model, merge(base, list(overrides)), source=str(path or "defaults"))


def dump_config(cfg: BaseModel, path: str | Path) -> None:
    """Write the resolved config (every field, defaults included) as YAML."""
    Path(path).write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
