"""`klrl kl-table`: every KL configuration's exact expected gradient on a seeded toy.

For each configuration of kl.surrogate it prints the cosine to the true gradient
g* = grad KL(pi||ref), the relative error |E g - g*| / |g*| and the per-sample gradient
variance, on-policy and off-policy, whether the exact expectation matches docs/design.md's
table, and a sweep of the bias against the behaviour policy's lag. Then the trainer-level
rows: the KL's share of the learner's whole expected update (every placement x
kl_in_advantage x advantage estimator x normalize x task_off_policy, groups of 2 and 3)
against the form docs/kl.md gives; and the task-term rows: each learner.task_off_policy's bias and
variance of the task gradient at the trainer rows' lags, and what each mask drops (docs/learner.md).
Everything is exact enumeration (no sampling), so the numbers are
deterministic for a seed; it runs in seconds on CPU and exits 1 if a row stops matching. The
numbers come from kl/table.py, learner/exact_table.py and learner/exact_masks.py; this module
parses, prints and plots.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from cluster.config.loader import ConfigError, load_config
from learner.task_term_traits import MASKING_TERMS, TASK_OFF_POLICIES


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    cfg = result["config"]
    table = Table(title=f"KL gradient estimators on a {cfg['vocab']}-token, "
                        f"length-{cfg['length']} toy ({result['num_sequences']} sequences, "
                        "exact). rel.err = |E g - g*| / |g*|")
    lag = f"lag {cfg['off_policy_lag']:g}"
    for col in ("config", "design table", "on: cos", "on: err", "on: var",
                f"{lag}: cos", f"{lag}: err", f"{lag}: var", "exact off-policy"):
        table.add_column(col, justify="left" if col == "config" else "right", no_wrap=True)
    for r in result["rows"]:
        zero = r["on_norm_ratio"] < 1e-9  # exactly zero in expectation: a cosine means nothing
        table.add_row(r["config"], "ok" if r["matches_design_table"] else "MISMATCH",
                      "(zero)" if zero else f"{r['on_cosine']:.3f}", f"{r['on_rel_error']:.3f}",
                      f"{r['on_variance']:.3f}", f"{r['off_cosine']:.3f}",
                      f"{r['off_rel_error']:.3f}", f"{r['off_variance']:.3f}",
                      "yes" if r["unbiased_off_policy"] else "")
    console = Console(width=None if Console().is_terminal else 140)
    console.print(table)
    sweep = result["lag_sweep"]
    lag_table = Table(title="Relative error of E\\[g] vs g* against the behaviour policy's lag")
    lag_table.add_column("config", no_wrap=True)
    for lag in sweep["lags"]:
        lag_table.add_column(f"{lag:g}", justify="right")
    for name, errs in sweep["rel_error"].items():
        lag_table.add_row(name, *(f"{e:.3f}" for e in errs))
    console.print(lag_table)


def print_trainer_table(trainer: dict, what: str = "toy sequences") -> None:
    """The trainer-level rows: the KL's share of the learner's expected update against the
    documented form. A bare number is a claimed cell (must be at float64 precision); one in
    parentheses is no claim, the distance from the on-policy form. `what`: the title's name of
    what is enumerated (the multi-turn rows: trajectories)."""
    from rich.console import Console
    from rich.table import Table

    cfg = trainer["config"]
    table = Table(title="The trainer's loss, exactly over every group of n of "
                        f"{trainer['num_sequences']} {what} (beta {cfg['beta']:g}): "
                        "rel.err of the KL's share of E\\[update] against the documented form; "
                        "(x): no exact claim, distance from the on-policy form; masks: the "
                        f"worst of {', '.join(MASKING_TERMS)}")
    table.add_column("kl / estimator / normalize / n", no_wrap=True)
    table.add_column("max|A| (bound)", justify="right")
    lags = cfg["lags"]
    # One column per task term that masks nothing, one for the masks together (the widest).
    opts = [(o, (o,)) for o in TASK_OFF_POLICIES if o not in MASKING_TERMS]
    opts.append(("masks", MASKING_TERMS))
    for lag in lags:
        if lag == 0:
            table.add_column("on-policy", justify="right")
        else:
            for name, _ in opts:
                table.add_column(f"lag {lag:g}: {name}", justify="right")
    table.add_column("", no_wrap=True)

    def fmt(cells):
        if not cells:
            return "-"
        worst = max(cells, key=lambda c: c["rel_error"])
        return f"{worst['rel_error']:.1e}" if worst["exact"] else f"({worst['rel_error']:.3f})"

    for r in trainer["rows"]:
        adv = ""
        if "max_abs_advantage" in r:
            bound = r["advantage_bound"]
            adv = f"{r['max_abs_advantage']:.3g}" + (f" ({bound:.3g})" if bound is not None else "")
        cols = []
        for lag in lags:
            at = [c for c in r["cells"] if c["lag"] == lag]
            if lag == 0:
                cols.append(fmt(at))  # on-policy every task_off_policy has the same update
            else:
                cols += [fmt([c for c in at if c["task_off_policy"] in terms])
                         for _, terms in opts]
        table.add_row(r["config"], adv, *cols, "ok" if r["ok"] else "MISMATCH")
    console = Console(width=None if Console().is_terminal else 176)
    console.print(table)
    claimed = [c["rel_error"] for r in trainer["rows"] for c in r["cells"] if c["exact"]]
    console.print(f"{len(claimed)} claimed cells, largest relative error {max(claimed):.1e} "
                  f"(tolerance {trainer['tolerance']:.0e})")
    if "kl_part_variance" not in trainer:
        return
    var = Table(title="Per-group variance of the KL's share of the update, on-policy, K1: "
                      "centered (sequence sum minus the group mean) / separate (reward-to-go, "
                      "leave-one-out baseline)")
    for col in ("seed", "n", "raw", "per unit of expected step"):
        var.add_column(col, justify="right")
    for v in trainer["kl_part_variance"]:
        var.add_row(str(v["seed"]), str(v["n"]), f"{v['centered'] / v['separate']:.2f}",
                    f"{v['centered_scaled'] / v['separate_scaled']:.2f}")
    console.print(var)


def print_mask_table(masks: dict) -> None:
    """The task-term rows (learner/exact_masks.py): bias and variance of each task term's
    expected gradient off-policy, and what the masks drop."""
    from rich.console import Console
    from rich.table import Table

    low, high = masks["band"]
    table = Table(title=f"The task gradient off-policy, exactly over every group of "
                        f"n={masks['n']} ({masks['advantage']}, beta 0; masks' band "
                        f"[{low:g}, {high:g}], tis_cap {masks['tis_cap']:g}): bias |E g - g_on| "
                        "/ |g_on| and per-group variance / |g_on|^2 against g_on, the same "
                        "policy's on-policy gradient; dropped: the share of the unmasked "
                        "gradient's norm the band removes")
    for col in ("task_off_policy", "lag", "bias", "variance", "dropped", "masked tokens",
                "masked samples", ""):
        table.add_column(col, justify="left" if col == "task_off_policy" else "right",
                         no_wrap=True)
    for r in masks["rows"]:
        if r["lag"] == 0 and r["ok"]:
            continue  # on-policy every term is g_on with nothing masked (checked)
        dropped = "-" if r["dropped"] is None else f"{r['dropped']:.1%}"
        table.add_row(r["task_off_policy"], f"{r['lag']:g}", f"{r['bias']:.3f}",
                      f"{r['variance']:.3f}", dropped, f"{r['masked_tokens']:.1%}",
                      f"{r['masked_samples']:.1%}", "ok" if r["ok"] else "MISMATCH")
    console = Console(width=None if Console().is_terminal else 140)
    console.print(table)
    on = [r for r in masks["rows"] if r["lag"] == 0]
    console.print(f"on-policy: {sum(r['ok'] for r in on)} of {len(on)} task terms have the "
                  f"on-policy gradient and mask nothing (tolerance {masks['tolerance']:.0e})")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = result["lag_sweep"]
    fig, ax = plt.subplots(figsize=(10, 5.5))
    for name, errs in sweep["rel_error"].items():
        exact = ("prefix" in name or "sequence" in name) and "C=" not in name
        ax.plot(sweep["lags"], errs, "-" if exact else "--", marker="o", ms=3,
                lw=2 if exact else 1.3, label=name + ("  (exact correction)" if exact else ""))
    ax.set_xlabel("lag of the behaviour policy mu (drift units; 0 = on-policy)")
    ax.set_ylabel("relative error |E[g] - g*| / |g*|")
    ax.set_title("Bias of the KL gradient against off-policy lag (exact enumeration, toy policy)")
    ax.set_ylim(bottom=-0.03)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def check_outputs(args) -> None:
    """--json and --plot can be written (not a directory, their directory there or creatable)
    and are two files: ConfigError otherwise, before the tables are computed, so that a bad
    --plot does not leave the JSON behind."""
    from cluster.train.door.paths import check_writable_file

    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None:
            check_writable_file(Path(path), flag)
    if args.json and args.plot and Path(args.json).resolve() == Path(args.plot).resolve():
        raise ConfigError(f"--json and --plot are both {args.json}; give them different paths")


def run(args) -> int:
    from kl.table import KLTableConfig, compute_table  # torch: not at `klrl --help`
    from learner.exact_masks import compute_mask_rows
    from learner.exact_table import compute_trainer_rows, kl_part_variance

    try:
        cfg = load_config(KLTableConfig, args.config, args.overrides)
        check_outputs(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result = compute_table(cfg)
    result["trainer"] = compute_trainer_rows(cfg.trainer)
    result["trainer"]["kl_part_variance"] = kl_part_variance(length=cfg.trainer.length)
    result["task_terms"] = compute_mask_rows(cfg.trainer)
    if cfg.trainer.environment:
        result["trainer_multi_turn"] = compute_trainer_rows(cfg.trainer, multi_turn=True)
    print_table(result)
    print_trainer_table(result["trainer"])
    if "trainer_multi_turn" in result:
        print_trainer_table(result["trainer_multi_turn"], "trajectories with an environment "
                            f"turn at position(s) {cfg.trainer.environment}")
    print_mask_table(result["task_terms"])
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    if args.plot:
        plot(result, Path(args.plot))
        print(f"wrote {args.plot}")
    ok = all(r["matches_design_table"] for r in result["rows"])
    ok = ok and all(r["ok"] for part in ("trainer", "trainer_multi_turn")
                    for r in result.get(part, {}).get("rows", []))
    return 0 if ok and all(r["ok"] for r in result["task_terms"]["rows"]) else 1


def register(subparsers) -> None:
    p = subparsers.add_parser("kl-table",
                              help="exact bias/variance of every KL configuration on a toy",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=None,
                   help="YAML with toy settings (default: built-in defaults)")
    p.add_argument("--json", default=None, help="also write the results as JSON here")
    p.add_argument("--plot", default=None, help="write a PNG of bias against lag here")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. seed=3 off_policy_lag=5")
    p.set_defaults(func=run)
