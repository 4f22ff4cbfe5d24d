"""Loading configs: YAML file + `key.sub=value` overrides -> validated pydantic model.

OmegaConf merges the file and the dotted overrides (and parses override values as YAML
scalars: `kl.beta=0.05`, `kl.truncate=null`, `max_lag=2`); pydantic then validates the plain
dict, so every field has a type, bounds and a docstring in one place. Errors name the field,
the file and, when the bad value came from one, the override (`kl.beta=-1`); an unknown key
gets a "did you mean" from the known ones. A key written twice in one YAML mapping is an
error (plain YAML keeps the last one silently, which drops half of a duplicated section).
"""
from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import TypeVar, get_args

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)

REPO_ROOT = Path(__file__).resolve().parents[2]  # a Ray job's working_dir (launchers/ray_jobs.py)
DEMO_CONFIG = REPO_ROOT / "configs" / "tiny_cpu.yaml"  # `klrl demo`, the benchmarks
# Plain GRPO on the demo config (group mean/std advantages, K3 in the loss: TRL's GRPO): the
# docs' learning figures (`klrl figures`) and `klrl bench --peer trl` run it beside the demo's own.
PLAIN_GRPO = ("advantage.estimator=grpo", "kl.estimator=k3", "kl.placement=loss")


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
    except yaml.YAMLError as exc:  # a value YAML cannot read, e.g. `run_name=...`
        bad = next((o for o in overrides if _yaml_error(o.split("=", 1)[1])), "=")
        key, _, value = bad.partition("=")
        raise ConfigError(f"override {bad}: the value is not YAML ({_first_line(exc)}); quote "
                          f"it for YAML, in the shell: {key}=\"'{value}'\"") from None


def _yaml_error(value: str) -> bool:
    try:
        yaml.safe_load(value)
    except yaml.YAMLError:
        return True
    return False


def _first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def merge(base: dict, overrides: list[str]) -> dict:
    """`base` with the overrides applied one after another: a mapping value is merged into the
    mapping it lands on, key by key, so `key=null` before it replaces that mapping instead."""
    try:
        merged = OmegaConf.merge(OmegaConf.create(base), *(
            OmegaConf.create(parse_overrides([item])) for item in overrides))
        return OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"cannot apply overrides {overrides}: {exc}") from None


def merged_into(base: dict, overrides: list[str]) -> dict[str, dict]:
    """{override: the mapping it was merged into}: each `key={...}` override whose key holds a
    mapping in `base` with keys the override does not give (and no `key=null` before it), so
    that the result holds more than the override says."""
    found, cleared = {}, set()
    for item in overrides:
        key, _, value = item.partition("=")
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError:
            continue
        if value is None:
            cleared.add(key)
        if not isinstance(value, dict) or key in cleared:
            continue
        node = base
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and set(node) - set(value):
            found[item] = node
    return found


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key written twice in one mapping (`<<` merges aside)."""

    source = "<yaml>"

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node.start_mark.line)
                except TypeError:  # an unhashable (complex) key: YAML itself rejects it below
                    continue
                if first != key_node.start_mark.line:
                    raise ConfigError(
                        f"{self.source}, line {key_node.start_mark.line + 1}: key {key!r} is "
                        f"written twice in one mapping (first on line {first + 1}); YAML would "
                        "keep only the last one: merge the two into one")
        return super().construct_mapping(node, deep)


def _load_yaml(text: str, source: str):
    loader = _UniqueKeyLoader(text)
    loader.source = source
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def read_yaml(path: str | Path, _seen: tuple = ()) -> dict:
    """Read a YAML mapping. A top-level `base: other.yaml` (relative to this file) is read
    first and this file's keys are merged over it, so variants only state what differs."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = _load_yaml(path.read_text(), str(path))
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if data is None:  # an empty file (or comments only) would silently mean every default
        raise ConfigError(f"{path}: the file is empty (no key set); write the keys that differ "
                          "from the defaults, or `{}` to mean every default")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    if "base" in data:
        base_path = (path.parent / str(data.pop("base"))).resolve()
        if base_path in _seen:
            raise ConfigError(f"{path}: circular base: {base_path}")
        base = read_yaml(base_path, _seen + (base_path,))
        data = OmegaConf.to_container(
            OmegaConf.merge(OmegaConf.create(base), OmegaConf.create(data)))
    return data


def top_keys(path: str | Path) -> set[str]:
    """The top-level keys of the YAML mapping at `path` (`base:` resolved); empty when it
    cannot be read. For naming a file given where another kind of file goes."""
    try:
        return set(read_yaml(path))
    except ConfigError:
        return set()


def validate(model: type[M], data: dict, source: str = "config", overrides: list[str] = ()) -> M:
    """`model` validated from `data`, or a ConfigError with one line per bad field, naming the
    override that set it (if one did) and, for an unknown key or value, the closest known one."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        lines, blamed = [], False
        for err in exc.errors():
            field = ".".join(str(p) for p in err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                msg = "unknown key"
            shown = ("input" in err and not isinstance(err["input"], dict)
                     and err["type"] != "value_error")
            got = f" (got {err['input']!r})" if shown else ""  # a ValueError's message names it
            names_itself = not field or msg.startswith(field)
            line = f"  {msg}" if names_itself else f"  {field}: {msg}{got}"
            if hint := _did_you_mean(model, err):
                line += f"; did you mean {hint!r}?"
            if culprits := _overrides_behind(field, msg, overrides):
                line += f" (from the override {' '.join(culprits)})"
                blamed = True
            lines.append(line)
        where = f"{source} with overrides" if blamed else source
        raise ConfigError(f"{where}: invalid configuration\n" + "\n".join(lines)) from None


def _overrides_behind(field: str, msg: str, overrides: list[str]) -> list[str]:
    """The `key=value` overrides that set `field` (or a key inside or above it); for an error
    about several fields (no field), those whose key the message names."""
    found = []
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if field:
            hit = key == field or key.startswith(field + ".") or field.startswith(key + ".")
        else:
            hit = re.search(rf"(?<![\w.]){re.escape(key)}(?![\w])", msg) is not None
        if hit:
            found.append(item)
    return found


def _did_you_mean(model: type[BaseModel], err: dict) -> str | None:
    """The known key closest to an unknown one, or the allowed value closest to a bad one."""
    if err["type"] == "extra_forbidden" and err["loc"]:
        *parent, key = err["loc"]
        return _closest(str(key), _known_keys(model, parent))
    if err["type"] == "literal_error" and isinstance(err.get("input"), str):
        expected = str(err.get("ctx", {}).get("expected"))
        return _closest(err["input"], re.findall(r"'([^']*)'", expected))
    return None


def _closest(word: str, choices: list[str]) -> str | None:
    """The choice `word` abbreviates, else the most similar one (difflib), else None."""
    if prefixed := [c for c in choices if c.startswith(word)]:
        return prefixed[0]
    match = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return match[0] if match else None


def _known_keys(model: type[BaseModel], loc: list) -> list[str]:
    """Field names of the sub-model at `loc` inside `model` ([] when it is not a model)."""
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return []
        sub = [a for a in (field.annotation, *get_args(field.annotation))
               if isinstance(a, type) and issubclass(a, BaseModel)]
        if not sub:
            return []
        model = sub[0]
    return list(model.model_fields)


def load_config(model: type[M], path: str | Path | None, overrides: list[str] = ()) -> M:
    """Read `path` (or start from the model's defaults), apply overrides, validate."""
    base = read_yaml(path) if path is not None else {}
    try:
        return validate(model, merge(base, list(overrides)), source=str(path or "defaults"),
                        overrides=list(overrides))
    except ConfigError as exc:
        blamed = {o: node for o, node in merged_into(base, list(overrides)).items()
                  if f"override {o}" in str(exc) or f" {o}" in str(exc)}
        if not blamed:
            raise
        item, node = next(iter(blamed.items()))
        key, _, value = item.partition("=")
        raise ConfigError(
            f"{exc}; the override's mapping was merged into the file's ({key}: "
            f"{_flow(node)}), key by key: to replace it instead, clear it first: "
            f"{key}=null '{key}={value}'") from None


def _flow(mapping: dict) -> str:
    """A mapping in YAML's one-line form: {a: 1, b: x}."""
    return yaml.safe_dump(mapping, default_flow_style=True, sort_keys=False).strip()


def dump_config(cfg: BaseModel, path: str | Path) -> None:
    """Write the resolved config (every field, defaults included) as YAML."""
    Path(path).write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
