"""`klrl init-model` and `klrl eval` refuse what they can see before they start (exit 2, one
`error:` line, nothing built, written or deleted): an --out that holds something other than an
embedded model (a build replaces the directory it publishes to), output files whose directory
cannot be made, sampling values vLLM would reject only after its engine started. No engine and
no build runs here: each refusal comes first."""
from __future__ import annotations

import pytest

from cluster.cli.main import main
from cluster.tiny.model import check_out_dir


def _refused(capsys, argv) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_init_model_never_replaces_a_directory_that_is_not_a_model(tmp_path, capsys):
    mine = tmp_path / "models"
    (mine / "notes").mkdir(parents=True)
    (mine / "notes" / "keep.txt").write_text("mine")
    line = _refused(capsys, ["init-model", "--out", str(mine)])
    assert "--out" in line and "holds files but no embedded model" in line
    assert (mine / "notes" / "keep.txt").read_text() == "mine"  # untouched
    # --force replaces a model, never something else
    _refused(capsys, ["init-model", "--out", str(mine), "--force"])
    assert (mine / "notes" / "keep.txt").read_text() == "mine"
    afile = tmp_path / "a-file"
    afile.write_text("x")
    assert "is a file" in _refused(capsys, ["init-model", "--out", str(afile)])
    under_a_file = afile / "model"
    assert "cannot create it" in _refused(capsys, ["init-model", "--out", str(under_a_file)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "models"]


def test_a_new_or_empty_out_and_a_built_model_pass_the_check(tmp_path, tiny_model_dir):
    check_out_dir(tmp_path / "new")
    (tmp_path / "empty").mkdir()
    check_out_dir(tmp_path / "empty")
    built = tmp_path / "built"
    built.mkdir()
    (built / "klrl_model.json").write_text("{}")  # what a finished build holds
    (built / "model.safetensors").write_bytes(b"")
    check_out_dir(built)
    with pytest.raises(ValueError, match="holds files but no embedded model"):
        check_out_dir(tiny_model_dir)  # a model, but not an embedded build: not replaced


@pytest.mark.parametrize("flag", ["--json", "--log"])
def test_eval_refuses_an_output_file_it_could_not_write_before_the_engine(
        tmp_path, tiny_model_dir, capsys, flag):
    afile = tmp_path / "a-file"
    afile.write_text("x")
    line = _refused(capsys, ["eval", str(tiny_model_dir), "--n", "2", "--samples", "0",
                             flag, str(afile / "out")])
    assert line.startswith(f"error: {flag}=") and "cannot create it" in line
    line = _refused(capsys, ["eval", str(tiny_model_dir), flag, str(tmp_path)])
    assert "is a directory" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


@pytest.mark.parametrize("option, value", [("--top-p", "1.5"), ("--top-p", "0"),
                                           ("--temperature", "-1"), ("--max-tokens", "0"),
                                           ("--top-k", "-2")])
def test_eval_refuses_sampling_values_vllm_would_reject_after_its_start(
        tiny_model_dir, capsys, option, value):
    with pytest.raises(SystemExit) as exit_:
        main(["eval", str(tiny_model_dir), option, value])
    assert exit_.value.code == 2
    assert f"argument {option}" in capsys.readouterr().err
