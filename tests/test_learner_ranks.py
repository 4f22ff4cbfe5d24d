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
|a - b| <= 2e-7 + 1e-6 |b| (2 fp32 ulps at |p| = 1), and the updates' relative difference
||d1 - d2|| / ||d1|| is below 1e-5, with room for rounding: the runs differ only in
summation order (each rank sums half the batch, gloo sums the halves). Pre-clip
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
KL_CFG = KLConfig(estimator="k3", placement="reward+loss", importance="prefix", truncate=2.0,
                  beta=0.1)
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


def _run(model_dir, cfg, steps, tmp=None, total_optimizer_steps=None):
    """Run `steps` ("good", "nan", "save", "load") on a fresh group; return parameter
    snapshots (index 0: initial, then one per step), metrics and versions. `model_dir`: a
    directory or a learner.loading.ModelFiles."""
    from actors.config import SyncConfig
    from actors.weight_sync import WeightPublisher
    from learner.group import LearnerGroup

    good, poisoned = steps.batches
    sync = SyncConfig(shm_dir=str(tmp / "shm")) if tmp is not None else SyncConfig()
    group = LearnerGroup(model_dir, cfg, KL_CFG, ADV_CFG, seed=0,
                         publisher=WeightPublisher("test", sync),
                         total_optimizer_steps=total_optimizer_steps)
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
    difference = math.sqrt(num / den)
    assert difference <= REL_UPDATE, f"relative update difference {difference:.3g}"


def _assert_same_metrics(ms1, ms2):
    for m1, m2 in zip(ms1, ms2, strict=True):
        assert m2["grad/norm"] == pytest.approx(m1["grad/norm"], rel=1e-5)
        for key in ("loss/total", "loss/kl", "kl/pi_ref", "kl/mu_ref", "is/ratio_min",
                    "is/ratio_max"):
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

        from actors.weight_sync import load_tensors
        from actors.weight_sync import transport as transport_named

        update = group.export_weights(transport)  # shm: into tmp/shm, the group's publisher's
        fetched = transport_named(update.transport).fetch(update, time.monotonic() + 60)
        sent = load_tensors(fetched.source)
        return update, sent, group.save_hf(tmp / "hf")
    return run


def _check_export_and_save(final, extra, transport, model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    update, sent, hf_dir = extra[:3]
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
                                                         extra=_export_and_save(tmp, "shm")),
               tmp)  # the shm files go into tmp/shm
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
    # 2 ranks, packed micro-batches under a token budget of 25 (rank 0's sequences of 9, 11,
    # 14 and 16 tokens make 3 of them, rank 1's of 11, 13, 15 and 10 make 2, which it splits
    # into 3 so that both ranks make the same ZeRO-3 forwards), with gradient checkpointing on
    # the policy; checkpoint after step 1, refuse a NaN step, restore the checkpoint and redo
    # step 2: it must land where the one-rank run's step 2 (padded, whole shard, without
    # gradient checkpointing) did.
    export = _export_and_save(tmp, "object_store")
    two = _run(tiny_model_dir, _cfg(num_ranks=2, zero_stage=3, token_budget=25, packing=True,
                                    gradient_checkpointing=True),
               _Steps(batches, ["good", "save", "good", "nan", "load", "good"],
                      extra=lambda group: (*export(group), group.rank_info)), tmp=tmp)
    return one, two


def test_stage3_two_ranks_with_micro_batches_equal_one_rank(stage3):
    """...with packed micro-batches under a token budget (a layout: the same step), and
    gradient checkpointing makes the same gradients as without it (the two-rank run
    recomputes its activations in the backward pass, the one-rank run keeps them)."""
    (s1, m1, v1, _), (s2, m2, v2, extra) = stage3
    assert [info["gradient_checkpointing"] for info in extra[3]] == [True, True]
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


# ------------------------------------------------------------------------ learner options


def _independent_logprobs_and_entropy(model_dir, batch, attn=None):
    """Per-token log-probs [B, L] and the mean response-token entropy of `batch` under the
    model at `model_dir`, computed here with transformers and torch.distributions."""
    from transformers import AutoModelForCausalLM

    kw = {"attn_implementation": attn} if attn else {}
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, **kw).eval()
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       use_cache=False).logits.double()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    mask = batch.response_mask[:, 1:]
    entropy = torch.distributions.Categorical(logits=logits[:, :-1][mask]).entropy()
    return torch.where(mask, lp, 0.0), float(entropy.mean())


@pytest.fixture(scope="module")
def with_options(ray_local, tiny_model_dir, batches, tmp_path_factory):
    """One rank with a separate reference (another random tiny model), eager attention, an
    entropy bonus and a cosine schedule over a 3-step run: step, checkpoint, step, reload the
    checkpoint, redo the step."""
    from cluster.tiny.model import build_random_model
    from learner.loading import ModelFiles

    tmp = tmp_path_factory.mktemp("options")
    other = build_random_model(tmp / "other", seed=1)
    cfg = _cfg(num_ranks=1, warmup_steps=0, lr_schedule="cosine", min_lr_ratio=0.2,
               entropy_coef=0.05, attn_implementation="eager", threads_per_rank=2,
               omp_wait_policy="passive")
    files = ModelFiles(policy=str(tiny_model_dir), reference=str(other))
    run = _run(files, cfg, _Steps(batches, ["good", "save", "good", "load", "good"],
                                  extra=lambda group: group.rank_info),
               tmp=tmp, total_optimizer_steps=3)
    return run, other


def test_a_separate_reference_gives_a_kl_from_the_first_step(stage0, with_options, batches,
                                                             tiny_model_dir):
    """With the policy as its own reference the first step's KL is 0; with model.ref_path's
    model it is the KL to that model, which the test computes itself."""
    (_, m1, _, _), _, _ = stage0
    (_, m, _, info), other = with_options
    assert info[0]["attn_implementation"] == ["eager", "eager"]  # policy and reference alike
    # learner.threads_per_rank and omp_wait_policy reach the rank's process (group.omp_env).
    assert (info[0]["threads"], info[0]["omp_wait_policy"]) == (2, "PASSIVE")
    assert abs(m1[0]["kl/pi_ref"]) < 1e-6
    good = batches[0]
    policy_lp, _ = _independent_logprobs_and_entropy(tiny_model_dir, good, attn="eager")
    ref_lp, _ = _independent_logprobs_and_entropy(other, good, attn="eager")
    # step 0: the learner holds the sampler's weights, importance weights 1: the plain mean
    expected = float((policy_lp - ref_lp).sum(-1).mean())
    assert abs(expected) > 1e-3  # two random models: close, but not the same
    assert m[0]["kl/pi_ref"] == pytest.approx(expected, rel=1e-4)


def test_entropy_metric_and_bonus_on_a_real_rank(stage0, with_options, batches, tiny_model_dir):
    """policy/entropy is the mean over response tokens of the policy's full-vocabulary
    entropy (computed here independently), logged without a bonus too."""
    (_, m1, _, _), _, _ = stage0
    (_, m, _, _), _ = with_options
    _, sdpa = _independent_logprobs_and_entropy(tiny_model_dir, batches[0])
    _, eager = _independent_logprobs_and_entropy(tiny_model_dir, batches[0], attn="eager")
    assert m1[0]["policy/entropy"] == pytest.approx(sdpa, rel=1e-5)   # entropy_coef 0
    assert m[0]["policy/entropy"] == pytest.approx(eager, rel=1e-5)   # entropy_coef 0.05
    assert m[0]["loss/entropy"] == pytest.approx(
        -0.05 * eager * m[0]["response/tokens"] / m[0]["response/sequences"], rel=1e-5)
    assert "loss/entropy" not in m1[0]


def test_cosine_schedule_continues_exactly_across_a_checkpoint_reload(with_options):
    """A 3-step run, no warm-up, cosine to 0.2 x lr: step 0 uses lr, step 1 0.6 lr (the
    middle), step 2 would use 0.2 lr. The step redone after reloading the step-0 checkpoint
    is step 1 again, at 0.6 lr (the schedule's position came back with the engine; a
    restarted schedule would use lr), and lands on the same weights."""
    (s, m, v, _), _ = with_options
    assert [x["lr"] for x in m] == pytest.approx([0.1, 0.06, 0.06])
    assert all(x["nonfinite"] == 0 for x in m)
    _assert_equal_params(s[2], s[4])   # the reload restored the step-1 weights
    _assert_equal_params(s[3], s[5])   # and the redone step is the same step
    assert v == [0, 1, 1, 2, 1, 2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_zero_offload_and_flash_attention_gpu(ray_local, tiny_model_dir, batches):
    """GPU only, not run on CPU machines: ZeRO-3 in bf16 with the optimizer (DeepSpeedCPUAdam)
    and the parameters offloaded to CPU memory, with flash_attention_2 where flash-attn is
    installed (sdpa otherwise) and gradient checkpointing, makes the step the same run without
    offload makes, to bf16 tolerance."""
    import importlib.util

    attn = "flash_attention_2" if importlib.util.find_spec("flash_attn") else "sdpa"
    base = {"num_ranks": 1, "zero_stage": 3, "dtype": "bfloat16", "num_gpus_per_rank": 1,
            "attn_implementation": attn, "gradient_checkpointing": True}

    def info(group):
        return group.rank_info

    plain = _run(tiny_model_dir, _cfg(**base), _Steps(batches, ["good"], extra=info))
    offload = _run(tiny_model_dir, _cfg(**base, offload_optimizer=True, offload_param=True),
                   _Steps(batches, ["good"], extra=info))
    (sp, mp, _, _), (so, mo, vo, io) = plain, offload
    assert io[0]["attn_implementation"] == [attn, attn]
    assert mo[0]["nonfinite"] == 0 and vo == [0, 1]
    assert mo[0]["grad/norm"] == pytest.approx(mp[0]["grad/norm"], rel=2e-2)
    num = den = 0.0
    for name in sp[0]:
        da = sp[1][name].double() - sp[0][name].double()
        db = so[1][name].double() - so[0][name].double()
        num += float((da - db).square().sum())
        den += float(da.square().sum())
    assert den > 0 and math.sqrt(num / den) < 5e-2, math.sqrt(num / den)
