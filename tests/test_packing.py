"""Packed micro-batches under a token budget (learner/micro_batches.py) are a layout, never a
change of the objective: the learner's own accumulation loop (what learner/rank.py runs with its
DeepSpeed engine) on a tiny Qwen2 built here, in float64, gives the same loss, every logged
metric and the same gradient packed as padded, for every KL setting the tables in kl/ allow and
every task term of learner/task_terms.py, with micro-batches that cut groups and sequences of
very different lengths; no sequence is dropped, and none attends to another."""
import dataclasses
import itertools

import pytest
import torch
from pydantic import ValidationError

from kl.advantage import KL_IN_ADVANTAGE_FORMS
from kl.config import AdvantageConfig, KLConfig
from kl.estimators import FORMULAS
from kl.surrogate import IMPORTANCE_CORRECTIONS, PLACEMENT_FORMS
from learner import micro_batches
from learner.batch import TrainBatch
from learner.config import LearnerConfig
from learner.loss import PolicyLoss
from learner.loss_metrics import merge_metrics
from learner.task_terms import TASK_TERMS

GROUPS = (4, 3, 5)          # prompt groups of unequal size
LENGTHS = (3, 40, 7, 22, 5, 38, 4, 11, 30, 6, 17, 9)  # prompt + response, very different
PROMPT = 2
WIDTH = max(LENGTHS) + 3    # right padding beyond the longest
N_GLOBAL = 15.0             # the global batch's sequences (this mini-batch is a rank's share)
PADDED = {"micro_batch_size": 5}                  # cuts groups 1 and 2
PACKED = {"token_budget": 45, "packing": True}    # cuts them elsewhere, one 40-token row alone


def _model(seed):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=31, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      attn_implementation="sdpa")
    return Qwen2ForCausalLM(cfg).double()


@pytest.fixture(scope="module")
def setup():
    """The policy, a batch sampled (in spirit) by a nearby behaviour policy, reference
    log-probs."""
    policy, ref = _model(0), _model(1).eval()
    g = torch.Generator().manual_seed(3)
    B = len(LENGTHS)
    lengths = torch.tensor(LENGTHS)
    pos = torch.arange(WIDTH)[None]
    attn = pos < lengths[:, None]
    resp = attn & (pos >= PROMPT)
    ids = torch.where(attn, torch.randint(0, 31, (B, WIDTH), generator=g), 0)
    group_ids = torch.cat([torch.full((n,), 10 + i) for i, n in enumerate(GROUPS)])
    with torch.no_grad():
        lp, _ = micro_batches.forward(policy, _bare(ids, attn, resp), packed=False)
        ref_lp, _ = micro_batches.forward(ref, _bare(ids, attn, resp), packed=False)
    noise = 0.4 * torch.randn(B, WIDTH, generator=g, dtype=torch.float64)
    batch = TrainBatch(
        input_ids=ids, attention_mask=attn.long(), response_mask=resp,
        behaviour_logp=torch.where(resp, lp + noise, 0.0),
        rewards=torch.randint(0, 2, (B,), generator=g).double(),
        advantages=torch.randn(B, generator=g, dtype=torch.float64), group_ids=group_ids,
        token_lags=torch.where(resp, torch.randint(0, 3, (B, WIDTH), generator=g), 0))
    return policy, batch, ref_lp


def _bare(ids, attn, resp):
    B = ids.shape[0]
    z = torch.zeros(B, dtype=torch.float64)
    return TrainBatch(input_ids=ids, attention_mask=attn.long(), response_mask=resp,
                      behaviour_logp=torch.zeros(ids.shape, dtype=torch.float64), rewards=z,
                      advantages=z, group_ids=torch.arange(B))


def _step(policy, batch, ref_lp, kl_cfg, adv_cfg, **learner):
    """The learner's accumulation over micro-batches: (summed loss, merged metrics, gradient)."""
    policy.zero_grad(set_to_none=True)
    loss = PolicyLoss(kl_cfg, adv_cfg, LearnerConfig(**learner))
    losses = []

    def backward(value, logp):
        losses.append(float(value.detach()))
        value.backward()

    parts = micro_batches.accumulate(policy, batch, ref_lp, loss, N_GLOBAL, backward,
                                     torch.device("cpu"))
    grad = torch.cat([p.grad.flatten() for p in policy.parameters()])
    return sum(losses), merge_metrics(parts), grad, len(parts)


def _kl_settings():
    out = []
    for est, place, imp, fold in itertools.product(FORMULAS, PLACEMENT_FORMS,
                                                   IMPORTANCE_CORRECTIONS, KL_IN_ADVANTAGE_FORMS):
        try:
            out.append(KLConfig(estimator=est, placement=place, importance=imp, beta=0.3,
                                kl_in_advantage=fold))
        except ValidationError:
            continue  # a combination KLConfig refuses
    return out


def _same(a, b):
    loss_a, m_a, g_a, n_a = a
    loss_b, m_b, g_b, n_b = b
    assert loss_a == pytest.approx(loss_b, rel=1e-9, abs=1e-12)
    assert m_a.keys() == m_b.keys()
    for key in m_a:
        assert m_a[key] == pytest.approx(m_b[key], rel=1e-8, abs=1e-10), key
    torch.testing.assert_close(g_a, g_b, rtol=1e-8, atol=1e-11)


def test_the_splits_differ_and_cut_groups(setup):
    """The two layouts cut the mini-batch differently, and both cut prompt groups."""
    _, batch, _ = setup
    padded = micro_batches.plan(batch, LearnerConfig(**PADDED))
    packed = micro_batches.plan(batch, LearnerConfig(**PACKED))
    assert [len(i) for i in padded] != [len(i) for i in packed]
    for chunks in (padded, packed):
        assert micro_batches._cuts_groups(batch.group_ids, chunks)
        assert torch.equal(torch.cat(chunks), torch.arange(batch.num_sequences))
    lengths = batch.attention_mask.sum(-1)
    assert all(int(lengths[i].sum()) <= PACKED["token_budget"] for i in packed)


@pytest.mark.parametrize("kl_cfg", _kl_settings(),
                         ids=lambda c: f"{c.estimator}-{c.placement}-{c.importance}-"
                                       f"{c.kl_in_advantage}")
def test_packed_step_equals_padded_step_for_every_kl_setting(setup, kl_cfg):
    policy, batch, ref_lp = setup
    adv = AdvantageConfig(estimator="grpo", normalize="group")
    _same(_step(policy, batch, ref_lp, kl_cfg, adv, **PADDED),
          _step(policy, batch, ref_lp, kl_cfg, adv, **PACKED))


@pytest.mark.parametrize("term", list(TASK_TERMS))
@pytest.mark.parametrize("entropy_coef", [0.0, 0.05])
def test_packed_step_equals_padded_step_for_every_task_term(setup, term, entropy_coef):
    policy, batch, ref_lp = setup
    kl_cfg, adv = KLConfig(placement="reward", beta=0.2), AdvantageConfig()
    opts = {"task_off_policy": term, "entropy_coef": entropy_coef}
    padded = _step(policy, batch, ref_lp, kl_cfg, adv, **PADDED, **opts)
    _same(padded, _step(policy, batch, ref_lp, kl_cfg, adv, **PACKED, **opts))
    # and the whole mini-batch in one packed row
    _same(padded, _step(policy, batch, ref_lp, kl_cfg, adv, packing=True, **opts))


def test_a_padded_token_budget_is_the_same_step(setup):
    """A token budget without packing (rows x padded width) cuts elsewhere, same step."""
    policy, batch, ref_lp = setup
    kl_cfg, adv = KLConfig(placement="reward+loss", beta=0.2), AdvantageConfig()
    _same(_step(policy, batch, ref_lp, kl_cfg, adv, **PADDED),
          _step(policy, batch, ref_lp, kl_cfg, adv, token_budget=90))


def test_no_sequence_attends_to_another(setup):
    """Changing one packed sequence's tokens changes its own log-probs and no other's."""
    policy, batch, _ = setup
    rows = torch.arange(batch.num_sequences)
    with torch.no_grad():
        base, _ = micro_batches.forward(policy, batch, packed=True)
        for victim in (0, 5, 11):
            ids = batch.input_ids.clone()
            n = int(batch.attention_mask[victim].sum())
            ids[victim, :n] = (ids[victim, :n] + 7) % 31
            changed = TrainBatch(**{**batch.__dict__, "input_ids": ids})
            out, _ = micro_batches.forward(policy, changed, packed=True)
            others = rows != victim
            torch.testing.assert_close(out[others], base[others], rtol=0, atol=1e-13)
            assert not torch.allclose(out[victim, 1:n], base[victim, 1:n])
        # and each packed sequence's log-probs are its padded row's (padding: 0 packed)
        padded, _ = micro_batches.forward(policy, batch, packed=False)
        real = batch.attention_mask.bool()
        torch.testing.assert_close(base[real], padded[real], rtol=1e-10, atol=1e-12)
        assert not base[~real].any()


@pytest.mark.parametrize("seed", range(6))
def test_every_sequence_is_in_exactly_one_micro_batch(seed):
    """Random lengths and budgets (a sequence longer than the budget included): the plan
    covers every row once, in order, within the budget unless a row alone exceeds it; and a
    rank asked for more passes splits its micro-batches without losing a row."""
    g = torch.Generator().manual_seed(seed)
    B = int(torch.randint(1, 30, (), generator=g))
    lengths = torch.randint(2, 60, (B,), generator=g)
    batch = _bare(torch.zeros(B, 60, dtype=torch.long),
                  torch.arange(60)[None] < lengths[:, None],
                  (torch.arange(60)[None] < lengths[:, None]) & (torch.arange(60)[None] >= 1))
    for packing in (True, False):
        cfg = LearnerConfig(token_budget=int(torch.randint(20, 200, (), generator=g)),
                            packing=packing)
        chunks = micro_batches.plan(batch, cfg)
        assert torch.equal(torch.cat(chunks), torch.arange(B))
        for i in chunks:
            cost = (int(lengths[i].sum()) if packing
                    else len(i) * int(lengths[i].max()))
            assert cost <= cfg.token_budget or len(i) == 1
        more = micro_batches.plan(batch, cfg, passes=len(chunks) + 3)
        assert len(more) == min(B, len(chunks) + 3)
        assert torch.equal(torch.cat(more), torch.arange(B))
    packed = micro_batches.Packed.of(batch)
    assert packed.input_ids.shape == (1, int(lengths.sum()))
    assert set(packed.tokens) >= {"input_ids", "attention_mask", "response_mask",
                                  "behaviour_logp", "token_lags"}


def test_a_budget_cuts_at_a_group_start_where_one_fits():
    """Rows of 5 tokens in groups of 2, a budget of 15: [0, 1] [2, 3] (whole groups, no
    group-statistics pass), not [0, 1, 2] [3]; a group longer than the budget is still cut."""
    lengths = torch.tensor([5, 5, 5, 5])
    pos = torch.arange(6)[None]
    batch = dataclasses.replace(
        _bare(torch.zeros(4, 6, dtype=torch.long), pos < lengths[:, None],
              (pos < lengths[:, None]) & (pos > 0)), group_ids=torch.tensor([0, 0, 1, 1]))
    plan = micro_batches.plan(batch, LearnerConfig(token_budget=15, packing=True))
    assert [i.tolist() for i in plan] == [[0, 1], [2, 3]]
    plan = micro_batches.plan(batch, LearnerConfig(token_budget=7, packing=True))
    assert [i.tolist() for i in plan] == [[0], [1], [2], [3]]


def test_the_token_budget_is_refused_below_the_longest_sequence():
    from cluster.config.train_config import TrainConfig

    with pytest.raises(ValidationError, match="token_budget .* below the longest sequence"):
        TrainConfig(learner={"token_budget": 64}, rollout={"max_model_len": 128})
    with pytest.raises(ValidationError, match="data.max_prompt_length"):
        TrainConfig(learner={"token_budget": 64}, data={"max_prompt_length": 60},
                    rollout={"max_model_len": 512, "max_new_tokens": 32})
    TrainConfig(learner={"token_budget": 92, "packing": True}, data={"max_prompt_length": 60},
                rollout={"max_model_len": 512, "max_new_tokens": 32})
    with pytest.raises(ValidationError, match="set one"):
        LearnerConfig(token_budget=512, micro_batch_size=4)


def test_the_default_micro_batch_is_a_token_budget():
    """learner.token_budget null: the ranks get DEFAULT_TOKEN_BUDGET tokens per micro-batch, or
    the longest allowed sequence where longer; none beside micro_batch_size; set values win.
    A LearnerConfig alone (no run around it) keeps the whole shard."""
    from cluster.config.train_config import TrainConfig
    from learner.config import DEFAULT_TOKEN_BUDGET

    def budget(**kw):
        return TrainConfig(**kw).rank_learner.token_budget

    assert budget(rollout={"max_model_len": 512}) == DEFAULT_TOKEN_BUDGET
    assert budget(rollout={"max_model_len": 3 * DEFAULT_TOKEN_BUDGET}) == 3 * DEFAULT_TOKEN_BUDGET
    assert budget(learner={"micro_batch_size": 4}) == 0
    assert budget(learner={"token_budget": 0}) == 0
    assert budget(learner={"token_budget": 9000, "packing": True}) == 9000
    assert micro_batches.plan(_bare(torch.zeros(3, 5, dtype=torch.long),
                                    torch.ones(3, 5, dtype=torch.bool),
                                    torch.ones(3, 5, dtype=torch.bool) & (torch.arange(5) > 0)),
                              LearnerConfig())[0].tolist() == [0, 1, 2]


def test_the_bench_measures_packed_against_padded_on_spread_lengths(tmp_path):
    """cluster/bench/packing.py's measurement, in this process, on a tiny random model: every
    figure is there and finite (no timing is asserted: figures belong in `klrl bench`)."""
    from cluster.bench.packing import QUICK_SPREAD, interleaved
    from cluster.tiny.model import build_random_model

    model = build_random_model(tmp_path / "m", seed=0, num_hidden_layers=1)
    out = interleaved({"model_dir": str(model), "learner": {"threads_per_rank": 1},
                       "kl": {}, "advantage": {}, "reps": 2, "warmup": 0,
                       "spread": QUICK_SPREAD.__dict__, "seed": 0})
    assert out["sequences"] == QUICK_SPREAD.sequences
    assert 0 < out["padding_share"] < 1 and out["tokens"] < out["padded_tokens"]
    for layout in ("padded", "packed"):
        assert 0 < out[layout]["seconds_min"] <= out[layout]["seconds_median"] \
            <= out[layout]["seconds_max"]
    assert 0 < out["speedup_min"] <= out["speedup_median"] <= out["speedup_max"]
