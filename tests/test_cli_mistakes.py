"""First-day mistakes refused at the door in one line naming the fix (issue 67): an override
written as an option, a sweep file where a training config goes and the reverse, a dataset
column that the `columns` mapping names but the file lacks, an override that merges into a
file's mapping, and `klrl train --dry-run`, which makes every check of a real start and starts
nothing. Nothing here starts Ray, vLLM or the model build (each is a stand-in that fails)."""
from __future__ import annotations

import json
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


class GotPastTheDoor(AssertionError):
    """Raised where something heavy would start."""


def _refuse(*_args, **_kw):
    raise GotPastTheDoor("the command got past its checks")


@pytest.fixture
def nothing_starts(tmp_path, monkeypatch):
    """The model build and Ray are stand-ins that fail the test; the tiny model's cache is an
    empty directory of the test's own."""
    import ray

    from cluster.tiny import model

    monkeypatch.setenv("KLRL_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(model, "init_default_model", _refuse)
    monkeypatch.setattr(ray, "init", _refuse)
    return tmp_path


@pytest.fixture
def own_data(tmp_path) -> Path:
    """A config of one's own, as the README writes it: a local dataset whose columns the task
    option `columns` renames, except that the file has `solution` where the mapping says
    `final`."""
    rows = [{"question": f"{i}+1", "solution": str(i + 1)} for i in range(3)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "mine.yaml").write_text(
        f"base: {TINY}\n"
        "task:\n  name: math\n  options:\n    train: train.jsonl\n    in_domain: train.jsonl\n"
        "    columns: {question: problem, final: answer}\n"
        "eval: {out_of_domain: null, retained: null}\n")
    return tmp_path / "mine.yaml"


def test_a_mapped_column_the_file_lacks_is_named_as_the_user_wrote_it(own_data, nothing_starts,
                                                                      capsys, monkeypatch):
    monkeypatch.chdir(own_data.parent)
    _refused(capsys, ["train", str(own_data), "--dry-run"],
             "no column 'final' (renamed by `columns` to 'answer'); the row's columns are "
             "question, solution", "check the task option `columns`")


def test_an_override_merged_into_a_mapping_says_how_to_replace_it(own_data, capsys):
    """`columns={q: problem}` is merged into the file's mapping (two columns would become
    `problem`): one line says so without pydantic's text, and the replacement it names works."""
    from cluster.config.train_config import load_train_config

    assert main(["train", str(own_data), "--dry-run", "task.options.columns={q: problem}"]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 2 and "invalid configuration" in lines[0], err
    assert "two columns are renamed to the same name" in lines[1]
    assert "errors.pydantic.dev" not in err and "input_value" not in err
    assert lines[1].endswith("was merged into the file's (task.options.columns: {question: "
                             "problem, final: answer}), key by key: to replace it instead, "
                             "clear it first: task.options.columns=null "
                             "'task.options.columns={q: problem}'")
    cfg = load_train_config(own_data, ["task.options.columns=null",
                                       "task.options.columns={question: problem, b: answer}"])
    assert cfg.task.options["columns"] == {"question": "problem", "b": "answer"}


def test_a_lora_target_typo_is_refused_before_the_run_is_named(nothing_starts, capsys):
    argv = ["train", str(TINY), f"output_dir={nothing_starts}/runs", "learner.lora.rank=8",
            "learner.lora.target_modules=[qkv]"]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert "learner.lora.target_modules: the embedded tiny model has no linear layer named qkv; "\
           "its linear layers are down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, " \
           "up_proj, v_proj" in err
    assert "klrl train --resume" not in out + err and not (nothing_starts / "runs").exists()


def test_dry_run_makes_the_checks_of_a_start_and_starts_nothing(nothing_starts, capsys):
    runs = nothing_starts / "runs"
    assert main(["train", str(TINY), "--dry-run", f"output_dir={runs}", "run_name=r"]) == 0
    out = capsys.readouterr().out
    assert f"run r: would start in {runs / 'r'}" in out
    assert "model: the embedded tiny model, not built yet: the start builds it first" in out
    assert "data: arithmetic, split train: generated" in out
    assert out.strip().endswith("nothing was started or written")
    assert not runs.exists() and not (nothing_starts / "home").exists()


@pytest.mark.parametrize(("overrides", "names"), [
    # the prompt stream's own check, which a real start makes only once Ray is up
    (["data.epochs=1", "rollout.prompts_per_step=4"],
     ("data.epochs=1 x 3 prompts", "is less than one batch")),
    (["ray.address=127.0.0.1:1"], ("ray.address=127.0.0.1:1: nothing answers there",)),
    (["model.path=no/such/model"], ("model.path=no/such/model",)),
])
def test_dry_run_refuses_what_a_start_would(overrides, names, own_data, nothing_starts, capsys,
                                             monkeypatch):
    monkeypatch.chdir(own_data.parent)
    _refused(capsys, ["train", str(own_data), "--dry-run", "task.options.columns=null",
                      "task.options.columns={question: problem, solution: answer}", *overrides],
             *names)
    assert not (own_data.parent / "runs").exists()
