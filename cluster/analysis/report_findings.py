"""The findings part of `klrl report`: the pre-registration it follows (or the exploratory
label), the verdicts with their statistics, the threshold-sensitivity table, the measures per
configuration, runs.csv (every run's finals and curve summaries, to recheck without rerunning)
and the code the runs came from."""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import statistics
from collections import Counter
from datetime import datetime
from pathlib import Path

import yaml

from cluster.config.loader import REPO_ROOT, ConfigError
from cluster.analysis import findings as fnd
from cluster.analysis.comparisons import comparisons_section
from cluster.analysis.labels import SET_LABELS, configuration_keys
from cluster.analysis.measures import (
    PRIMARY,
    Measures,
    measure,
    observed_paired_sd,
    observed_seed_sd,
    write_csv,
)
from cluster.analysis.prereg import (
    Gates,
    Preregistration,
    Rules,
    file_commit,
    load_preregistration,
    resolve,
    rules_of,
)
from cluster.analysis.runs import BASE_EVAL_FILE, RunData
from cluster.analysis.stats import paired_detectable_lead
from cluster.train.run_log import read_provenance, started_at

CSV_FILE = "runs.csv"


def _commits(rows: list[dict]) -> set[str]:
    return {(r.get("git_commit") or "unknown")[:12] + ("+modified" if r.get("git_dirty") else "")
            for r in rows}


def run_commit(run: RunData) -> str:
    """The commit(s) that ran this run (several when it was resumed under other code)."""
    return " ".join(sorted(_commits(read_provenance(run.dir)))) or "not recorded"


def sweep_name(path: Path) -> str:
    """The sweep's name (its sweep.yaml), else the directory's."""
    sweep = path / "sweep.yaml"
    if sweep.is_file():
        return (yaml.safe_load(sweep.read_text()) or {}).get("name") or path.resolve().name
    return path.resolve().name


def provenance_lines(runs: list[RunData]) -> list[str]:
    """Which code, machine and dates produced the runs (their provenance.jsonl); a warning
    when the runs come from more than one commit."""
    rows = {r.dir: read_provenance(r.dir) for r in runs}  # read once: every count below uses them
    starts = [row for r in runs for row in rows[r.dir]]
    if not starts:
        return []
    commits = sorted(_commits(starts))
    machines = sorted({row.get("machine", "not recorded") for row in starts})
    dates = sorted(row["started_at"][:10] for row in starts if row.get("started_at"))
    when = dates[0] if dates[0] == dates[-1] else f"{dates[0]} to {dates[-1]}"
    lines = [(f"Runs started {when}; klrl commit(s) {', '.join(commits)}; machine(s): "
              f"{'; '.join(machines)}.")]
    if len(commits) > 1:
        of_run = [_commits(rows[r.dir]) for r in runs]
        per = {c: sum(c in made for made in of_run) for c in commits}
        spanning = sum(len(made) > 1 for made in of_run)
        lines += ["", f"**These runs come from {len(commits)} different klrl commits** ("
                  + ", ".join(f"{c}: {n} run(s)" for c, n in per.items())
                  + (f"; {spanning} run(s) resumed under another commit than they started, "
                     "counted under each" if spanning else "")
                  + "): a difference between configurations may partly be one of code. "
                  f"{CSV_FILE} names each run's commit."]
    return lines


def _started(runs: list[RunData]) -> datetime | None:
    times = [t for r in runs for row in read_provenance(r.dir) if (t := started_at(row))]
    return min(times, default=None)


def _prereg_head(cfg, prereg: Preregistration, sweep: str, runs: list[RunData]) -> list[str]:
    info = file_commit(cfg.preregistration, sweep)
    first = _started(runs)
    when = ""
    if info["date"] and first:
        changed = datetime.fromisoformat(info["date"])
        when = (" That is before the first run started (" + first.strftime(
            "%Y-%m-%d %H:%M") + "): pre-registered." if changed <= first else
            f" **That is after the first run started ({first:%Y-%m-%d %H:%M}): these "
            "findings are not pre-registered.**")
    modified = " **The file has uncommitted changes: the rules below are not the committed " \
        "ones.**" if info["modified"] else ""
    commit = f"commit {info['commit'][:12]} ({info['date']})" if info["commit"] else \
        "no commit (not in git)"
    if info["file_commit"] and info["file_commit"] != info["commit"]:
        commit += (f"; the file's later commits, up to {info['file_commit'][:12]} "
                   f"({info['file_date']}), change only comments or other sweeps' claims")
    return [(f"**Confirmatory**: the claims, rules and seeds are those of the pre-registration "
            f"`{cfg.preregistration}` ({prereg.title}), sweep `{sweep}`, whose rules, seeds and "
            f"claims last changed at "
            f"{commit}.{when}{modified} It is quoted at the end of this report.")]


def directory_findings(runs: list[RunData], groups: dict, prereg: Preregistration | None,
                       sweep: str, base: dict | None = None
                       ) -> tuple[list[Measures], list[Measures], list, list[str], list | None]:
    """(every run's measures, those the findings use, the findings, the sensitivity table, the
    same findings under prereg.Gates where the pre-registration registered none, else None):
    the pre-registration's claims and seeds, or (None) exploratory ones (rules_of). `base`:
    base_eval.json's contents (the retained gate's reference)."""
    rules = rules_of(prereg, runs)
    label = {r.name: lab for lab, g in groups.items() for r in g}
    measures = [measure(r, label[r.name], run_commit(r), rules) for r in runs]
    used = [m for m in measures if prereg is None
            or prereg.registered(sweep, m.seed, m.config.get("total_steps"))]
    todo = fnd.plan(fnd.Study.of(used), prereg, sweep)
    accuracy = base_accuracy(base)
    found, sensitivity = fnd.robust(used, rules, todo, prereg is not None, accuracy)
    gated = None
    if rules.gates is None:
        gated, _ = fnd.robust(used, rules.model_copy(update={"gates": Gates()}), todo,
                              prereg is not None, accuracy)
    return measures, used, found, sensitivity, gated


def base_accuracy(base: dict | None) -> dict[str, float]:
    """set -> the base model's accuracy, from base_eval.json's contents (empty without)."""
    return {k: v["accuracy"] for k, v in (base or {}).get("sets", {}).items()}


def findings_section(path: Path, runs: list[RunData], groups: dict, cfg, out: Path
                     ) -> tuple[list[str], list[Measures], list[str]]:
    """(markdown of the findings section, every run's measures, the pre-registration quote)."""
    prereg = load_preregistration(cfg.preregistration) if cfg.preregistration else None
    rules = rules_of(prereg, runs)
    sweep = sweep_name(path)
    if prereg and sweep not in prereg.sweeps:
        raise ConfigError(f"report.preregistration: {cfg.preregistration} has no claims for "
                          f"sweep {sweep!r} (it lists {', '.join(prereg.sweeps)})")
    base = _base_eval(path, out, rules)
    measures, used, found, sensitivity, gated = directory_findings(runs, groups, prereg, sweep,
                                                                   base)
    write_csv(measures, out / CSV_FILE, [v.name for v in rules.sensitivity])
    fixed = prereg.sweeps[sweep].comparisons if prereg else []
    md = comparisons_section(cfg.comparisons, fixed, used, configuration_keys(runs), rules.alpha)
    md += ["## Findings", ""]
    md += _prereg_head(cfg, prereg, sweep, runs) if prereg else [
        ("**Exploratory**: no pre-registration (`report.preregistration`), so the claims "
         "tested are those this directory could run, and the p-values describe these runs "
         "rather than confirm claims fixed before them (docs/sweeps.md, Pre-registration).")]
    family = len(found) if prereg else sum(f.verdict != "not run here" for f in found)
    md += ["", *_deviations(measures, used, prereg, rules, sweep), *_pooled(runs),
           *(_seed_sd_lines(used, prereg, family) if prereg else []),
           *(_rules_text(rules, family) if family else ["No claim could be tested on these runs."]),
           *(gates_text(Gates(), registered=False) if gated is not None else
             gates_text(rules.gates, registered=True) if rules.gates is not None and family
             else []),
           "", *_tally(found, "as registered" if gated is not None else ""),
           *(_tally(gated, "under the gates") if gated is not None else []),
           *fnd.findings_markdown(found, _toy_table(out), gated, _betas(used)), "",
           "### Threshold sensitivity", "",
           ("Each verdict recomputed with the failure thresholds changed (drift: the KL blow-up "
           "factor; collapse: evaluations below the level needed); a verdict that changes under "
           "one is *fragile*."), "", *(sensitivity or ["No claim to test."]), "",
           "### Measures per configuration", "",
           ("Each cell: mean ± sample sd over the configuration's runs (seeds), the spread of one "
            "run; the claims table's ± is the standard error of the mean."), "",
           *_measures_table(used, groups, base), "",
           (f"Every run's values (final accuracies, last evaluation, area under the accuracy "
           f"curve, KL at the end, mean lag, broken and why, under each variant): "
           f"[{CSV_FILE}]({CSV_FILE})."),
           ""]
    quote = []
    if prereg:
        quote = ["## Pre-registration", "", f"`{cfg.preregistration}`, as read for this report:",
                 "", "```yaml", resolve(cfg.preregistration).read_text().rstrip(), "```", ""]
    return md, measures, quote


def _betas(measures: list[Measures]) -> list[float]:
    """The kl.beta values of the runs with a KL penalty (what the toy column's header names
    beside the toy's own beta)."""
    return sorted({float(b) for m in measures if (b := m.config.get("kl.beta"))})


def _tally(found, how: str = "") -> list[str]:
    """One line above the claims table: how many claims got each verdict (`how`: under which
    rules, where the table shows two)."""
    counts = Counter(f.verdict for f in found)  # in the order the verdicts first appear
    return [f"{len(found)} claim(s){' ' + how if how else ''}: "
            + ", ".join(f"{n} {v}" for v, n in counts.items()) + ".", ""] if found else []


def gates_text(gates: Gates, registered: bool) -> list[str]:
    """The gates in words (prereg.Gates): registered with the claims, or (not `registered`)
    applied beside the registered rules as a change made after the runs (issue 63)."""
    when = "part of the rules above" if registered else (
        "**not** registered: a change of the rules made after these runs (issue 63), shown "
        "beside the registered verdicts, never instead of them")
    return ["", (f"Gates ({when}; docs/sweeps.md, Gates): a comparison of break rates is "
                 f"contradicted only where its own test could have reproduced it at Holm's "
                 f"first level (Tarone) and the 95%-style upper bound of the difference of "
                 f"rates is shown below {gates.break_difference:g} (Newcombe's score "
                 f"interval); an accuracy comparison on the retained set is decided only where "
                 f"the no-KL control lost at least {gates.retained_loss:g} accuracy margins "
                 f"of it against the base model, on another set only where K1 in the reward "
                 f"and no KL differ there by at least {gates.placement_moved:g} margin(s); "
                 f"the KL equivalence margin is {gates.kl_margin_share:g} x the log-KL effect "
                 "of K1 in the reward against no KL at the same setting.")]


TOY_TABLE = REPO_ROOT / "docs" / "sweeps" / "toy" / "table.md"  # `klrl kl-fixed-points`'s


def _toy_table(out: Path) -> fnd.ToyRows | None:
    """The committed toy table as a report in `out` links it; None without it (an
    installation without the docs)."""
    settings = TOY_TABLE.with_name("fixed_points.json")
    if not (TOY_TABLE.is_file() and settings.is_file()):
        return None
    return fnd.ToyRows(os.path.relpath(TOY_TABLE, out.resolve()),
                       set(re.findall(r'<a id="([a-z0-9-]+)"></a>', TOY_TABLE.read_text())),
                       json.loads(settings.read_text())["settings"]["beta"])


def _deviations(measures, used, prereg, rules, sweep) -> list[str]:
    lines = []
    finished = [m for m in used if m.finished]
    fallback = [m for m in finished if not m.source.startswith("final checkpoint")]
    if fallback:
        lines.append(f"- {len(fallback)} of {len(finished)} finished runs have no evaluation of "
                     f"their final checkpoint on {rules.final_problems} problems (seed "
                     f"{rules.final_eval_seed}): their accuracy is that of their last evaluation "
                     "during training (`make results` evaluates them; docs/sweeps.md).")
    if unfinished := len(used) - len(finished):
        lines.append(f"- {unfinished} run(s) unfinished: left out of the findings.")
    if prereg and (other := sum(m.seed not in prereg.seeds for m in measures)):
        lines.append(f"- {other} run(s) with seeds outside the pre-registered "
                     f"{', '.join(map(str, prereg.seeds))}: left out of the findings.")
    # the rest of those left out: registered seeds, another length (Preregistration.registered)
    if prereg and (other := sum(m.seed in prereg.seeds for m in measures) - len(used)):
        lines.append(f"- {other} run(s) of another length than the pre-registered "
                     f"{prereg.sweeps[sweep].total_steps} steps: left out of the findings.")
    return [*lines, ""] if lines else []


def pooled_keys(runs: list[RunData]) -> list[str]:
    """Config keys that tell the runs' configurations apart but are not part of a claim's
    configuration (findings.ARM_KEYS): a claim's arm holds runs of each of their values."""
    return [k for k in configuration_keys(runs) if k not in fnd.ARM_KEYS]


def _pooled(runs: list[RunData]) -> list[str]:
    keys = pooled_keys(runs)
    if not keys:
        return []
    return [(f"**The claims below pool runs that differ in {', '.join(f'`{k}`' for k in keys)}"
             "**: a claim's configuration is its KL estimator, placement, importance weights, "
             "beta and lag, so each of its arms holds runs of every value of these keys. The "
             "measures table keeps them apart."), ""]


def _seed_sd_lines(used: list[Measures], prereg: Preregistration, family: int) -> list[str]:
    """The seed sd the pre-registration's error rates assume beside the one these runs show,
    on the sets its claims compare: the power figures hold only where the two are alike. A
    paired design (seed_block_sd given) assumes a residual after the seed's shared effect, so
    the runs' residual and seed effects are shown against it, with the lead a paired claim
    over these seeds detects at that residual (80% power) at Holm's first and last level."""
    sets = ("in_domain", prereg.rules.retained)
    design = prereg.design
    if design.seed_block_sd is not None:
        paired = observed_paired_sd(used, sets)
        if not paired:
            return []
        shown = ", ".join(f"{SET_LABELS.get(k, k)} {r:.3f} (seed effects' sd {b:.3f})"
                          for k, (r, b) in paired.items())
        return [(f"The pre-registration's power figures assume a residual sd of a final "
                 f"accuracy of {design.seed_sd:g} after the seed's effect (sd "
                 f"{design.seed_block_sd:g}, shared by every configuration, which the paired "
                 f"tests remove); these runs show a residual of {shown} (configuration + seed "
                 "fitted to the unbroken runs). A set whose residual is larger has less power "
                 "than stated: an accuracy claim on it needs a proportionally larger lead. "
                 + _detectable_text(paired, len({m.seed for m in used}),
                                    prereg.rules.alpha, family)), ""]
    sd = observed_seed_sd(used, sets)
    if not sd:
        return []
    shown = ", ".join(f"{SET_LABELS.get(k, k)} {v:.3f}" for k, v in sd.items())
    return [(f"The pre-registration's power figures assume a seed sd of a final accuracy of "
             f"{design.seed_sd:g}; these runs show {shown} (pooled over the "
             "configurations' unbroken runs). A set whose sd is larger has less power than "
             "stated: an accuracy claim on it needs a proportionally larger lead."), ""]


def _detectable_text(paired: dict[str, tuple[float, float]], seeds: int, alpha: float,
                     family: int) -> str:
    """At what power (item 7 of issue 44): the true lead a paired accuracy claim over `seeds`
    seeds shows with 80% power at each set's observed residual, at Holm's first level (alpha
    over both directions of every claim) and at its last (alpha)."""
    if seeds < 2 or family < 1:
        return ""
    first = alpha / (2 * family)

    def lead(residual: float, level: float) -> str:
        found = paired_detectable_lead(residual, seeds, level)
        return f"{found:.3f}" if found <= 1 else "more than 1 (no accuracy lead)"

    leads = ", ".join(f"{SET_LABELS.get(k, k)} {lead(r, first)} to {lead(r, alpha)}"
                      for k, (r, _) in paired.items())
    return (f"At these residuals a paired accuracy claim over {seeds} seeds shows, with 80% "
            f"power, a true lead of {leads} (at Holm's first level, alpha / {2 * family}, to "
            "its last, alpha): a smaller lead is more likely missed than shown, so a claim "
            "left unreproduced is not shown false by that alone (that takes 'contradicted').")


_KINDS = {"accuracy_collapse": "its {sets} greedy accuracy collapses (below {fraction:g} x "
           "its best earlier value, over at least {evals} evaluation(s), the last one "
           "counting)",
           "reward_collapse": "its training reward collapses (the {smooth}-step mean below "
           "{fraction:g} x its best earlier value, to the end)",
           "grad_blowup": "its gradient norm blows up (the {smooth}-step median above "
           "{grad:g} x its early level)",
           "kl_drift": "its KL blows up (above {kl:g} x its early level: drift, counted here "
           "as a break)",
           "nonfinite": "a step is non-finite"}


def _rules_text(rules: Rules, m: int) -> list[str]:
    t = rules.failure.thresholds
    kinds = [_KINDS[k].format(sets=", ".join(rules.failure.sets), fraction=t.collapse_fraction,
                              evals=t.collapse_min_evals, smooth=t.smooth, grad=t.grad_growth,
                              kl=t.kl_growth) for k in rules.failure.kinds]
    drift = "" if "kl_drift" in rules.failure.kinds else (
        " A KL blow-up alone is drift, not a break: it is counted as *drifted*, and the KL at "
        "the end is compared beside every accuracy.")
    return [(f"Rules (docs/sweeps.md, Findings): accuracy differences by one-sided paired "
            f"t-tests over the seeds both configurations finished (Welch's where fewer than two "
            f"pair), break counts by Fisher's exact test, a break rate against "
            f"{rules.break_rate:g} by the exact binomial test, a dose trend by the "
            f"Cochran-Armitage test; Holm's correction across the {m} claims of the family and "
            f"both directions ({2 * m} p-values) at alpha = {rules.alpha:g}; 'contradicted' "
            f"needs an accuracy lead shown below {rules.accuracy_margin:g} or "
            + (f"a break rate shown on the wrong side of {rules.break_rate:g}"
               if rules.gates is None else "a difference of break rates shown below the "
               "gates' margin (below)") + ". A run is broken when "
            f"{'; or '.join(kinds)}.{drift}")]


def _base_eval(path: Path, out: Path, rules: Rules) -> dict | None:
    """The sweep's base_eval.json (the starting model on the final evaluation's problems;
    sweeps/results.py writes it) when it is on the problems the findings compare, copied beside the
    report; else None."""
    source = path / BASE_EVAL_FILE
    if not source.is_file():
        return None
    base = json.loads(source.read_text())
    if (base.get("problems"), base.get("seed")) != (rules.final_problems, rules.final_eval_seed):
        return None
    if source.resolve() != (out / BASE_EVAL_FILE).resolve():
        shutil.copyfile(source, out / BASE_EVAL_FILE)
    return base


def _measures_table(measures: list[Measures], groups: dict, base: dict | None = None
                    ) -> list[str]:
    # A column per set any run has a final accuracy for (retained: what training forgets).
    sets = [k for k in SET_LABELS if any(k in m.accuracy for m in measures)] or ["in_domain"]
    head = ["configuration", "runs", "accuracy from",
            *(f"final {SET_LABELS[k]}" for k in sets), *(f"AUC {SET_LABELS[k]}" for k in sets),
            "KL at the end", "mean lag", f"broken ({PRIMARY})", "time-to-break (median step)",
            "drifted"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label in groups:
        ms = [m for m in measures if m.configuration == label and m.finished]
        if not ms:
            continue
        cells = [mean_sd([m.accuracy.get(k, math.nan) for m in ms]) for k in sets]
        cells += [mean_sd([m.auc.get(k, math.nan) for m in ms]) for k in sets]
        sources = sorted({m.source for m in ms})
        lines.append("| " + " | ".join([f"`{label}`", str(len(ms)), "; ".join(sources), *cells,
                                        mean_sd([m.kl_end for m in ms]),
                                        mean_sd([m.lag_mean for m in ms]),
                                        f"{sum(bool(m.broken[PRIMARY]) for m in ms)}/{len(ms)}",
                                        _median_step(ms),
                                        f"{sum(bool(m.drifted) for m in ms)}/{len(ms)}"])
                     + " |")
    if base:
        finals = [f"{base['sets'][k]['accuracy']:.3f}" if k in base["sets"] else "-"
                  for k in sets]
        lines.append("| " + " | ".join(
            ["base model (before training)", "-", f"the same problems ([{BASE_EVAL_FILE}]"
             f"({BASE_EVAL_FILE}))", *finals, *["-"] * (len(head) - 3 - len(finals))]) + " |")
    return lines


def _median_step(ms: list[Measures]) -> str:
    steps = [m.break_step for m in ms if m.broken[PRIMARY] and m.break_step is not None]
    return f"{statistics.median(steps):g}" if steps else "-"


def mean_sd(values: list[float]) -> str:
    """A table cell: the finite values' mean ± sample sd (one value alone; "-" for none)."""
    values = [v for v in values if math.isfinite(v)]
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.fmean(values):.3f} ± {statistics.stdev(values):.3f}"
