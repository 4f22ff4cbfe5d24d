"""Learner options without an engine: the LR schedule's exact values and its resume, the
entropy bonus's gradient against autograd of an independent entropy, eager against sdpa
attention on the tiny model, the config rules, and what cluster/ hands the learner.

The options on a real DeepSpeed engine (gradient checkpointing's gradients, a separate
reference, the schedule across a checkpoint reload, the entropy metric of a rank) are in
tests/test_learner_ranks.py, beside the runs they compare with.
"""
from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

import learner.loss as loss_mod
from kl.config import AdvantageConfig, KLConfig
from learner.batch import TrainBatch
from learner.config import LearnerConfig
from learner.loss import policy_loss, sequence_logprobs, token_entropy
from learner.loss_metrics import merge_metrics
from learner.schedule import lr_factor, make_scheduler

# ---------------------------------------------------------------------------- LR schedule

W, T, M = 2, 13, 0.1  # warm-up 2 steps, 13 optimizer steps (k = 0..12), decay to 0.1 x lr


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_lr_schedule_values_at_warmup_end_middle_and_last_step(schedule):
    """Post-warm-up steps k = 2..12: p = (k - 2) / 10, so k = 7 is the middle (p = 0.5) and
    k = 12 the run's last step (p = 1); k = 5 (p = 0.3) tells linear from cosine."""
    cfg = LearnerConfig(lr=1e-3, warmup_steps=W, lr_schedule=schedule,
                        min_lr_ratio=0.0 if schedule == "constant" else M)
    end = {"constant": 1.0, "linear": M, "cosine": M}[schedule]
    p3 = {"constant": 1.0, "linear": 1 - (1 - M) * 0.3,
          "cosine": M + (1 - M) * (1 + math.cos(0.3 * math.pi)) / 2}[schedule]
    expected = {0: 1 / 3, 1: 2 / 3,          # warm-up (k+1)/(W+1)
                2: 1.0,                      # warm-up end: the peak lr
                5: p3,
                7: 1.0 if schedule == "constant" else (1 + M) / 2,  # middle
                12: end,                     # the run's last optimizer step
                20: end}                     # past the end (a refused step shifts k): stays
    for k, factor in expected.items():
        assert lr_factor(k, cfg, T) == pytest.approx(factor, rel=1e-12, abs=1e-15), k

    # The scheduler DeepSpeed gets: step k's lr is what the optimizer holds at that step, and
    # a scheduler rebuilt from a saved state (a resume) continues exactly.
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=cfg.lr)
    sched = make_scheduler(cfg, T)(opt)
    lrs = []
    for k in range(T):
        lrs.append(opt.param_groups[0]["lr"])
        if k == 6:
            saved_opt, saved_sched = opt.state_dict(), sched.state_dict()
        opt.step()
        sched.step()
    assert lrs == pytest.approx([cfg.lr * lr_factor(k, cfg, T) for k in range(T)], rel=1e-12)
    assert saved_sched["lr_lambdas"] == [None]  # the horizon is rebuilt, never restored
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    sched2 = make_scheduler(cfg, T)(opt2)
    opt2.load_state_dict(saved_opt)
    sched2.load_state_dict(saved_sched)
    resumed = []
    for _ in range(7, T):
        opt2.step()
        sched2.step()
        resumed.append(opt2.param_groups[0]["lr"])
    assert resumed == lrs[7:]  # bit for bit


def test_decaying_schedule_needs_the_run_length():
    cfg = LearnerConfig(lr_schedule="cosine")
    with pytest.raises(ValueError, match="total_optimizer_steps"):
        make_scheduler(cfg, None)
    with pytest.raises(ValueError, match="total_optimizer_steps"):
        from learner.group import LearnerGroup  # refused before any Ray actor starts

        LearnerGroup("unused", cfg, KLConfig(), AdvantageConfig())
    assert lr_factor(5, LearnerConfig(), None) == 1.0  # constant needs no length


# ---------------------------------------------------------------------------- config rules


@pytest.mark.parametrize("kw, message", [
    ({"attn_implementation": "flash_attention_2"}, "GPU-only"),
    ({"attn_implementation": "flash_attention_2", "num_gpus_per_rank": 1}, "dtype=bfloat16"),
    ({"offload_optimizer": True, "zero_stage": 2}, "CPU learner"),
    ({"offload_param": True, "zero_stage": 3}, "CPU learner"),
    ({"offload_optimizer": True, "num_gpus_per_rank": 1}, "zero_stage >= 1"),
    ({"offload_param": True, "zero_stage": 2, "num_gpus_per_rank": 1}, "zero_stage 3"),
    ({"min_lr_ratio": 0.1}, "lr_schedule linear or cosine"),
    ({"entropy_coef": -0.1}, "greater than or equal"),
    ({"attn_implementation": "flash"}, "attn_implementation"),
])
def test_learner_option_rules(kw, message):
    with pytest.raises(ValidationError, match=message):
        LearnerConfig(**kw)


def test_offload_writes_deepspeeds_own_keys():
    cfg = LearnerConfig(num_gpus_per_rank=1, dtype="bfloat16", zero_stage=3,
                        offload_optimizer=True, offload_param=True,
                        attn_implementation="flash_attention_2")
    zero = cfg.deepspeed_config(2, 4)["zero_optimization"]
    assert zero == {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                    "offload_param": {"device": "cpu", "pin_memory": True}}
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    parsed = DeepSpeedZeroConfig(**zero)  # DeepSpeed's own parser accepts them
    assert parsed.offload_optimizer.device == "cpu" and parsed.offload_param.device == "cpu"
    assert "offload_optimizer" not in LearnerConfig(zero_stage=2).deepspeed_config(2, 1)[
        "zero_optimization"]


def test_cluster_hands_the_model_section_to_the_learner(tmp_path):
    from cluster.config.loader import DEMO_CONFIG
    from cluster.config.train_config import load_train_config
    from cluster.train.launch import learner_model_files

    cfg = load_train_config(DEMO_CONFIG, ["model.ref_path=/models/sft", "model.revision=v2",
                                          "model.trust_remote_code=true"])
    files = learner_model_files(cfg, tmp_path / "policy")
    assert files.policy == str(tmp_path / "policy") and files.reference_path == "/models/sft"
    assert files.hub_kwargs() == {"revision": "v2", "trust_remote_code": True}
    plain = learner_model_files(load_train_config(DEMO_CONFIG, []), tmp_path / "policy")
    assert plain.reference_path == plain.policy and plain.hub_kwargs() == {
        "revision": None, "trust_remote_code": False}


# ---------------------------------------------------------------------------- entropy


def _batch(lengths=((2, 4), (3, 2), (2, 5), (4, 3)), vocab=7, seed=0):
    """Right-padded sequences (prompt, response) of 2 groups of 2, fp64 logits with garbage
    at padded positions, and random advantages and sampler log-probs."""
    g = torch.Generator().manual_seed(seed)
    B, L = len(lengths), max(p + r for p, r in lengths) + 1  # one padding column at least
    ids = torch.randint(0, vocab, (B, L), generator=g)
    att = torch.zeros(B, L, dtype=torch.long)
    resp = torch.zeros(B, L, dtype=torch.bool)
    for i, (p, r) in enumerate(lengths):
        att[i, :p + r] = 1
        resp[i, p:p + r] = True
    logits = torch.randn(B, L, vocab, generator=g, dtype=torch.float64) * 2
    logits[att == 0] = 1e4  # garbage where nothing is predicted
    batch = TrainBatch(
        input_ids=ids, attention_mask=att, response_mask=resp,
        behaviour_logp=torch.where(resp, -torch.rand(B, L, generator=g), 0.0).float(),
        rewards=torch.rand(B, generator=g), advantages=torch.randn(B, generator=g),
        group_ids=torch.tensor([0, 0, 1, 1]))
    return batch, logits.requires_grad_(True)


KL_CFG = KLConfig(estimator="k3", placement="reward+loss", beta=0.1)
ADV_CFG = AdvantageConfig(estimator="rloo", normalize="group")


def _loss(batch, logits, coef, with_entropy=True, n=6.0):
    cfg = LearnerConfig(entropy_coef=coef, task_off_policy="tis")
    logp = sequence_logprobs(logits, batch.input_ids)
    ent = token_entropy(logits, batch.response_mask, grad=coef > 0) if with_entropy else None
    ref = (logp.detach() - 0.3).where(batch.response_mask, 0.0)
    return policy_loss(logp, ref, batch, KL_CFG, ADV_CFG, cfg, n, entropy=ent)


def test_entropy_bonus_gradient_matches_autograd_of_an_independent_entropy():
    """loss(c) - loss(0) = -c sum_{response t} H_t / N, and its gradient with respect to the
    logits is autograd's of the same sum computed by torch.distributions, and the closed form
    dH/dz_v = -p_v (log p_v + H) at each response position (learner/loss.py)."""
    batch, logits = _batch()
    c, n = 0.37, 6.0
    mask = batch.response_mask
    # Independent: Categorical entropy of the logits that predict each response token.
    pred = logits[:, :-1][mask[:, 1:]]
    h_ref = torch.distributions.Categorical(logits=pred).entropy()
    (g_ref,) = torch.autograd.grad(-c * h_ref.sum() / n, logits)

    loss_c, m_c = _loss(batch, logits, c, n=n)
    loss_0, m_0 = _loss(batch, logits, 0.0, n=n)
    (g_diff,) = torch.autograd.grad(loss_c - loss_0, logits)
    torch.testing.assert_close(g_diff, g_ref, rtol=1e-10, atol=1e-12)
    h = h_ref.detach()
    assert float((loss_c - loss_0).detach()) == pytest.approx(float(-c * h.sum() / n), rel=1e-12)

    p = torch.softmax(pred.detach(), -1)
    closed = -p * (torch.log(p) + h[:, None])  # dH/dz
    torch.testing.assert_close(g_ref[:, :-1][mask[:, 1:]], -c / n * closed, rtol=1e-10, atol=1e-12)
    assert g_diff[:, -1].abs().max() == 0 and g_diff[:, :-1][~mask[:, 1:]].abs().max() == 0

    # The metric: mean over response tokens; the bonus term reported as a loss part.
    assert m_c["policy/entropy"] == pytest.approx(float(h.mean()), rel=1e-12)
    assert m_0["policy/entropy"] == m_c["policy/entropy"]
    assert m_c["loss/entropy"] == pytest.approx(float(-c * h.sum() / n), rel=1e-12)
    assert "loss/entropy" not in m_0


def test_entropy_coef_zero_changes_nothing_but_the_metric():
    batch, logits = _batch(seed=1)
    loss_a, m_a = _loss(batch, logits, 0.0, with_entropy=True)
    loss_b, m_b = _loss(batch, logits, 0.0, with_entropy=False)
    (ga,) = torch.autograd.grad(loss_a, logits)
    (gb,) = torch.autograd.grad(loss_b, logits)
    assert torch.equal(loss_a, loss_b) and torch.equal(ga, gb)
    assert m_a.pop("policy/entropy") > 0 and m_a == m_b
    with pytest.raises(ValueError, match="entropy"):
        _loss(batch, logits, 0.1, with_entropy=False)


def test_entropy_metric_chunks_and_merges_token_weighted(monkeypatch):
    """The no-grad path (chunked) gives the differentiable path's values; micro-batches with
    different token counts merge to the whole batch's per-token mean."""
    batch, logits = _batch(seed=2)
    full = token_entropy(logits, batch.response_mask, grad=True)
    monkeypatch.setattr(loss_mod, "_ENTROPY_CHUNK", 3)
    chunked = token_entropy(logits, batch.response_mask, grad=False)
    assert not chunked.requires_grad and torch.equal(chunked, full.detach())
    assert torch.equal(full[~batch.response_mask], torch.zeros_like(full[~batch.response_mask]))
    logits32 = logits.detach().float()
    assert token_entropy(logits32, batch.response_mask, grad=False).dtype == torch.float32

    whole = _loss(batch, logits, 0.2)[1]
    parts = []
    for rows in (torch.tensor([0, 1]), torch.tensor([2, 3])):  # whole groups: 6 and 8 tokens
        sub = batch.select(rows)
        parts.append(_loss(sub, logits[rows][:, :sub.width], 0.2)[1])
    assert parts[0]["response/tokens"] != parts[1]["response/tokens"]
    merged = merge_metrics(parts)
    assert merged["policy/entropy"] == pytest.approx(whole["policy/entropy"], rel=1e-12)
    assert merged["loss/entropy"] == pytest.approx(whole["loss/entropy"], rel=1e-12)


# ---------------------------------------------------------------------------- attention


def test_eager_and_sdpa_attention_give_the_same_logprobs(tiny_model_dir):
    """Both kernels on the tiny model, through the learner's loader, on a right-padded batch:
    equal log-probs and entropies at every attended position (fp32 on CPU)."""
    from learner.loading import ModelFiles, load_causal_lm

    files = ModelFiles(policy=str(tiny_model_dir))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 200, (3, 12), generator=g)
    att = torch.ones_like(ids)
    att[1, 7:] = 0
    att[2, 4:] = 0
    resp = att.bool().clone()
    resp[:, :2] = False
    out = {}
    for kernel in ("eager", "sdpa"):
        model = load_causal_lm(files.policy, files, LearnerConfig(attn_implementation=kernel))
        assert model.config._attn_implementation == kernel
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=att, use_cache=False).logits
        out[kernel] = (sequence_logprobs(logits, ids), token_entropy(logits, resp, grad=False))
    real = att.bool()
    for a, b in zip(out["eager"], out["sdpa"]):
        torch.testing.assert_close(a[real], b[real], rtol=1e-5, atol=2e-6)
    assert out["eager"][0][real].abs().max() > 1  # log-probs of a real model, not zeros


def test_a_decaying_schedule_needs_steps_after_warm_up():
    from pathlib import Path

    from cluster.config.loader import ConfigError, load_config
    from cluster.config.train_config import TrainConfig

    TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.yaml"
    for warmup in (10, 9):  # step 9 is the last: a decay from it to itself is no decay
        with pytest.raises(ConfigError, match="leaves none of the run's 10 optimizer steps"):
            load_config(TrainConfig, TINY, ["total_steps=10", f"learner.warmup_steps={warmup}",
                                            "learner.lr_schedule=cosine"])
    load_config(TrainConfig, TINY, ["total_steps=10", "learner.warmup_steps=8",
                                    "learner.lr_schedule=cosine"])
    load_config(TrainConfig, TINY, ["total_steps=10", "learner.warmup_steps=10"])  # constant


def test_ranks_build_deepspeeds_ops_with_their_installations_ninja_into_its_own_cache(
        monkeypatch):
    """Whatever PATH a rank's process was started with (a Ray node started from an activated
    virtual environment or not), DeepSpeed's JIT op build finds the `ninja` installed beside
    the interpreter (the wheel DeepSpeed depends on) and builds into a cache directory of this
    installation: a system ninja of another version, or another installation's torch headers,
    read a shared op cache as built by another command and rebuild it, about a minute of both
    cores (learner/process_group.py). A TORCH_EXTENSIONS_DIR the user set is kept."""
    import os
    import shutil
    import sys

    from torch.utils.cpp_extension import get_default_build_root

    from learner.process_group import build_ops_for_this_installation

    beside = os.path.join(os.path.dirname(sys.executable), "ninja")
    assert os.path.isfile(beside), "DeepSpeed's ninja dependency is not installed"
    monkeypatch.setenv("PATH", os.pathsep.join(["/usr/local/bin", "/usr/bin", "/bin"]))
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    build_ops_for_this_installation()
    assert shutil.which("ninja") == beside
    ours = os.environ["TORCH_EXTENSIONS_DIR"]
    assert os.path.dirname(ours) == get_default_build_root()
    monkeypatch.setattr(sys, "prefix", sys.prefix + "-another")
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    build_ops_for_this_installation()  # another installation: another directory
    assert os.environ["TORCH_EXTENSIONS_DIR"] not in (ours, get_default_build_root())
    assert os.environ["PATH"].split(os.pathsep).count(os.path.dirname(beside)) == 1  # not grown
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/somewhere/chosen")
    build_ops_for_this_installation()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == "/somewhere/chosen"


def test_buffers_of_killed_groups_are_removed_and_live_or_new_ones_kept(tmp_path):
    """remove_orphaned_shm_buffers: an old all-reduce buffer no process maps (a group killed
    outright) goes; one a live process maps, one just created, and any other file stay."""
    import os
    import subprocess
    import sys
    import time

    from learner.process_group import SHM_BUFFER_PREFIX, remove_orphaned_shm_buffers

    def buffer(name: str, age_s: float):
        path = tmp_path / f"{SHM_BUFFER_PREFIX}{os.getuid()}_127.0.0.1_{name}_0"
        path.write_bytes(b"\0" * 4096)
        os.utime(path, (time.time() - age_s,) * 2)
        return path

    orphan, live, new = buffer("1", 3600), buffer("2", 3600), buffer("3", 1)
    other = tmp_path / "not_a_buffer"
    other.write_bytes(b"x")
    holder = subprocess.Popen([sys.executable, "-c", (
        "import mmap, sys; f = open(sys.argv[1], 'r+b'); m = mmap.mmap(f.fileno(), 0); "
        "print('mapped', flush=True); sys.stdin.read()"), str(live)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "mapped"
        removed = remove_orphaned_shm_buffers(min_age_s=600, shm_dir=tmp_path)
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert removed == [orphan]
    assert not orphan.exists() and live.exists() and new.exists() and other.exists()
