"""The run directory's one owner (cluster/train/run_log.py): what RunLog writes, and the one
rule every reader of metrics.jsonl applies to a bad line (skip it); the samples table and the
periodic Hugging Face exports (cluster/train/checkpoint.py) on their own."""
import json
import math

import pytest

from actors.records import Rollout
from cluster.config.loader import DEMO_CONFIG, ConfigError
from cluster.config.train_config import load_train_config
from cluster.analysis.report import load_run
from cluster.train.continuation import RunState, continuation
from cluster.train import checkpoint as ckpt
from cluster.train.run_log import (
    SAMPLE_COLUMNS,
    RunLog,
    abandon_metrics,
    completion_text,
    final_dir,
    is_finished,
    keep_logs_through,
    last_step,
    metrics_path,
    read_config,
    read_metrics,
    read_samples,
    sample_rows,
    samples_path,
)
from rewards import Problem

GOOD = [{"step": 0, "eval/in_domain/accuracy": 0.1}, {"step": 1, "reward/mean": 0.5},
        {"step": 2, "reward/mean": 0.6}]
BAD = ["", "not json", "[1, 2]", '{"reward/mean": 1.0}', '{"step": "3"}']


def _write(run_dir, cut_last=True):
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(GOOD[0]), BAD[0], BAD[1], json.dumps(GOOD[1]), *BAD[2:],
             json.dumps(GOOD[2])]
    text = "\n".join(lines) + "\n" + ('{"step": 3, "rew' if cut_last else "")
    metrics_path(run_dir).write_text(text)


def test_every_reader_skips_the_same_bad_lines(tmp_path):
    _write(tmp_path / "run")
    assert read_metrics(tmp_path / "run") == GOOD
    assert last_step(tmp_path / "run") == 2  # the cut last line is skipped
    assert sorted(load_run(tmp_path / "run").rows) == [0, 1, 2]
    samples = [{"step": 1, "response": "a"}, {"step": 2, "response": "b"}]
    samples_path(tmp_path / "run").write_text("".join(json.dumps(r) + "\n" for r in samples)
                                              + '{"step": 3, "resp')
    keep_logs_through(tmp_path / "run", 1)  # what a resume from step 1 does
    assert metrics_path(tmp_path / "run").read_text() == "".join(
        json.dumps(r) + "\n" for r in GOOD[:2])
    assert read_samples(tmp_path / "run") == samples[:1]  # no step's rows twice after a resume
    assert last_step(tmp_path / "missing") == 0


def test_run_log_writes_config_and_metrics_and_marks_nothing_finished(tmp_path):
    cfg = load_train_config(DEMO_CONFIG, ["logging.wandb_mode=disabled", "seed=3"])
    with RunLog(cfg, tmp_path / "run") as log:
        log.log({"step": 0, "reward/mean": 0.25})
        log.log({"step": 1, "grad/norm": math.inf, "kl/pi_ref": math.nan})
    assert read_metrics(tmp_path / "run") == [{"step": 0, "reward/mean": 0.25},
                                              {"step": 1, "grad/norm": "inf", "kl/pi_ref": "nan"}]
    assert read_config(tmp_path / "run")["seed"] == 3
    assert not is_finished(tmp_path / "run")
    assert continuation(tmp_path / "run").state is RunState.STARTED
    final_dir(tmp_path / "run").mkdir()
    (final_dir(tmp_path / "run") / "config.json").write_text("{}")
    assert is_finished(tmp_path / "run")
    assert continuation(tmp_path / "run").state is RunState.FINISHED


def test_abandoned_metrics_are_numbered(tmp_path):
    for n in range(2):
        _write(tmp_path, cut_last=False)
        samples_path(tmp_path).write_text('{"step": 1}\n')
        (ckpt.hf_root(tmp_path) / "step_000000001").mkdir(parents=True)
        assert abandon_metrics(tmp_path).name == f"metrics.jsonl.abandoned-{n}"
        # the next attempt's samples and exports start empty: no mixed rows, no pruning of
        # its exports in favour of the abandoned attempt's later steps
        assert (tmp_path / f"samples.jsonl.abandoned-{n}").is_file()
        assert (tmp_path / f"hf.abandoned-{n}" / "step_000000001").is_dir()
    assert not metrics_path(tmp_path).exists() and not samples_path(tmp_path).exists()
    assert ckpt.hf_exports(tmp_path) == []


def _rollout(prompt, response_ids, version, reward, group):
    problem = Problem(uid=prompt, task="arithmetic", split="train", prompt=prompt, answer="7")
    return Rollout(problem=problem, group_id=group, prompt_ids=[1], response_ids=response_ids,
                   behaviour_logprobs=[-1.0] * len(response_ids), policy_version=version,
                   finish_reason="stop", reward=reward)


def test_sample_rows_are_the_first_rollouts_with_their_lag():
    batch = [_rollout("3+4=", [55], 4, 1.0, 0), _rollout("3+4=", [56, 57], 3, 0.0, 0),
             _rollout("1+1=", [50], 5, 0.0, 1)]
    rows = sample_rows(batch, step=6, trained_by=5, n=2,
                       decode=lambda r: "".join(map(chr, r.response_ids)))
    assert rows == [
        {"step": 6, "policy_version": 4, "lag": 1, "prompt": "3+4=", "response": "7",
         "reward": 1.0, "answer": "7", "finish_reason": "stop"},
        {"step": 6, "policy_version": 3, "lag": 2, "prompt": "3+4=", "response": "89",
         "reward": 0.0, "answer": "7", "finish_reason": "stop"}]
    assert tuple(rows[0]) == SAMPLE_COLUMNS
    assert len(sample_rows(batch, 6, 5, n=10, decode=str)) == 3  # at most the batch


def test_completion_text_is_the_text_vllm_gave_the_scorer():
    from cluster.tiny.char_tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()  # one id per byte: 4 + byte
    prompt = tok("12+3=")["input_ids"]
    ids = [4 + b for b in b"15"] + [tok.eos_token_id]
    assert completion_text(tok, prompt, ids) == "15"  # EOS skipped
    # a response cut inside a multi-byte character: vLLM leaves the incomplete bytes out
    cut = [4 + b for b in b"+^"] + [4 + 0xE2, 4 + 0x82]
    assert tok.decode(cut) == "+^\ufffd" and completion_text(tok, prompt, cut) == "+^"
    assert completion_text(tok, prompt, [4 + b for b in "é\nx".encode()], stop=["\n"]) == "é"


def test_hf_exports_are_atomic_kept_and_dropped_on_resume(tmp_path):
    def save_hf(directory):  # what the learner writes, minus the weights
        directory.mkdir(parents=True)
        (directory / "config.json").write_text("{}")

    (ckpt.hf_root(tmp_path) / ".partial-step_000000009").mkdir(parents=True)  # killed mid-write
    for step in (2, 4, 6):
        ckpt.write_hf_export(tmp_path, step, save_hf, keep=2)
    assert [p.name for p in ckpt.hf_exports(tmp_path)] == ["step_000000004", "step_000000006"]
    assert sorted(p.name for p in ckpt.hf_root(tmp_path).iterdir()) == [
        "step_000000004", "step_000000006"]  # the half-written export is gone
    ckpt.drop_hf_exports_after(tmp_path, 5)  # a resume from step 5 redoes step 6
    assert [p.name for p in ckpt.hf_exports(tmp_path)] == ["step_000000004"]
    ckpt.write_hf_export(tmp_path, 6, save_hf, keep=None)  # and writes it again
    assert [p.name for p in ckpt.hf_exports(tmp_path)] == ["step_000000004", "step_000000006"]


@pytest.mark.parametrize(("override", "message"), [
    ("keep_hf=2", "keep_hf=2 has no effect with hf_every=0"),
    ("keep_hf=0", "keep_hf: Input should be greater than or equal to 1"),
    ("logging.samples_per_log=0", "logging.samples_per_log: Input should be greater"),
    ("logging.samples_every=-5", "logging.samples_every: Input should be greater"),
    ("logging.wandb_entity=my team", "logging.wandb_entity: String should match"),
])
def test_bad_logging_and_export_options_fail_at_load(override, message):
    with pytest.raises(ConfigError, match=message):
        load_train_config(DEMO_CONFIG, [override])


def test_a_sweep_names_each_wandb_run_by_its_grid_point(tmp_path):
    from cluster.sweeps.sweep import load_sweep

    (tmp_path / "s.yaml").write_text(f"name: s\ntrain_config: {DEMO_CONFIG}\n"
                                     "overrides: {logging.wandb_name: same}\n"
                                     "grid: {seed: [0, 1]}\n")
    with pytest.raises(ConfigError, match="logging.wandb_name.*set by the sweep"):
        load_sweep(tmp_path / "s.yaml")


def test_every_start_records_the_klrl_version_and_git_commit(tmp_path):
    import subprocess
    import sys

    import tomllib

    from cluster.config.loader import REPO_ROOT

    version = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                          text=True, check=True).stdout.strip()
    cfg = load_train_config(DEMO_CONFIG, ["logging.wandb_mode=disabled"])
    with RunLog(cfg, tmp_path / "run"):
        pass
    with RunLog(cfg, tmp_path / "run", resume_wandb_id="abc"):  # a resume adds a line
        pass
    starts = [json.loads(line) for line in (tmp_path / "run" / "provenance.jsonl").open()]
    assert [s["resumed"] for s in starts] == [False, True]
    assert all(s["git_commit"] == head and s["klrl_version"] == version for s in starts)
    assert isinstance(starts[0]["git_dirty"], bool) and starts[0]["started_at"]

    out = subprocess.run([sys.executable, "-m", "cluster.cli", "--version"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.startswith(f"klrl {version} (git {head[:12]}")
