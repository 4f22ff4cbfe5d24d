"""Findings: the paper's claims and klrl's own, each tested on a directory of runs.

`klrl report` calls `findings(runs, flags)` and writes the verdicts into report.md, so the
results pages are generated from run directories, never typed. A claim names the
configurations it compares (KL estimator, placement, `kl.importance`, beta, `max_lag`); where a
directory lacks one, the claim is "not run here". Only finished runs count.

Per run, three measures: final greedy accuracy in-domain and out-of-domain (the last
evaluation), and the KL to the reference at the end (mean `kl/pi_ref` over the last
TAIL_STEPS training steps). Over a configuration's runs (its seeds) a measure is a mean with a
standard error (sample sd / sqrt(n)). Two configurations differ on a measure when the
difference of their means exceeds Z standard errors of that difference (Welch:
sqrt(se_a^2 + se_b^2)); with 3 seeds per configuration this is a rough test (about a 90%
two-sided level), which the report says.

A run is *broken* when the report flags an accuracy collapse or a non-finite step, and
*drifting* when it flags a KL blow-up (the policy leaving the reference; without a KL penalty
that is what it does, so drifting alone is not a collapse).

Verdicts: *reproduced* (the evidence the claim predicts, beyond the noise), *contradicted* (the
opposite, beyond the noise), *inconclusive* (neither), *not run here*. The rules of each claim
are in its function's docstring and in docs/sweeps.md.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

Z = 2.0            # standard errors of a difference that count as a difference
TAIL_STEPS = 10    # training steps averaged for the KL at the end
IN_DOMAIN, OUT_OF_DOMAIN, KL = "eval/in_domain/accuracy", "eval/out_of_domain/accuracy", "kl/pi_ref"


@dataclass(frozen=True)
class Stat:
    """One measure over one configuration's runs."""

    values: tuple[float, ...]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values)

    @property
    def se(self) -> float:
        n = len(self.values)
        return statistics.stdev(self.values) / math.sqrt(n) if n > 1 else math.inf

    def __str__(self) -> str:
        se = f" ± {self.se:.3f}" if math.isfinite(self.se) else ""
        return f"{self.mean:.3f}{se} (n={len(self.values)})"


def ahead(a: Stat, b: Stat) -> bool:
    """a's mean exceeds b's by more than Z standard errors of the difference."""
    se = math.sqrt(a.se ** 2 + b.se ** 2)
    return math.isfinite(se) and a.mean - b.mean > Z * se


@dataclass(frozen=True)
class Finding:
    claim: str
    source: str        # "paper" or "klrl"
    setting: str       # e.g. "beta 0.3, max_lag 8"
    verdict: str       # reproduced | contradicted | inconclusive | not run here
    evidence: str


@dataclass(frozen=True)
class Config:
    """The runs of one KL configuration at one beta and lag (its seeds)."""

    name: str
    runs: tuple  # RunData of finished runs
    broken: int
    drifting: int

    def stat(self, key: str) -> Stat:
        values = (_measure(run, key) for run in self.runs)
        return Stat(tuple(v for v in values if math.isfinite(v)))

    @property
    def broken_share(self) -> float:
        return self.broken / len(self.runs)

    def unwell_share(self, study: Study) -> float:
        """The share of runs that broke or drifted."""
        return len({r.name for r in self.runs} & (study.broken | study.drifting)) / len(self.runs)

    def flags_text(self) -> str:
        n = len(self.runs)
        return f"broken {self.broken}/{n}, drifting {self.drifting}/{n}"


def _measure(run, key: str) -> float:
    """A run's final value of `key` (an accuracy's last evaluation), or for the KL the mean of
    its last TAIL_STEPS training steps; NaN when never logged."""
    steps, values = run.series(key)
    if key == KL:
        tail = [v for s, v in zip(steps, values) if s > 0][-TAIL_STEPS:]
        return statistics.fmean(tail) if tail else math.nan
    return values[-1] if values else math.nan


class Study:
    """The finished runs of a directory, selectable by KL configuration, beta and lag."""

    def __init__(self, runs: Sequence, flags: Sequence):
        self.runs = [r for r in runs if r.finished]
        self.broken = {f.run for f in flags if f.kind.startswith(("accuracy collapse", "non-finite"))}
        self.drifting = {f.run for f in flags if f.kind == "KL blow-up"}

    def config(self, estimator: str | None, placement: str | None, beta: float, lag: int,
               importance: str = "none") -> Config | None:
        """The configuration's runs (beta 0: the no-KL control, any estimator), or None."""
        def matches(c: dict) -> bool:
            if c.get("max_lag") != lag or not math.isclose(float(c.get("kl.beta", -1)), beta):
                return False
            if beta == 0:
                return True
            return (c.get("kl.estimator"), c.get("kl.placement"), c.get("kl.importance", "none")) \
                == (estimator, placement, importance)
        runs = tuple(r for r in self.runs if matches(r.config))
        if not runs:
            return None
        name = "no KL" if beta == 0 else f"{estimator.upper()} in {placement}" + (
            f" + importance {importance}" if importance != "none" else "")
        return Config(name, runs, sum(r.name in self.broken for r in runs),
                      sum(r.name in self.drifting for r in runs))

    def settings(self) -> list[tuple[float, int]]:
        """(beta, async lag) pairs to test: each positive beta at the largest lag it ran at."""
        betas = sorted({float(r.config.get("kl.beta", 0)) for r in self.runs} - {0.0})
        out = []
        for beta in betas:
            lags = [r.config.get("max_lag", 0) for r in self.runs
                    if math.isclose(float(r.config.get("kl.beta", 0)), beta)]
            out.append((beta, max(lags)))
        return out


def _verdict(reproduced: bool, contradicted: bool) -> str:
    return "reproduced" if reproduced else "contradicted" if contradicted else "inconclusive"


def _compare(a: Config, b: Config, key: str) -> str:
    sa, sb = a.stat(key), b.stat(key)
    sign = ">" if ahead(sa, sb) else "<" if ahead(sb, sa) else "~"
    return f"{a.name} {sa} {sign} {b.name} {sb}"


def k1_reward_best(study: Study, beta: float, lag: int) -> Finding:
    """Paper: K1 in the reward gives the best in- and out-of-domain accuracy. Reproduced when
    it is ahead of each other KL configuration on both; contradicted when another is ahead of
    it on either; else inconclusive."""
    claim = "K1 in the reward is best in- and out-of-domain"
    best = study.config("k1", "reward", beta, lag)
    others = [c for e, p in (("k1", "loss"), ("k3", "reward"), ("k3", "loss"))
              if (c := study.config(e, p, beta, lag))]
    setting = f"beta {beta:g}, max_lag {lag}"
    if best is None or len(others) < 3:
        return Finding(claim, "paper", setting, "not run here", "needs the four KL configurations")
    lines, wins, losses = [], 0, 0
    for key, label in ((IN_DOMAIN, "in-domain"), (OUT_OF_DOMAIN, "out-of-domain")):
        for other in others:
            wins += ahead(best.stat(key), other.stat(key))
            losses += ahead(other.stat(key), best.stat(key))
        lines.append(f"{label}: " + "; ".join(_compare(best, o, key) for o in others))
    verdict = "contradicted" if losses else "reproduced" if wins == 6 else "inconclusive"
    return Finding(claim, "paper", setting, verdict, " / ".join(lines))


def k1_loss_unstable(study: Study, beta: float, lag: int) -> Finding:
    """Paper: K1 in the loss is unstable off-policy. Reproduced when at least half its runs
    break and more of them than of K1 in the reward; contradicted when none breaks or drifts
    and its in-domain accuracy is not below K1 in the reward's; else inconclusive."""
    claim = "K1 in the loss is unstable off-policy"
    k1l, k1r = study.config("k1", "loss", beta, lag), study.config("k1", "reward", beta, lag)
    setting = f"beta {beta:g}, max_lag {lag}"
    if k1l is None or k1r is None or lag == 0:
        return Finding(claim, "paper", setting, "not run here", "needs K1 in loss and in reward at a lag")
    verdict = _verdict(
        reproduced=k1l.broken_share >= 0.5 and k1l.broken_share > k1r.broken_share,
        contradicted=k1l.broken == k1l.drifting == 0
        and not ahead(k1r.stat(IN_DOMAIN), k1l.stat(IN_DOMAIN)))
    return Finding(claim, "paper", setting, verdict,
                   f"K1 in loss: {k1l.flags_text()}; K1 in reward: {k1r.flags_text()}; KL at the "
                   f"end: {_compare(k1l, k1r, KL)}; in-domain: {_compare(k1l, k1r, IN_DOMAIN)}")


def k3_loss_stable_worse_ood(study: Study, beta: float, lag: int) -> Finding:
    """Paper: K3 in the loss is stable but generalises worse than K1 in the reward. Reproduced
    when none of its runs breaks and K1 in the reward is ahead of it out-of-domain;
    contradicted when half its runs break or it is ahead of K1 in the reward out-of-domain;
    else inconclusive."""
    claim = "K3 in the loss is stable but worse out-of-domain"
    k3l, k1r = study.config("k3", "loss", beta, lag), study.config("k1", "reward", beta, lag)
    setting = f"beta {beta:g}, max_lag {lag}"
    if k3l is None or k1r is None:
        return Finding(claim, "paper", setting, "not run here", "needs K3 in loss and K1 in reward")
    ood_k1r, ood_k3l = k1r.stat(OUT_OF_DOMAIN), k3l.stat(OUT_OF_DOMAIN)
    verdict = _verdict(reproduced=k3l.broken == 0 and ahead(ood_k1r, ood_k3l),
                       contradicted=k3l.broken_share >= 0.5 or ahead(ood_k3l, ood_k1r))
    return Finding(claim, "paper", setting, verdict,
                   f"K3 in loss: {k3l.flags_text()}; out-of-domain: "
                   f"{_compare(k3l, k1r, OUT_OF_DOMAIN)}")


def kl_stabilises_async(study: Study, beta: float, lag: int) -> Finding:
    """Paper: KL regularisation stabilises asynchronous training. Needs the no-KL control at
    the same lag. Reproduced when at least half the no-KL runs break and K1 in the reward breaks
    less often; contradicted when no no-KL run breaks and K1 in the reward is not ahead of it
    in-domain (there was nothing to stabilise); else inconclusive."""
    claim = "KL regularisation stabilises async training"
    nokl, k1r = study.config(None, None, 0.0, lag), study.config("k1", "reward", beta, lag)
    setting = f"beta {beta:g} against beta 0, max_lag {lag}"
    if nokl is None or k1r is None or lag == 0:
        return Finding(claim, "paper", setting, "not run here",
                       "needs the no-KL control (kl.beta 0) and K1 in reward at a lag")
    verdict = _verdict(
        reproduced=nokl.broken_share >= 0.5 and k1r.broken_share < nokl.broken_share,
        contradicted=nokl.broken == 0 and not ahead(k1r.stat(IN_DOMAIN), nokl.stat(IN_DOMAIN)))
    return Finding(claim, "paper", setting, verdict,
                   f"no KL: {nokl.flags_text()}; K1 in reward: {k1r.flags_text()}; in-domain: "
                   f"{_compare(k1r, nokl, IN_DOMAIN)}; KL at the end: {_compare(k1r, nokl, KL)}")


def k3_reward_breaks(study: Study, beta: float, lag: int) -> Finding:
    """klrl: K3 in the reward breaks off-policy (its exp(-delta) turns tokens the reference
    finds unlikely into huge costs). Reproduced when at least half its runs break or drift and
    more than K1 in the reward's; contradicted when none does; else inconclusive."""
    claim = "K3 in the reward breaks off-policy"
    k3r, k1r = study.config("k3", "reward", beta, lag), study.config("k1", "reward", beta, lag)
    setting = f"beta {beta:g}, max_lag {lag}"
    if k3r is None or k1r is None or lag == 0:
        return Finding(claim, "klrl", setting, "not run here", "needs K3 and K1 in reward at a lag")
    bad, bad_k1r = k3r.unwell_share(study), k1r.unwell_share(study)
    verdict = _verdict(reproduced=bad >= 0.5 and bad > bad_k1r, contradicted=bad == 0)
    return Finding(claim, "klrl", setting, verdict,
                   f"K3 in reward: {k3r.flags_text()}; K1 in reward: {k1r.flags_text()}; KL at "
                   f"the end: {_compare(k3r, k1r, KL)}")


def prefix_repairs(study: Study, beta: float, lag: int) -> Finding:
    """klrl: per-decision importance weights (kl.importance prefix) repair the configurations
    that break off-policy. For each configuration that breaks or drifts in at least half its
    runs without them: reproduced when every such one breaks and drifts in fewer runs with
    them and none of the corrected runs breaks; contradicted when a corrected one breaks as
    often or more; inconclusive when nothing broke (nothing to repair) or in between."""
    claim = "Per-decision importance weights repair what breaks off-policy"
    setting = f"beta {beta:g}, max_lag {lag}"
    pairs = [(plain, fixed) for e, p in (("k1", "loss"), ("k3", "reward"), ("k1", "reward"),
                                         ("k3", "loss"))
             if (plain := study.config(e, p, beta, lag)) and (fixed := study.config(e, p, beta, lag, "prefix"))]
    if not pairs or lag == 0:
        return Finding(claim, "klrl", setting, "not run here",
                       "needs configurations with and without kl.importance prefix at a lag")
    bad = [(a, b) for a, b in pairs if 2 * (a.broken + a.drifting) >= len(a.runs) and a.broken + a.drifting]
    evidence = "; ".join(f"{a.name}: {a.flags_text()} -> with prefix {b.flags_text()}" for a, b in pairs)
    if not bad:
        return Finding(claim, "klrl", setting, "inconclusive", "nothing broke without them: " + evidence)
    contradicted = any(b.broken + b.drifting >= a.broken + a.drifting for a, b in bad)
    verdict = _verdict(reproduced=not contradicted and all(b.broken == 0 for _, b in bad),
                       contradicted=contradicted)
    return Finding(claim, "klrl", setting, verdict, evidence)


CLAIMS: tuple[Callable[[Study, float, int], Finding], ...] = (
    k1_reward_best, k1_loss_unstable, k3_loss_stable_worse_ood, kl_stabilises_async,
    k3_reward_breaks, prefix_repairs)


def findings(runs: Sequence, flags: Sequence) -> list[Finding]:
    """Every claim at every (beta, async lag) of the directory; K1-in-reward-best also
    on-policy when max_lag 0 ran."""
    study = Study(runs, flags)
    out = []
    for beta, lag in study.settings():
        if lag > 0 and study.config("k1", "reward", beta, 0):
            out.append(k1_reward_best(study, beta, 0))
        out += [claim(study, beta, lag) for claim in CLAIMS]
    return [f for f in out if f.verdict != "not run here"] + [f for f in out if f.verdict == "not run here"]


def findings_markdown(found: Sequence[Finding]) -> list[str]:
    if not found:
        return ["No finished run with a KL penalty: no claim to test."]
    lines = ["| claim | from | setting | verdict | evidence (mean ± standard error over seeds) |",
             "|---|---|---|---|---|"]
    lines += [f"| {f.claim} | {f.source} | {f.setting} | **{f.verdict}** | {f.evidence} |" for f in found]
    return lines
