"""Sequences sampled by several policy versions (a weight update landing mid-generation, issue
#36, 4), proved by exact enumeration like tests/test_kl_exact.py and
tests/test_kl_trainer_exact.py: the tokens before a switch are drawn by mu_v, from the switch on
by mu_{v+1} (prefix recomputed) or by "new weights over old cache" (kept KV, a sampler that is
no policy version), and each token's behaviour log-prob is the one of the row that drew it
(kl.toy.MixedSampler). Every KL configuration's expected gradient, and the KL's share of the
trainer's whole loss, is then what docs/kl.md documents for one sampler; one version's log-probs
for the whole sequence, a switch that sees the token it samples, or a group whose update time
depends on one member's tokens are not, and the tests show by how much.
"""
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kl import toy as T
from kl.analysis import (
    KLVariant,
    all_variants,
    is_exact_correction,
    on_policy_prediction,
    per_sample_grads,
    reference_grads,
    relative_error,
    truncated_bias,
)
from kl.config import AdvantageConfig, KLConfig
from kl.diagnostics import sequence_kl_estimates
from learner.config import LearnerConfig
from learner.exact import chain_to_logits, enumerate_groups, expected_grad
from learner.exact_table import ADVANTAGES, KL_MODES, documented, task_reward
from learner.task_term_traits import MASKING_TERMS, TASK_OFF_POLICIES


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # The toy's tensors are tiny: on two cores thread contention costs 20x the math (kl.table).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _versions(length: int, lags: tuple[float, ...]) -> list[torch.Tensor]:
    """Behaviour tables `lags` drift units from the same pi (kl.toy.ToyProblem.make)."""
    return [T.ToyProblem.make(vocab=3, length=length, seed=0, lag=lag).behaviour_logits
            for lag in lags]


def _cache_error(like: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return 0.5 * torch.randn(like.shape, generator=g, dtype=like.dtype)


# The estimator-level toy: vocabulary 3 with EOS, length 4 (31 sequences). v is 3 drift units
# old, v+1 one, v+2 half of one; the update lands before position k with probability SWITCH[k].
TOY = T.ToyProblem.make(seed=0, lag=0.0)
SP = TOY.space
OLD, MID, NEW = _versions(4, (3.0, 2.0, 1.0))
SWITCH = {0: 0.1, 1: 0.2, 2: 0.3, 3: 0.25, 4: 0.15}
SAMPLERS = {
    "recompute": T.switch_sampler(SP, OLD, NEW, SWITCH),
    "keep": T.switch_sampler(SP, OLD, NEW, SWITCH, _cache_error(OLD)),
    # A switch decided by the prefix's content, across three versions: one more version after
    # each token 2 the prefix holds.
    "prefix-rule": T.MixedSampler.single(
        T.composite_logits(SP, (OLD, MID, NEW), lambda p: min(2, p.count(2)))),
}
REFS = reference_grads(TOY)
VARIANTS = all_variants(truncates=(0.7, 2.0))


def _drawn(sampler: T.MixedSampler, recorded=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(probability of each sequence and branch [N], table of the recorded log-probs) per
    branch. recorded None: the table that drew each token; a [rows, V] table: that one for every
    branch; [J, rows, V]: one per branch."""
    out = []
    for j in range(sampler.num_branches):
        p = sampler.weights[j] * T.sequence_prob(sampler.tables[j], SP)
        rec = sampler.tables[j] if recorded is None else (
            recorded if recorded.dim() == 2 else recorded[j])
        out.append((p, rec))
    return out


def _expected(drawn, v: KLVariant) -> torch.Tensor:
    """E[grad kl.surrogate] over (sequence, recorded log-probs) pairs, exact."""
    return sum(p @ per_sample_grads(replace(TOY, behaviour_logits=rec), v) for p, rec in drawn)


def _off(g: torch.Tensor, target: torch.Tensor) -> float:
    """|g - target| in units of |g*| (the on-policy target of k1/loss is exactly 0)."""
    return float((g - target).norm() / REFS.g_star.norm())


def test_mixed_samplers_are_the_distributions_they_say():
    for s in SAMPLERS.values():
        assert float(s.sequence_prob(SP).sum()) == pytest.approx(1.0, abs=1e-12)
    length = torch.tensor([len(p) for p in SP.prefixes])
    rec, keep = SAMPLERS["recompute"], SAMPLERS["keep"]
    logp = {name: torch.log_softmax(t, -1) for name, t in
            (("old", OLD), ("new", NEW), ("pi", TOY.logits))}
    for j, k in enumerate(sorted(SWITCH)):
        before, after = length < k, length >= k
        assert torch.equal(rec.tables[j][before], OLD[before])
        assert torch.equal(rec.tables[j][after], NEW[after])
        assert torch.equal(keep.tables[j][before], OLD[before])
        stale = torch.log_softmax(keep.tables[j][after], -1)
        if k == 0 or k == SP.length:  # no old cache to keep / no switch within the sequence
            assert torch.equal(keep.tables[j], NEW if k == 0 else OLD)
            continue
        for name, lp in logp.items():  # new weights over old cache: none of the policies
            gap = (stale - lp[after]).abs().amax(-1)
            assert float(gap.min()) > 0.02, (k, name)
    with pytest.raises(ValueError, match="sum to 1"):
        T.MixedSampler(torch.tensor([0.5, 0.6], dtype=torch.float64), rec.tables[:2])


@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: v.name)
def test_every_kl_configuration_with_each_tokens_own_log_prob(v):
    """The documented expectation, with per-token ratios pi / mu_{v(t)} and prefix weights that
    multiply across the versions of a prefix: sequence and prefix weights give the on-policy
    table exactly; a cap's bias is its closed form (kl.analysis.truncated_bias) averaged over
    the branches; none and token are not exact corrections under one sampler and are not here."""
    pred = on_policy_prediction(v, REFS)
    for name, s in SAMPLERS.items():
        g = _expected(_drawn(s), v)
        if is_exact_correction(v):
            assert _off(g, pred) < 1e-9, name
        elif v.truncate is not None:
            uncapped = _expected(_drawn(s), KLVariant(v.estimator, v.placement, v.importance))
            closed = sum(w * truncated_bias(s.branch(TOY, j), v) for j, w in enumerate(s.weights))
            assert _off(g - uncapped, closed) < 1e-9, name
            assert _off(closed, 0 * closed) > 1e-4, name  # the cap bites on this toy
        elif (v.estimator, v.placement, v.importance) == ("k1", "loss", "token"):
            assert _off(g, pred) < 1e-12, name  # E_mu[rho_t grad logp_t | s_t] = 0 per state
        else:
            assert _off(g, pred) > 1e-2, name


EXACT = [v for v in VARIANTS if is_exact_correction(v)]


@pytest.mark.parametrize("v", EXACT, ids=lambda v: v.name)
def test_log_probs_of_one_version_bias_the_exact_corrections(v):
    """What a trainer that keeps one version per sequence computes (TRL #6945, miles #1829):
    the oldest's log-probs (the version Rollout.policy_version names) or the newest's for every
    token. And with the KV kept, each token's own version's log-probs over a fresh cache, which
    are not what drew it."""
    pred = on_policy_prediction(v, REFS)
    for recorded in (OLD, NEW):
        assert _off(_expected(_drawn(SAMPLERS["recompute"], recorded), v), pred) > 1e-2
    clean = SAMPLERS["recompute"].tables  # same branches as "keep", no cache error
    assert _off(_expected(_drawn(SAMPLERS["keep"], clean), v), pred) > 1e-2


def test_a_switch_that_sees_the_token_it_samples_is_not_exact():
    """The switch must be predictable. Here position 1 is drawn by mu_v, and when that draw is
    token 1 it is redrawn by mu_{v+1} and recorded with mu_{v+1}'s log-prob: every recorded
    log-prob is the one of the draw that produced the token, yet the token's distribution is
    mu_v(y)[y != 1] + mu_v(1) mu_{v+1}(y), which no recorded log-prob is, and the prefix-weighted
    K1 gradient is biased."""
    k = 1
    redraw = T.composite_logits(SP, (OLD, NEW), lambda p: int(len(p) == k))
    reaches = SP.mask[:, k]
    kept = T.sequence_prob(OLD, SP) * ~(reaches & (SP.tokens[:, k] == 1))
    p_one = torch.log_softmax(OLD, -1)[SP.rows[:, k], 1].exp()
    redrawn = torch.where(reaches, T.sequence_prob(redraw, SP) * p_one, 0.0)
    assert float(kept.sum() + redrawn.sum()) == pytest.approx(1.0, abs=1e-12)
    for v in (KLVariant("k1", "reward", "prefix"), KLVariant("k3", "reward+loss", "prefix")):
        g = _expected([(kept, OLD), (redrawn, redraw)], v)
        assert _off(g, on_policy_prediction(v, REFS)) > 1e-2
    # Control: the same two tables with a switch at k that ignores the token is exact.
    g = _expected(_drawn(T.MixedSampler.single(redraw)), KLVariant("k1", "reward", "prefix"))
    assert _off(g, REFS.g_star) < 1e-9


def test_logged_kl_estimates_with_each_tokens_own_log_prob():
    """kl/pi_ref and kl/pi_ref_k3 (prefix-weighted) stay unbiased for KL(pi || ref) under every
    mixed sampler; kl/mu_ref estimates the sampler's KL averaged over the branches."""
    true = float(T.sequence_kl(TOY.logits, TOY.ref_logits, SP))
    lp, ref = T.token_logp(TOY.logits, SP), T.token_logp(TOY.ref_logits, SP)
    for name, s in SAMPLERS.items():
        est = dict.fromkeys(("pi_ref", "pi_ref_k3", "mu_ref"), 0.0)
        for p, rec in _drawn(s):
            e = sequence_kl_estimates(lp, ref, T.token_logp(rec, SP), SP.mask)
            est = {key: est[key] + float(p @ e[key]) for key in est}
        assert est["pi_ref"] == pytest.approx(true, abs=1e-12), name
        assert est["pi_ref_k3"] == pytest.approx(true, abs=1e-12), name
        mu_kl = sum(float(w) * float(T.sequence_kl(t, TOY.ref_logits, SP))
                    for w, t in zip(s.weights, s.tables))
        assert est["mu_ref"] == pytest.approx(mu_kl, abs=1e-12), name
    # One version's log-probs for every token: kl/pi_ref is off.
    wrong = sum(float(p @ sequence_kl_estimates(lp, ref, T.token_logp(OLD, SP), SP.mask)["pi_ref"])
                for p, _ in _drawn(SAMPLERS["recompute"]))
    assert abs(wrong - true) > 1e-2


# The trainer-level toy: length 3 (15 sequences), groups of 2 and 3 share when the update lands.
TOY3 = T.ToyProblem.make(vocab=3, length=3, seed=0, lag=0.0)
OLD3, NEW3 = _versions(3, (3.0, 1.0))
SWITCH3 = {0: 0.1, 1: 0.3, 2: 0.4, 3: 0.2}
SAMPLERS3 = {
    "recompute": T.switch_sampler(TOY3.space, OLD3, NEW3, SWITCH3),
    "keep": T.switch_sampler(TOY3.space, OLD3, NEW3, SWITCH3, _cache_error(OLD3)),
}
REFS3 = reference_grads(TOY3)
BETA, CAP = 0.1, 1.2
SEPARATE = [m for m in KL_MODES if m[1] == "separate"]


def _groups(name: str, n: int):
    return enumerate_groups(TOY3, n, task_reward(TOY3.space), SAMPLERS3[name])


def _kl_cfg(mode) -> KLConfig:
    _, kia, placement, est, trunc = mode
    return KLConfig(estimator=est, placement=placement, importance="prefix", beta=BETA,
                    kl_in_advantage=kia, truncate=CAP if trunc else None)


def _documented(mode, est, norm, n, sampler) -> torch.Tensor:
    """learner.exact_table.documented for each branch's sampler, averaged over the branches
    (only a cap's closed-form bias differs between them)."""
    return sum(w * documented(mode, est, norm, n, 1.0, BETA, REFS3, sampler.branch(TOY3, j),
                              CAP)[0] for j, w in enumerate(sampler.weights))


def _kl_share(groups, mode, adv_cfg, lcfg) -> torch.Tensor:
    return (expected_grad(groups, _kl_cfg(mode), adv_cfg, lcfg)
            - expected_grad(groups, KLConfig(beta=0.0), adv_cfg, lcfg))


@pytest.mark.parametrize("name", list(SAMPLERS3))
def test_trainer_kl_share_is_exact_under_mixed_versions(name):
    """learner.loss.policy_loss over every group of 2 (and, for one advantage, 3) sequences,
    each token's behaviour log-prob the sampler's: the KL's share of the update is what the
    trainer-level table documents (beta x the KL gradient of kl.surrogate's table, plus the
    cap's closed form), for every separate KL mode, advantage estimator, normalisation and
    task_off_policy."""
    sampler = SAMPLERS3[name]
    cells = [(2, est, norm, off) for est, norm in ADVANTAGES for off in TASK_OFF_POLICIES]
    cells.append((3, "rloo", "group", "tis"))
    groups = {n: _groups(name, n) for n in {c[0] for c in cells}}
    for n, est, norm, off in cells:
        adv_cfg = AdvantageConfig(estimator=est, normalize=norm)
        g = groups[n].with_task_advantages(adv_cfg)
        for mode in SEPARATE:
            d = _kl_share(g, mode, adv_cfg, LearnerConfig(task_off_policy=off))
            target = _documented(mode, est, norm, n, sampler)
            assert relative_error(d, target) < 1e-9, (n, est, norm, off, mode[0])


@pytest.mark.parametrize("mode", SEPARATE, ids=lambda m: m[0])
def test_trainer_kl_share_is_biased_by_one_versions_log_probs(mode):
    """The same groups with the oldest or the newest version's log-probs for every token
    (Groups.relabelled): the KL share leaves its documented form."""
    adv_cfg, lcfg = AdvantageConfig(estimator="rloo", normalize="group"), LearnerConfig()
    g = _groups("recompute", 2).with_task_advantages(adv_cfg)
    target = _documented(mode, "rloo", "group", 2, SAMPLERS3["recompute"])
    for recorded in (OLD3, NEW3):
        d = _kl_share(g.relabelled(recorded), mode, adv_cfg, lcfg)
        assert relative_error(d, target) > 1e-2


def _task_grad_by_hand(groups, sampler: T.MixedSampler, lcfg: LearnerConfig) -> torch.Tensor:
    """E[grad] of learner/task_terms.py's per-token task term, written here from its formula
    (not learner.loss), with rho_t = pi / the row of the branch's table that drew the token (not
    the batch's behaviour_logp): d loss / d logp_t = -c_t A / n with c_t = 1 (none),
    min(rho_t, C) (tis), rho_t where ppo_clip takes the unclipped branch and 0 where it clips,
    rho_t in the band (icepop), R = prod rho in the band (mis), min(rho_t, C) where the
    sequence's geometric mean / product is in the band (seq_mask_geo / _prod), else 0."""
    b, sp = groups.batch, TOY3.space
    m = b.response_mask[:, 1:]
    lp = T.token_logp(TOY3.logits, sp)[groups.rows]
    drew = torch.stack([T.token_logp(t, sp) for t in sampler.tables])
    mu = drew[groups.branch.repeat_interleave(groups.n), groups.rows]
    log_rho = (lp - mu) * m
    rho = torch.exp(log_rho) * m
    adv = b.advantages[:, None]
    R = torch.exp(log_rho.sum(-1, keepdim=True))
    G = torch.exp(log_rho.sum(-1, keepdim=True) / m.sum(-1, keepdim=True))

    def band(x):
        return (x >= lcfg.mask_low) & (x <= lcfg.mask_high)

    tis = rho.clamp(max=lcfg.tis_cap)
    c = {"none": torch.ones_like(rho), "tis": tis,
         "ppo_clip": torch.where(rho.clamp(1 - lcfg.ppo_clip_eps, 1 + lcfg.ppo_clip_eps) * adv
                                 < rho * adv, 0.0, rho),
         "icepop": torch.where(band(rho), rho, 0.0),
         "mis": torch.where(band(R), R, 0.0).expand_as(rho),
         "seq_mask_geo": torch.where(band(G), tis, 0.0),
         "seq_mask_prod": torch.where(band(R), tis, 0.0)}[lcfg.task_off_policy]
    coef = -c * adv / groups.n * m
    return chain_to_logits(groups, coef * groups.weight.repeat_interleave(groups.n)[:, None])


# A band narrow enough that the mixed samplers' ratios fall on both sides of it.
NARROW = {"mask_low": 0.8, "mask_high": 1.1}


@pytest.mark.parametrize("off", TASK_OFF_POLICIES)
@pytest.mark.parametrize("name", list(SAMPLERS3))
def test_trainer_task_term_uses_each_tokens_own_log_prob(name, off):
    """The task term's expected gradient is its per-token formula with rho_t = pi / mu_{v(t)};
    with one version's log-probs it changes wherever the term forms the ratio (every term but
    none). The masks' band is narrow enough that each of them drops part of the gradient."""
    band = NARROW if off in MASKING_TERMS else {}
    adv_cfg, lcfg = AdvantageConfig(estimator="rloo", normalize="group"), \
        LearnerConfig(task_off_policy=off, **band)
    g = _groups(name, 2).with_task_advantages(adv_cfg)
    task = expected_grad(g, KLConfig(beta=0.0), adv_cfg, lcfg)
    assert relative_error(task, _task_grad_by_hand(g, SAMPLERS3[name], lcfg)) < 1e-12
    if band:
        wide = LearnerConfig(task_off_policy=off, mask_low=0.0, mask_high=1e6)
        assert relative_error(task, expected_grad(g, KLConfig(beta=0.0), adv_cfg, wide)) > 1e-2
    old = expected_grad(g.relabelled(OLD3), KLConfig(beta=0.0), adv_cfg, lcfg)
    if off == "none":
        assert relative_error(old, task) < 1e-15  # -A logp reads no behaviour log-prob
    else:
        assert relative_error(old, task) > 1e-2


def _coupled_errors() -> dict[tuple[str, str], float]:
    """Relative error of the KL share against beta g* (uncapped modes with a reward part) when
    the update lands before position 1 if member 0 ended at its first token, else before 2."""
    sampler = T.switch_sampler(TOY3.space, OLD3, NEW3, {1: 0.5, 2: 0.5})
    g = enumerate_groups(TOY3, 2, task_reward(TOY3.space), sampler)
    ended = TOY3.space.tokens[g.seqs[:, 0], 0] == T.EOS
    g = replace(g, weight=torch.where(g.branch == torch.where(ended, 0, 1), 2 * g.weight, 0.0))
    assert float(g.weight.sum()) == pytest.approx(1.0, abs=1e-12)
    out = {}
    for mode in (SEPARATE[0], SEPARATE[2], SEPARATE[3]):
        target = BETA * on_policy_prediction(KLVariant(mode[3], mode[2]), REFS3)
        for est, norm in (("reinforce", "none"), ("rloo", "group")):
            adv_cfg = AdvantageConfig(estimator=est, normalize=norm)
            d = _kl_share(g.with_task_advantages(adv_cfg), mode, adv_cfg, LearnerConfig())
            out[(mode[0], est)] = relative_error(d, target)
    return out


def test_an_update_timed_by_one_members_tokens_leaks_through_the_kl_baseline():
    """Each member's switch is predictable, but the update lands one step earlier when member 0
    ended at its first token (one request fewer makes engine steps faster). Member 1's tokens,
    and so member 0's leave-one-out KL baseline, then depend on member 0's first token, and the
    baseline's term stops being zero-mean: the KL share is off with a baseline, and exact
    without one (reinforce) or without a reward part (placement loss)."""
    for (mode, est), err in _coupled_errors().items():
        leaks = est == "rloo" and "/loss/" not in mode
        assert (1e-3 < err < 2e-2) if leaks else (err < 1e-9), (mode, est)


def test_docs_quote_the_toys_figures():
    """docs/kl.md (Sequences sampled by several policy versions) quotes these; recomputed."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "kl.md").read_text()
    section = " ".join(text[text.index("## Sequences sampled by several policy versions"):]
                       .split())
    v = KLVariant("k1", "reward", "prefix")
    pred = on_policy_prediction(v, REFS)
    one = [_off(_expected(_drawn(SAMPLERS["recompute"], r), v), pred) for r in (OLD, NEW)]
    assert f"ends {one[0]:.0%} (oldest) or {one[1]:.0%} (newest) away from g*" in section
    clean = _off(_expected(_drawn(SAMPLERS["keep"], SAMPLERS["recompute"].tables), v), pred)
    assert f"(on the toy, {clean:.0%} away from g*)" in section
    mode, adv_cfg, lcfg = SEPARATE[0], AdvantageConfig(estimator="rloo", normalize="group"), \
        LearnerConfig()
    g = _groups("recompute", 2).with_task_advantages(adv_cfg)
    target = _documented(mode, "rloo", "group", 2, SAMPLERS3["recompute"])
    share = [relative_error(_kl_share(g.relabelled(r), mode, adv_cfg, lcfg), target)
             for r in (OLD3, NEW3)]
    uncorrected = relative_error(
        expected_grad(g, _kl_cfg(mode).model_copy(update={"importance": "none"}), adv_cfg, lcfg)
        - expected_grad(g, KLConfig(beta=0.0), adv_cfg, lcfg), target)
    assert (f"{share[0]:.0%} (oldest) or {share[1]:.0%} (newest) away from beta g*, further than "
            f"no correction at all ({uncorrected:.0%})") in section
    assert share[0] > uncorrected
    coupled = _coupled_errors()
    assert (f"{coupled[(SEPARATE[0][0], 'rloo')]:.1%} (`k1` reward) or "
            f"{coupled[(SEPARATE[3][0], 'rloo')]:.1%} (`k3` reward+loss) away from beta g*"
            ) in section
