"""Re-read a committed report's runs.csv under the current rules, without its run directories:
`python -m cluster.cli.recheck DIR/runs.csv --preregistration FILE [--out FILE.md]`.

The reports of the earlier sweeps were written from run directories that were not kept, so
`klrl report` cannot rewrite them. Their runs.csv keeps what the claims compare (each run's
seed, final accuracies, KL at the end and why it broke), which is enough to test the claims
again with the current rules: paired by seed, one Holm family over both directions, and the
current failure definition as far as the CSV can apply it. A break runs.csv gives as a KL
blow-up is drift under the current definition, not a break; a collapse or a non-finite step
stays one. A gradient-norm blow-up or a reward collapse cannot be found without the metrics,
so the re-reading says that a run drifted but not whether its gradients blew up. Exploratory
by construction: the rules changed after these runs were read.

It ends with what the design could see (what_the_design_saw): the seed's share of each set's
variance, the lead detectable with and without pairing, and how accuracy goes with the
distance to the reference, over the runs neither rule calls broken: the descriptive figures
docs/experiments.md quotes.
"""
from __future__ import annotations

import csv
import json
import math
import re
from collections import Counter
from pathlib import Path

import yaml

from cluster.config.loader import REPO_ROOT
from cluster.analysis import findings as fnd
from cluster.analysis.measures import (PRIMARY, Measures, accuracy_kl_correlation,
                                          observed_paired_sd, observed_seed_sd, seed_share,
                                          trained)
from cluster.analysis.prereg import Gates, load_preregistration
from cluster.analysis.report_findings import base_accuracy, gates_text
from cluster.analysis.runs import BASE_EVAL_FILE
from cluster.analysis.stats import paired_detectable_lead, unpaired_detectable_lead

# A configuration's label names only the keys that vary in its sweep (labels.py): the rest
# come from the sweep file's overrides (sweep_defaults).
_LABEL = re.compile(r"^(?P<est>k\d)-(?P<place>[a-z+]+)(-is_(?P<imp>[a-z]+))?-b(?P<beta>[\d.]+)"
                    r"(-lag(?P<lag>\d+))?$")
_STEP = re.compile(r"at step (\d+)")


def _number(text: str) -> float:
    return float(text) if text not in ("", None) else math.nan


def sweep_defaults(sweep: str) -> dict:
    """The claim keys a sweep's labels leave out (held fixed by its overrides): importance
    and max_lag from configs/sweeps/<sweep>.yaml where it exists, else none and 0."""
    file = REPO_ROOT / "configs" / "sweeps" / f"{sweep}.yaml"
    fixed = (yaml.safe_load(file.read_text()) or {}).get("overrides", {}) \
        if file.is_file() else {}
    return {"imp": fixed.get("kl.importance", "none"), "lag": fixed.get("max_lag", 0)}


def read_runs_csv(path: Path, drift_breaks: bool = False, defaults: dict | None = None
                  ) -> list[Measures]:
    """Measures from runs.csv; its "broken" column under the current failure definition
    (a KL blow-up counts only with `drift_breaks`, the first pre-registration's rule).
    `defaults`: the keys a label leaves out (sweep_defaults)."""
    fixed = defaults or {"imp": "none", "lag": 0}
    out = []
    for row in csv.DictReader(path.open()):
        m = _LABEL.match(row["configuration"])
        if not m:
            raise ValueError(f"{path}: configuration {row['configuration']!r} is not "
                             "<est>-<placement>-is_<importance>-b<beta>-lag<lag>")
        config = {"kl.estimator": m["est"], "kl.placement": m["place"],
                  "kl.importance": m["imp"] or fixed["imp"], "kl.beta": float(m["beta"]),
                  "max_lag": int(m["lag"] or fixed["lag"]), "seed": int(row["seed"])}
        why = row["broken"]
        drift = why.startswith("KL blow-up")
        broken = why if why and (drift_breaks or not drift) else ""
        step = _STEP.search(broken)
        sets = {k.removeprefix("final_"): _number(v) for k, v in row.items()
                if k.startswith("final_") and v}
        out.append(Measures(row["run"], row["configuration"], int(row["seed"]),
                            row["finished"] == "True", config, row["commit"], sets,
                            row["accuracy_source"], {}, {}, _number(row["kl_end"]),
                            _number(row["lag_mean"]), {PRIMARY: broken},
                            int(step[1]) if step else None, why if drift else ""))
    return out


def base_of(path: Path) -> dict[str, float]:
    """The base model's accuracy per set from the base_eval.json beside a runs.csv (empty
    without one): the retained gate's reference."""
    source = path.with_name(BASE_EVAL_FILE)
    return base_accuracy(json.loads(source.read_text())) if source.is_file() else {}


def reread(path: Path, preregistration: str, sweep: str, drift_breaks: bool = False
           ) -> list[str]:
    """Markdown: the claims of `sweep` in the pre-registration, decided on runs.csv; where the
    pre-registration registered no gates, beside the same claims under prereg.Gates (a rule
    change made after the runs, issue 63)."""
    prereg = load_preregistration(preregistration)
    rules = prereg.rules.model_copy(update={"sensitivity": []})
    measures = [m for m in read_runs_csv(path, drift_breaks, sweep_defaults(sweep))
                if m.seed in prereg.seeds]
    todo = fnd.plan(fnd.Study.of(measures), prereg, sweep)
    base = base_of(path)
    found = fnd.findings(measures, rules, todo, family_of_all=True, base=base)
    gated = None if rules.gates is not None else fnd.findings(
        measures, rules.model_copy(update={"gates": Gates()}), todo, family_of_all=True,
        base=base)
    rule = "a KL blow-up counted as a break (the first rule)" if drift_breaks else \
        "a KL blow-up is drift, not a break (the current rule)"
    drifted = {m.configuration for m in measures if m.drifted}
    unknown = [] if drift_breaks or not drifted else [
        "", (f"**Unknown here:** {sum(bool(m.drifted) for m in measures)} run(s) drifted (of "
             f"{', '.join(f'`{c}`' for c in sorted(drifted))}); under the current rule each is "
             "broken if its gradient norm blew up or its reward collapsed, which runs.csv does "
             "not record (the report's gradient-norm plot shows it). Their verdicts above "
             "count them as unbroken; the table below counts them as broken: the truth under "
             "the current rule is one of the two.")]
    return [f"### {sweep}: {rule}", "",
            f"{len(measures)} runs of `{path}`, claims and seeds of `{preregistration}`; paired "
            f"by seed, one Holm family of {2 * len(found)} p-values (both directions) at alpha "
            f"{rules.alpha:g}. Exploratory: these rules were written after the runs were read.",
            "", *_tallies(found, gated), *(gates_text(Gates(), registered=False)[1:] + [""]
                                           if gated is not None else []),
            *fnd.findings_markdown(found, gated=gated), *unknown, ""]


def _tallies(found, gated) -> list[str]:
    def count(outcomes):
        return ", ".join(f"{n} {v}" for v, n in Counter(o.verdict for o in outcomes).items())
    return [f"{len(found)} claim(s) as registered: {count(found)}."
            + (f" Under the gates: {count(gated)}." if gated is not None else ""), ""]


def what_the_design_saw(path: Path, preregistration: str, sweep: str) -> list[str]:
    """Markdown: the seed's weight in the runs that neither broke nor drifted (their spread
    is noise under either failure rule): per set, the seed sd within a configuration, the
    share of the variance between seeds, the residual under configuration + seed, the lead a
    test that ignores the seed and a paired one detect with 80% power at the family's first
    Holm level as the pre-registration's design states it (alpha / claims), how many unpaired
    seeds match the paired lead, each seed's mean, and the correlation of final accuracy with
    log KL at the end, over all these runs and within seed. Descriptive."""
    prereg = load_preregistration(preregistration)
    measures = [m for m in read_runs_csv(path, True, sweep_defaults(sweep))
                if m.seed in prereg.seeds]
    runs, claims = trained(measures), len(fnd.plan(fnd.Study.of(measures), prereg, sweep))
    sets = [s for s in ("in_domain", "out_of_domain") if any(s in m.accuracy for m in runs)]
    seeds = len({m.seed for m in runs})
    level = prereg.rules.alpha / claims
    seed_sd, residual = observed_seed_sd(runs, sets), observed_paired_sd(runs, sets)
    share, r = seed_share(runs, sets), accuracy_kl_correlation(runs)
    r_within = accuracy_kl_correlation(runs, within_seed=True)
    lines = [f"### {sweep}: what the design could see", "",
             f"Over the {len(runs)} runs that neither broke nor drifted (their spread is noise "
             f"under either rule), {seeds} seeds; detectable leads with 80% power at "
             f"{prereg.rules.alpha:g} / {claims} = {level:.4f}, the first Holm level of the "
             "design's family. Descriptive.", "",
             "| set | seed sd (within a configuration) | variance between seeds | residual sd "
             "(configuration + seed) | lead detectable, seed ignored | lead detectable, paired "
             "| unpaired seeds for the paired lead | each seed's mean | r with log KL at the "
             "end (all / within seed) |", "|---|---|---|---|---|---|---|---|---|"]
    for s in sets:
        unpaired = unpaired_detectable_lead(seed_sd[s], seeds, level)
        paired_lead = paired_detectable_lead(residual[s][0], seeds, level)
        equal = next(n for n in range(seeds, 100 * seeds)
                     if unpaired_detectable_lead(seed_sd[s], n, level) <= paired_lead)
        means = {}
        for m in runs:
            means.setdefault(m.seed, []).append(m.accuracy[s])
        per_seed = ", ".join(f"{k}: {sum(v) / len(v):.3f}" for k, v in sorted(means.items()))
        lines.append(f"| {s} | {seed_sd[s]:.3f} | {share[s]:.0%} | {residual[s][0]:.3f} | "
                     f"{unpaired:.3f} | {paired_lead:.3f} | {equal} | {per_seed} | "
                     f"{r[s][0]:+.2f} / {r_within[s][0]:+.2f} |")
    return [*lines, ""]


COMMAND = "python -m cluster.cli.recheck"  # its command line (cluster/cli/recheck.py)


def recheck_page(csv_path: Path, preregistration: str, sweep: str | None = None,
                 out: Path | None = None) -> str:
    """The re-reading's markdown (module docstring): the claims under both failure rules, then
    what the design saw; `sweep` defaults to the CSV's directory name, and `out` (where the
    page will be written) appears in the command line the page quotes."""
    sweep = sweep or csv_path.resolve().parent.name
    md = ["# Re-reading of the committed runs.csv under the current rules", "",
          f"Written by `{COMMAND} {csv_path} --preregistration "
          f"{preregistration}{' --out ' + str(out) if out else ''}` "
          "(cluster/analysis/recheck.py says what it can and cannot recompute without "
          "the run directories).", ""]
    for drift in (False, True):
        md += reread(csv_path, preregistration, sweep, drift)
    md += what_the_design_saw(csv_path, preregistration, sweep)
    return "\n".join(md)
