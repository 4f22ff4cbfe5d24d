"""The example sweep file of docs/sweeps.md is a part of its shipped counterpart
(configs/sweeps/<its name>.yaml): it parses, every grid point validates, `klrl sweep --dry-run`
lists its runs, and it carries the counterpart's evaluation overrides (without them its runs
evaluate out of domain only where the model scores nothing). Running its 16 runs of 150 steps
would take half an hour: the dry run makes every check a run's start makes."""
from __future__ import annotations

import re
from pathlib import Path

import yaml

from cluster.cli.main import main
from cluster.config.loader import DEMO_CONFIG, REPO_ROOT
from cluster.sweeps.sweep import expand, load_sweep, validate_runs


def _example() -> dict:
    text = (REPO_ROOT / "docs" / "sweeps.md").read_text()
    found = re.search(r"<!-- example: sweep-file -->\n```yaml\n(.*?)\n```", text, re.DOTALL)
    assert found, "docs/sweeps.md has no sweep-file example block"
    return yaml.safe_load(found.group(1))


def test_the_docs_example_sweep_keeps_its_shipped_counterparts_settings():
    example = _example()
    shipped = yaml.safe_load((REPO_ROOT / "configs" / "sweeps" / f"{example['name']}.yaml")
                             .read_text())
    assert example["train_config"] == shipped["train_config"]
    assert example["overrides"] == shipped["overrides"]
    for key, values in example["grid"].items():
        assert set(values) <= set(shipped["grid"][key]), key


def test_the_docs_example_sweep_parses_and_dry_runs(tmp_path, monkeypatch, capsys):
    sweep = tmp_path / "example.yaml"
    sweep.write_text(yaml.safe_dump(_example(), sort_keys=False))
    monkeypatch.setenv("KLRL_HOME", str(tmp_path / "home"))
    overrides = [f"train_config={DEMO_CONFIG}", f"output_dir={tmp_path / 'runs'}"]
    cfg = load_sweep(sweep, overrides)
    runs = expand(cfg)
    configs = validate_runs(cfg, runs)
    assert len(runs) == 16 and all(
        c.eval.out_of_domain.split == "zero_padded"
        and c.eval.far_out_of_domain.split == "out_of_domain" for c in configs.values())
    assert main(["sweep", str(sweep), *overrides, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("(absent): klrl train") == 16
    assert out.count("eval.out_of_domain.split=zero_padded") == 16
    assert not Path(tmp_path / "runs").exists()
