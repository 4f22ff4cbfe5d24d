"""Re-read a committed report's runs.csv under the current rules, without its run directories:
`python -m cluster.experiments.recheck DIR/runs.csv --preregistration FILE [--out FILE.md]`.

The reports of the earlier sweeps were written from run directories that were not kept, so
`klrl report` cannot rewrite them. Their runs.csv keeps what the claims compare (each run's
seed, final accuracies, KL at the end and why it broke), which is enough to test the claims
again with the current rules: paired by seed, one Holm family over both directions, and the
current failure definition as far as the CSV can apply it. A break runs.csv gives as a KL
blow-up is drift under the current definition, not a break; a collapse or a non-finite step
stays one. A gradient-norm blow-up or a reward collapse cannot be found without the metrics,
so the re-reading says that a run drifted but not whether its gradients blew up. Exploratory
by construction: the rules changed after these runs were read.
"""
from __future__ import annotations

import argparse
import csv
import math
import re
from pathlib import Path

from cluster.experiments import findings as fnd
from cluster.experiments.measures import PRIMARY, Measures
from cluster.experiments.prereg import load_preregistration

_LABEL = re.compile(r"^(?P<est>k\d)-(?P<place>[a-z+]+)-is_(?P<imp>[a-z]+)-b(?P<beta>[\d.]+)"
                    r"-lag(?P<lag>\d+)$")
_STEP = re.compile(r"at step (\d+)")


def _number(text: str) -> float:
    return float(text) if text not in ("", None) else math.nan


def read_runs_csv(path: Path, drift_breaks: bool = False) -> list[Measures]:
    """Measures from runs.csv; its "broken" column under the current failure definition
    (a KL blow-up counts only with `drift_breaks`, the first pre-registration's rule)."""
    out = []
    for row in csv.DictReader(path.open()):
        m = _LABEL.match(row["configuration"])
        if not m:
            raise ValueError(f"{path}: configuration {row['configuration']!r} is not "
                             "<est>-<placement>-is_<importance>-b<beta>-lag<lag>")
        config = {"kl.estimator": m["est"], "kl.placement": m["place"],
                  "kl.importance": m["imp"], "kl.beta": float(m["beta"]),
                  "max_lag": int(m["lag"]), "seed": int(row["seed"])}
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


def reread(path: Path, preregistration: str, sweep: str, drift_breaks: bool = False
           ) -> list[str]:
    """Markdown: the claims of `sweep` in the pre-registration, decided on runs.csv."""
    prereg = load_preregistration(preregistration)
    rules = prereg.rules.model_copy(update={"sensitivity": []})
    measures = [m for m in read_runs_csv(path, drift_breaks) if m.seed in prereg.seeds]
    todo = fnd.plan(fnd.Study.of(measures), prereg, sweep)
    found = fnd.findings(measures, rules, todo, family_of_all=True)
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
            "", *fnd.findings_markdown(found), *unknown, ""]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cluster.experiments.recheck",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("csv", type=Path, help="a report's runs.csv")
    p.add_argument("--preregistration", required=True, help="the pre-registration it followed")
    p.add_argument("--sweep", default=None, help="its sweep (default: the CSV's directory name)")
    p.add_argument("--out", type=Path, default=None, help="write the markdown here")
    args = p.parse_args(argv)
    sweep = args.sweep or args.csv.resolve().parent.name
    md = ["# Re-reading of the committed runs.csv under the current rules", "",
          f"Written by `python -m cluster.experiments.recheck {args.csv} --preregistration "
          f"{args.preregistration}{' --out ' + str(args.out) if args.out else ''}` "
          "(cluster/experiments/recheck.py says what it can and cannot recompute without "
          "the run directories).", ""]
    for drift in (False, True):
        md += reread(args.csv, args.preregistration, sweep, drift)
    text = "\n".join(md)
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
