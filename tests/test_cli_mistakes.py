"""First-day mistakes refused at the door in one line naming the fix (issue 67): an override
written as an option, a sweep file where a training config goes and the reverse, a dataset
column that the `columns` mapping names but the file lacks, an override that merges into a
file's mapping, and `klrl train --dry-run`, which makes every check of a real start and starts
nothing. Nothing here starts Ray, vLLM or the model build (each is a stand-in that fails)."""
from __future__ import annotations

from pathlib import Path

import pytest

from cluster.cli.main import main

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_cpu.yaml"
SWEEP = ROOT / "configs" / "sweeps" / "offpolicy_tiny.yaml"


def _refused(capsys, argv: list[str], *names: str) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for name in names:
        assert name in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize(("argv", "make", "meant"), [
    (["demo", "--max_lag", "2"], False, "klrl demo max_lag=2"),
    (["demo", "--max_lag", "2"], True, 'make demo ARGS="max_lag=2"'),
    (["demo", "seed=1", "--kl.beta=0.1"], True, 'make demo ARGS="kl.beta=0.1"'),
    (["train", str(TINY), "--max_lag", "2"], False, "klrl train ... max_lag=2"),
    (["sweep", str(SWEEP), "--parallel", "2"], False, "klrl sweep ... parallel=2"),
])
def test_an_override_written_as_an_option_names_the_key_value_it_meant(argv, make, meant,
                                                                        monkeypatch, capsys):
    if make:
        monkeypatch.setenv("MAKELEVEL", "1")
    else:
        monkeypatch.delenv("MAKELEVEL", raising=False)
    line = _refused(capsys, argv, f"klrl {argv[0]}: --", "is not an option", meant)
    assert "unrecognized" not in line


def test_an_unknown_short_option_is_still_argparses(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["demo", "-x"])
    assert exited.value.code == 2 and "unrecognized arguments: -x" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "names"), [
    (["train", str(SWEEP)], (f"{SWEEP} is a sweep file", f"klrl sweep {SWEEP}")),
    (["submit", str(SWEEP), "--address", "http://127.0.0.1:1"],
     (f"{SWEEP} is a sweep file", "--address URL")),
    (["sweep", str(TINY)], (f"{TINY} is a training config, not a sweep file",
                            f"klrl train {TINY}")),
])
def test_a_sweep_file_and_a_training_config_are_named_when_swapped(argv, names, capsys):
    _refused(capsys, argv, *names)
