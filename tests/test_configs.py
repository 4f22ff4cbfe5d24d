"""Every file in configs/ parses and validates; the loader names bad fields."""
from pathlib import Path

import pytest

from cluster.config import ConfigError, load_config, parse_overrides

ROOT = Path(__file__).resolve().parents[1]
CONFIG_FILES = sorted((ROOT / "configs").rglob("*.yaml"))


def model_for(path: Path):
    """Which pydantic model a file in configs/ is validated by."""
    from cluster.cmd_kl_table import KLTableConfig

    if path.name == "kl_table.yaml":
        return KLTableConfig
    raise AssertionError(f"no config model is registered for {path}; add it to model_for()")


def test_there_are_configs():
    assert CONFIG_FILES


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_config_file_validates(path):
    load_config(model_for(path), path)


def test_overrides_are_typed_and_nested():
    assert parse_overrides(["kl.beta=0.05", "max_lag=2", "kl.truncate=null", "name=abc"]) == {
        "kl": {"beta": 0.05, "truncate": None}, "max_lag": 2, "name": "abc"}
    with pytest.raises(ConfigError, match="key.sub=value"):
        parse_overrides(["max_lag"])


def test_errors_name_the_field_and_the_file(tmp_path):
    from cluster.cmd_kl_table import KLTableConfig

    bad = tmp_path / "bad.yaml"
    bad.write_text("seed: -1\nvocab: 3\n")
    with pytest.raises(ConfigError) as exc:
        load_config(KLTableConfig, bad, ["lenght=3"])
    text = str(exc.value)
    assert "bad.yaml" in text and "seed" in text and "lenght" in text
    with pytest.raises(ConfigError, match="not found"):
        load_config(KLTableConfig, tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(KLTableConfig, tmp_path / "list.yaml")
