"""End to end with real components: Ray on loopback, a vLLM engine, a DeepSpeed learner.

Small runs of the real entry point (`cluster.train.run.train`) on the tiny random model, at
max_lag 0 and max_lag 2; they check the lag bound, the importance ratios (at max_lag 0 the
learner's log-probs must equal the sampler's: that checks weight sync end to end), that
weights change, the run directory, the final Hugging Face model, the samples table (in
samples.jsonl and wandb's offline files) and the periodic Hugging Face exports (hf/).
"""
import json
import os
import re
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from scorers import short_answers
from wandb_records import config as wandb_config

from cluster.config.loader import DEMO_CONFIG
from cluster.config.train_config import load_train_config
from cluster.train import checkpoint as ckpt
from cluster.train.run import train
from cluster.train.run_log import FILTER_KEYS, SAMPLE_COLUMNS, read_metrics, read_samples

pytestmark = pytest.mark.slow

REQUIRED = ("step", "policy_version", "lag/max", "reward/mean", "kl/pi_ref", "is/ratio_min",
            "is/ratio_max", "time/step")


@pytest.fixture(scope="module", autouse=True)
def _ray(ray_cluster):  # the runs share the session's cluster (a run joins a running one)
    pass


def _run(tiny_model_dir, out, name, steps, lag, *extra):
    cfg = load_train_config(DEMO_CONFIG, ["task.reward=scorers:short_answers",
        f"model.path={tiny_model_dir}", f"output_dir={out}", f"run_name={name}",
        f"total_steps={steps}", f"max_lag={lag}", "eval_every=2", "eval.num_problems=16",
        "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "learner.lr=1e-3",
        "logging.wandb_mode=offline", *extra])
    run_dir, _ = train(cfg)
    return run_dir, read_metrics(run_dir)


def _params(model_dir: Path) -> dict:
    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out |= load_file(f)
    return out


@pytest.fixture(scope="module")
def lag0(tiny_model_dir, tmp_path_factory):
    return _run(tiny_model_dir, tmp_path_factory.mktemp("runs"), "lag0", 3, 0,
                "logging.samples_every=2", "logging.samples_per_log=6", "hf_every=1",
                "keep_hf=2", "logging.wandb_entity=klrl-tests", "logging.wandb_name=lag zero")


@pytest.fixture(scope="module")
def lag2(tiny_model_dir, tmp_path_factory):
    # with DAPO's overlong recipe on (docs/long-responses.md): its metrics come through the
    # real controller; what it does to the loss is tests/test_overlong.py's. And packed
    # micro-batches under a token budget of 40 (sequences of at most 12 + 6 tokens: several
    # micro-batches a step, cutting groups): the same step as padded is
    # tests/test_packing.py's, here the real trainer runs them
    return _run(tiny_model_dir, tmp_path_factory.mktemp("runs"), "lag2", 6, 2,
                "task.overlong.buffer=2", "task.overlong.mask_truncated=true",
                "data.max_prompt_length=12", "learner.token_budget=40", "learner.packing=true")


def test_lag0_metrics_and_exact_sync(lag0):
    run_dir, metrics = lag0
    steps = [m for m in metrics if m["step"] > 0]
    assert [m["step"] for m in steps] == [1, 2, 3]
    for m in steps:
        assert all(k in m for k in REQUIRED), set(REQUIRED) - set(m)
        assert m["policy_version"] == m["step"] and m["lag/max"] == 0
        # on-policy and synced: learner/sampler probability ratios are 1 up to fp32 noise
        assert abs(m["is/ratio_min"] - 1) < 1e-3 and abs(m["is/ratio_max"] - 1) < 1e-3, m
        # every token is fresh (sampled by the weights trained): both means read the same
        assert m["is/fresh_tokens"] == m["response/tokens"] > 0
        assert m["is/abs_log_ratio_fresh_token_mean"] == pytest.approx(
            m["is/abs_log_ratio_token_mean"])
    evals = [m for m in metrics if "eval/in_domain/accuracy" in m]
    assert [m["step"] for m in evals] == [0, 2, 3]
    assert all(0 <= m["eval/out_of_domain/accuracy"] <= 1 for m in evals)
    assert all(0 <= m["eval/in_domain/sampled_accuracy"] <= 1 for m in evals)
    # task.reward scores the evaluations of the training task too, beside their accuracy
    assert all(0 <= m[f"eval/{s}/{k}"] <= 1 for m in evals for s in ("in_domain", "out_of_domain")
               for k in ("reward", "sampled_reward"))
    assert (run_dir / "config.yaml").is_file()
    # the README's table of a run's outputs names everything the run wrote (issue 48)
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    listed = set(re.findall(r"^\| `([\w.]+/?)` \|", readme, re.MULTILINE))
    written = {p.name + "/" if p.is_dir() else p.name for p in run_dir.iterdir()}
    assert written <= listed and {"provenance.jsonl", "hf/", "final/"} <= written, written - listed


def test_weights_change_and_final_model_loads(lag0, tiny_model_dir):
    run_dir, _ = lag0
    final = run_dir / "final"
    before, after = _params(Path(tiny_model_dir)), _params(final)
    assert set(before) <= set(after) | {"lm_head.weight"}
    changed = [k for k in before if k in after and not torch.equal(before[k], after[k])]
    assert len(changed) > len(before) // 2, "training did not move the weights"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoTokenizer.from_pretrained(final)
    AutoModelForCausalLM.from_pretrained(final)
    umask = os.umask(0)
    os.umask(umask)
    modes = {f.name: f.stat().st_mode & 0o777 for f in final.iterdir()}
    assert modes["model.safetensors"] == 0o666 & ~umask, modes  # safetensors alone writes 0600
    assert set(modes.values()) == {0o666 & ~umask}


def test_samples_table_in_samples_jsonl_and_wandb(lag0):
    run_dir, _ = lag0
    rows = read_samples(run_dir)
    assert len(rows) == 6 and all(tuple(row) == SAMPLE_COLUMNS for row in rows)
    # samples_every=2 over 3 steps: step 2 only, trained by version 1 from its own samples
    assert {(r["step"], r["policy_version"], r["lag"]) for r in rows} == {(2, 1, 0)}
    # the first rollouts of the batch: a whole group of 4 samples of one prompt, then the next
    assert len({(r["prompt"], r["answer"]) for r in rows[:4]}) == 1
    assert rows[4]["prompt"] != rows[0]["prompt"]
    assert any(r["response"] for r in rows)
    assert {r["finish_reason"] for r in rows} <= {"stop", "length"}
    # the response text is the one scored: the run's scorer gives each row its reward
    assert [r["reward"] for r in rows] == [short_answers(r["response"], None) for r in rows]
    tables = list((run_dir / "wandb").glob("offline-run-*/files/media/table/samples_*.table.json"))
    assert len(tables) == 1, tables
    table = json.loads(tables[0].read_text())
    assert table["columns"] == list(SAMPLE_COLUMNS)
    assert table["data"] == [[r[c] for c in SAMPLE_COLUMNS] for r in rows]
    run = _wandb_run_record(run_dir)
    assert (run.entity, run.display_name) == ("klrl-tests", "lag zero")
    # the KL setting, lag and seed as flat config keys, to filter and group runs by in wandb
    logged = wandb_config(run)
    assert {k: logged[k] for k in FILTER_KEYS} == {"estimator": "k1", "placement": "reward",
                                                   "importance": "none", "beta": 0.05,
                                                   "lag": 0, "seed": 0}
    assert logged["kl"]["estimator"] == "k1"  # beside the nested config, which stays whole


def _wandb_run_record(run_dir: Path):
    """The run record of the offline wandb run's log (run-ID.wandb: a 7-byte header, then
    leveldb-log chunks of protobuf `Record`s in 32 KiB blocks), as wandb would upload it."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = next((run_dir / "wandb").glob("offline-run-*/run-*.wandb")).read_bytes()
    pos, block, record = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header: padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        record += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            parsed = pb.Record()
            parsed.ParseFromString(record)
            if parsed.WhichOneof("record_type") == "run":
                return parsed.run
            record = b""
    raise AssertionError(f"no run record in {run_dir}/wandb")


def test_hf_exports_every_step_keep_the_newest_and_load(lag0):
    run_dir, _ = lag0
    final = run_dir / "final"
    exports = ckpt.hf_exports(run_dir)  # hf_every=1, keep_hf=2: step 1's export was pruned
    assert [p.name for p in exports] == ["step_000000002", "step_000000003"]
    assert sorted(p.name for p in (run_dir / "hf").iterdir()) == [p.name for p in exports]
    step2, step3 = exports
    assert sorted(f.name for f in step3.iterdir()) == sorted(f.name for f in final.iterdir())
    # the same learner weights as final/ at the last step, and other ones a step earlier
    a, b, c = _params(step2), _params(step3), _params(final)
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(b[k], c[k]) for k in b)
    assert not all(torch.equal(a[k], b[k]) for k in a)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoTokenizer.from_pretrained(step2)
    AutoModelForCausalLM.from_pretrained(step2)
    umask = os.umask(0)
    os.umask(umask)
    assert {f.stat().st_mode & 0o777 for f in step2.iterdir()} == {0o666 & ~umask}


def test_lag2_is_asynchronous_and_bounded(lag2):
    _, metrics = lag2
    steps = [m for m in metrics if m["step"] > 0]
    lags = [m["lag/max"] for m in steps]
    assert max(lags) <= 2, lags
    assert max(lags) == 2, f"the pipeline never ran 2 versions ahead: {lags}"
    assert all(m["lag/dropped_total"] == 0 for m in steps)
    # off-policy data: the learner's policy has moved away from the sampler's
    stale = [m for m in steps if m["lag/max"] > 0]
    assert any(abs(m["is/ratio_max"] - 1) > 1e-3 or abs(m["is/ratio_min"] - 1) > 1e-3
               for m in stale)
    # lagged batches hold no token of the trained weights: no fresh reading to merge in
    all_lagged = [m for m in steps if m["lag/max"] == m["lag/mean"] > 0]
    assert all_lagged and all(m["is/fresh_tokens"] == 0 for m in all_lagged)
    # the overlong recipe's per-step readings: a share, a non-positive mean penalty (the
    # last 2 of the 6-token budget), and no more masked samples than the 16 of a step
    for m in steps:
        assert 0.0 <= m["rollout/truncated_frac"] <= 1.0
        assert -1.0 <= m["reward/overlong_penalty"] <= 0.0
        assert m["task/masked_truncated"] == round(16 * m["rollout/truncated_frac"])


def test_the_wandb_workspace_plots_metric_keys_klrl_logs(lag0, lag2):
    """Every curve of the workspace (cluster/publish/workspace.py) is a metric a real run
    logs: a renamed metric would leave an empty panel in every researcher's dashboard. Only
    the evaluation sets these runs do not have (far out-of-domain, retained) may be missing."""
    pytest.importorskip("wandb_workspaces", reason="the `dashboard` extra is not installed")
    from cluster.analysis.runs import ACCURACY_KEYS
    from cluster.publish.workspace import CURVES, build_workspace, logged_keys

    logged = logged_keys(lag0[0]) | logged_keys(lag2[0])
    wanted = {k for _, panels in CURVES for _, keys in panels for k in keys}
    unevaluated = {k for k, _ in ACCURACY_KEYS
                   if "/far_out_of_domain/" in k or "/retained/" in k}
    assert wanted - logged <= unevaluated, wanted - logged - unevaluated
    workspace = build_workspace("team", "project", None, logged)
    plotted = {k for s in workspace.sections for p in s.panels for k in getattr(p, "y", [])}
    assert plotted == wanted - unevaluated
