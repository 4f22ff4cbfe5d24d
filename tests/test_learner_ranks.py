"""The DeepSpeed learner for real: Ray actors on loopback, gloo, the tiny random Qwen2.

Two ranks must make the same update as one rank on the same global batch, for ZeRO stage 0
and stage 3 (with micro-batches); a batch with a NaN advantage on one rank only is refused by
every rank and is a true no-op (weights, Adam moments and LR schedule untouched: the runs
with and without it end equal); checkpoints restore optimizer and scheduler state.

Why the optimizer settings below: AdamW's default update lr * m / (sqrt(v) + 1e-8) and
gradient clipping are both (nearly) invariant to the gradient's scale, so with them a rank
that got the gradient scaling wrong (say, forgot that DeepSpeed averages over ranks) would
still produce almost the same weights. With adam_eps = 1 the update is ~ lr * g, linear in
the gradient, and the clip (1e3) never binds, so equal weights mean equal gradients.

Tolerance (fp32): after each step the two runs' parameters agree per element to
|a - b| <= 2e-7 + 1e-6 |b| (2 fp32 ulps at |p| = 1; observed <= 1.2e-7), and the updates'
relative difference ||d1 - d2|| / ||d1|| is below 1e-5 (observed ~6e-7). The runs differ
only in summation order (each rank sums half the batch, gloo sums the halves). Pre-clip
gradient norms agree to 1e-5 relative.
"""
from __future__ import annotations

import math

import pytest
import torch

import kl
from actors.records import Rollout
from cluster.train.batching import pad_rollouts
from kl.config import AdvantageConfig, KLConfig
from learner.config import LearnerConfig

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

RTOL, ATOL = 1e-6, 2e-7
REL_UPDATE = 1e-5
GROUPS, SAMPLES = 4, 2  # 8 sequences: 4 per rank with 2 ranks, 2 per micro-batch
KL_CFG = KLConfig(estimator="k3", placement="reward+loss", importance="prefix", truncate=2.0, beta=0.1)
ADV_CFG = AdvantageConfig(estimator="rloo", normalize="group")


@pytest.fixture(scope="module")
def ray_local(ray_cluster):
    yield


@pytest.fixture(scope="module")
def batches(tiny_model_dir):
    """(good, poisoned) TrainBatches from hand-made rollouts of arithmetic prompts.

    Responses are sampled from the model itself at temperature 1, with their log-probs as
    the behaviour log-probs (what vLLM reports with exact weights), so the first step's
    learner/behaviour ratios must be 1. Rewards are hand-set so the advantages are non-zero.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import rewards

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    problems = rewards.get_task("arithmetic").problems("train", GROUPS, seed=3)
    g = torch.Generator().manual_seed(0)
    hand_rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0]
    rollouts = []
    for i in range(GROUPS * SAMPLES):
        p = problems[i // SAMPLES]
        ids = tok(p.prompt)["input_ids"]
        prompt_len, resp_logp = len(ids), []
        for _ in range(3 + 2 * i % 7):  # response lengths 3..9: padding differs per sequence
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            lp = torch.log_softmax(logits, -1)
            nxt = int(torch.multinomial(lp.exp(), 1, generator=g))
            ids.append(nxt)
            resp_logp.append(float(lp[nxt]))
        rollouts.append(Rollout(problem=p, group_id=i // SAMPLES, prompt_ids=ids[:prompt_len],
                                response_ids=ids[prompt_len:], behaviour_logprobs=resp_logp,
                                policy_version=0, finish_reason="length", reward=hand_rewards[i]))
    r = torch.tensor([x.reward for x in rollouts], dtype=torch.float64)
    adv = kl.compute_advantages(r, torch.tensor([x.group_id for x in rollouts]),
                                estimator=ADV_CFG.estimator, normalize=ADV_CFG.normalize)
    good = pad_rollouts(rollouts, adv, pad_id=tok.pad_token_id)
    nan_adv = adv.clone()
    nan_adv[-1] = float("nan")  # the last group: only rank 1's shard has it
    return good, pad_rollouts(rollouts, nan_adv, pad_id=tok.pad_token_id)


def _cfg(**kw) -> LearnerConfig:
    base = {"lr": 0.1, "adam_eps": 1.0, "grad_clip": 1e3, "warmup_steps": 2,  # see the docstring
            "task_off_policy": "tis", "num_cpus_per_rank": 1}
    return LearnerConfig(**(base | kw))


def _params(group) -> dict[str, torch.Tensor]:
    return group.named_parameters_for_inference()


def _run(model_dir, cfg, steps, tmp=None):
    """Run `steps` ("good", "nan", "save", "load") on a fresh group; return parameter
    snapshots (index 0: initial, then one per step), metrics and versions."""
    from actors.weight_sync import WeightPublisher
    from learner.group import LearnerGroup

    good, poisoned = steps.batches
    group = LearnerGroup(model_dir, cfg, KL_CFG, ADV_CFG, seed=0, run_id="test",
                         publisher=WeightPublisher())
    try:
        snaps, metrics, versions = [_params(group)], [], [group.version]
        for action in steps.actions:
            if action in ("good", "nan"):
                metrics.append(group.train_step(good if action == "good" else poisoned))
            elif action == "save":
                group.save_checkpoint(tmp / "ckpt", tag="step1")
            elif action == "load":
                group.load_checkpoint(tmp / "ckpt", tag="step1")
            snaps.append(_params(group))
            versions.append(group.version)
        extra = steps.extra(group) if steps.extra else None
    finally:
        group.shutdown()
    return snaps, metrics, versions, extra


class _Steps:
    def __init__(self, batches, actions, extra=None):
        self.batches, self.actions, self.extra = batches, actions, extra


def _assert_same_update(p0, a, b):
    num = den = 0.0
    for name in p0:
        torch.testing.assert_close(a[name], b[name], rtol=RTOL, atol=ATOL,
                                   msg=lambda m, n=name: f"{n}: {m}")
        da, db = a[name].double() - p0[name].double(), b[name].double() - p0[name].double()
        num += float((da - db).square().sum())
        den += float(da.square().sum())
    assert den > 0, "the weights did not change"
    assert math.sqrt(num / den) <= REL_UPDATE, f"relative update difference {math.sqrt(num / den):.3g}"


def _assert_same_metrics(ms1, ms2):
    for m1, m2 in zip(ms1, ms2, strict=True):
        assert m2["grad/norm"] == pytest.approx(m1["grad/norm"], rel=1e-5)
        for key in ("loss/total", "loss/kl", "kl/pi_ref", "kl/mu_ref", "is/ratio_min", "is/ratio_max"):
            assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-6), key
        for key in ("response/tokens", "response/sequences", "lr", "is/truncated_frac"):
            assert m2[key] == m1[key], key


def _assert_equal_params(a, b):
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _export_and_save(tmp, transport):
    """After the run: publish through `transport`, fetch what a worker would receive (before
    the group, which owns an object_store ref, is shut down) and save the HF model."""
    def run(group):
        import time

        from actors.weight_sync import fetch, load_tensors

        update = group.export_weights(transport, shm_dir=str(tmp / "shm"))
        sent = load_tensors(fetch(update, time.monotonic() + 60))
        return update, sent, group.save_hf(tmp / "hf")
    return run


def _check_export_and_save(final, extra, transport, model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    update, sent, hf_dir = extra
    assert update.transport == transport
    assert "lm_head.weight" in sent and sent.keys() == final.keys()
    _assert_equal_params(final, sent)
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    _assert_equal_params(final, dict(model.named_parameters(remove_duplicate=False)))
    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    original = AutoTokenizer.from_pretrained(str(model_dir))
    assert tok("1+2=")["input_ids"] == original("1+2=")["input_ids"]


# ---------------------------------------------------------------------------- ZeRO stage 0


@pytest.fixture(scope="module")
def stage0(ray_local, tiny_model_dir, batches, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stage0")
    one = _run(tiny_model_dir, _cfg(num_ranks=1), _Steps(batches, ["good", "good", "good"],
                                                         extra=_export_and_save(tmp, "shm")))
    two = _run(tiny_model_dir, _cfg(num_ranks=2), _Steps(batches, ["good", "good", "nan", "good"]))
    return one, two, tmp


def test_stage0_two_ranks_equal_one_rank(stage0):
    (s1, m1, v1, _), (s2, m2, v2, _), _ = stage0
    p0 = s1[0]
    _assert_equal_params(p0, s2[0])
    _assert_same_update(p0, s1[1], s2[1])      # first step
    _assert_same_update(p0, s1[3], s2[4])      # three applied steps, one refused in between
    _assert_same_metrics(m1, [m2[0], m2[1], m2[3]])
    assert v1 == [0, 1, 2, 3] and v2 == [0, 1, 2, 2, 3]


def test_first_step_ratios_are_one_and_weights_move(stage0):
    (s1, m1, _, _), (_, m2, _, _), _ = stage0
    for m in (m1[0], m2[0]):
        assert abs(m["is/ratio_min"] - 1) < 1e-4 and abs(m["is/ratio_max"] - 1) < 1e-4
        assert m["nonfinite"] == 0 and math.isfinite(m["grad/norm"]) and m["grad/norm"] > 0
        assert m["lr"] == pytest.approx(0.1 / 3)  # warm-up: step k uses lr (k+1)/(warmup+1)
    assert m1[2]["lr"] == pytest.approx(0.1)
    assert m1[1]["kl/pi_ref"] != 0  # the second step sees a KL to the reference
    assert any(not torch.equal(s1[0][n], s1[1][n]) for n in s1[0])


def test_nan_on_one_rank_is_refused_by_all(stage0):
    _, (s2, m2, v2, _), _ = stage0
    assert m2[2]["nonfinite"] == 1 and not math.isfinite(m2[2]["grad/norm"])
    assert v2[3] == v2[2]
    _assert_equal_params(s2[2], s2[3])


def test_export_shm_and_save_hf(stage0, tiny_model_dir):
    (s1, _, v1, extra), _, _ = stage0
    assert extra[0].version == v1[-1] == 3
    _check_export_and_save(s1[-1], extra, "shm", tiny_model_dir)


# ---------------------------------------------------------------------------- ZeRO stage 3


@pytest.fixture(scope="module")
def stage3(ray_local, tiny_model_dir, batches, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stage3")
    one = _run(tiny_model_dir, _cfg(num_ranks=1, zero_stage=3), _Steps(batches, ["good", "good"]))
    # 2 ranks x 2 micro-batches of 2; checkpoint after step 1, refuse a NaN step, restore the
    # checkpoint and redo step 2: it must land where the one-rank run's step 2 did.
    two = _run(tiny_model_dir, _cfg(num_ranks=2, zero_stage=3, micro_batch_size=2),
               _Steps(batches, ["good", "save", "good", "nan", "load", "good"],
                      extra=_export_and_save(tmp, "object_store")), tmp=tmp)
    return one, two


def test_stage3_two_ranks_with_micro_batches_equal_one_rank(stage3):
    (s1, m1, v1, _), (s2, m2, v2, _) = stage3
    p0 = s1[0]
    _assert_equal_params(p0, s2[0])
    _assert_same_update(p0, s1[1], s2[1])
    _assert_same_update(p0, s1[2], s2[3])      # step 2 before the checkpoint reload
    _assert_same_update(p0, s1[2], s2[6])      # and after it: optimizer + scheduler restored
    assert m2[2]["nonfinite"] == 1             # train_step metrics: good, good, nan, good
    _assert_same_metrics(m1, [m2[0], m2[1]])
    _assert_same_metrics(m1[1:], [m2[3]])
    _assert_equal_params(s2[3], s2[4])         # refused under ZeRO-3 too
    _assert_equal_params(s2[1], s2[5])         # reloaded step-1 weights exactly
    assert v1 == [0, 1, 2] and v2 == [0, 1, 1, 2, 2, 1, 2]


def test_stage3_gathers_weights_for_export_and_save_hf(stage3, tiny_model_dir):
    _, (s2, _, v2, extra) = stage3
    assert extra[0].version == v2[-1] == 2
    _check_export_and_save(s2[-1], extra, "object_store", tiny_model_dir)


# ------------------------------------------------------- group statistics, several updates


@pytest.fixture(scope="module")
def micro_and_updates(ray_local, tiny_model_dir, batches, stage0):
    """One step with micro-batches of one sequence (every group of 2 cut in half), and one
    step of 2 epochs x 2 mini-batches, on the same batch as stage0's one-rank run."""
    micro = _run(tiny_model_dir, _cfg(num_ranks=1, micro_batch_size=1), _Steps(batches, ["good"]))
    updates = _run(tiny_model_dir, _cfg(num_ranks=1, epochs=2, mini_batches=2),
                   _Steps(batches, ["good", "good"]))
    return micro, updates


def test_micro_batches_that_cut_groups_make_the_whole_batch_update(stage0, micro_and_updates):
    """KL_CFG has a KL reward with an RLOO baseline over each group: micro-batches of 1 must
    still make exactly the whole-shard step (before, RLOO raised on a 1-sample group)."""
    (s1, m1, _, _), _, _ = stage0
    (sm, mm, vm, _), _ = micro_and_updates
    _assert_same_update(s1[0], s1[1], sm[1])
    _assert_same_metrics(m1[:1], mm)
    assert vm == [0, 1]


def test_several_updates_per_batch_move_the_ratios_after_the_first(micro_and_updates):
    _, (_, mu, vu, _) = micro_and_updates
    first = mu[0]
    for key in ("update_0/is/ratio_min", "update_0/is/ratio_max"):
        assert abs(first[key] - 1) < 1e-4, key  # update 0 trains on its own samples
    for k in (1, 2, 3):  # later updates: weights have moved since the data was sampled
        assert max(abs(first[f"update_{k}/is/ratio_min"] - 1),
                   abs(first[f"update_{k}/is/ratio_max"] - 1)) > 1e-3, k
    assert first["response/sequences"] == GROUPS * SAMPLES  # one pass over the batch
    assert first["nonfinite/updates_refused"] == 0 and vu == [0, 1, 2]  # version: batches
