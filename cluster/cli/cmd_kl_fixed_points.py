"""`klrl kl-fixed-points`: the toy trained to its fixed point, for every KL configuration.

Each configuration of the sweeps (kl/dynamics.py: the four KL configurations, the no-KL
control and the two per-decision-weight repairs) is trained on the enumerable toy from the
reference, at each lag (mu = the policy `lag` updates earlier), once with the exact expectation
of every update and once with n samples per update, and compared with the regularised optimum
pi* proportional to ref * exp(r / beta): KL(pi || pi*), the reward E_pi[r], the distance
KL(pi || ref), and where it ended (kl.dynamics.ends_at). It writes table.md (one row per
configuration and lag, each with an anchor the docs link to), fixed_points.json and
fixed_points.png (KL to pi* along training). Deterministic for its settings (seeded); minutes
on one CPU core.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

from cluster.cli.arg_types import number_in, whole_in
from cluster.analysis.labels import toy_anchor

DEFAULTS = {"beta": 0.3, "lags": [0, 2, 8], "steps": 800, "lr": 4.0, "samples": 8,
            "sampled_lr": 0.5, "seed": 0, "vocab": 3, "length": 2}
OUTPUTS = ("fixed_points.json", "table.md", "fixed_points.png")
SEED_MAX = 2**31 - 1  # as kl.table's seeds


def _lags(text: str) -> list[int]:
    """Comma-separated distinct whole numbers >= 0 (one plot panel and table row per lag)."""
    parts = [p.strip() for p in text.split(",")]
    try:
        lags = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"comma-separated whole numbers >= 0 such as 0,2,8; got {text!r}") from None
    if min(lags) < 0 or len(set(lags)) != len(lags):
        raise argparse.ArgumentTypeError(f"distinct lags >= 0 such as 0,2,8; got {text!r}")
    return lags


def check_out(out: Path) -> None:
    """--out is a directory, or can be made, and the three files can be written in it
    (ConfigError otherwise), so that minutes of training are not lost to a typo at the end."""
    from cluster.train.door.paths import check_creatable, check_writable_file

    check_creatable(out, "--out")
    for name in OUTPUTS:
        check_writable_file(out / name, "--out")


def compute(opts: dict) -> dict:
    import torch  # the toy's dependency; loaded only by this command

    from kl import dynamics as D

    torch.set_num_threads(1)  # tiny tensors: threads only add overhead
    task = D.Task.make(opts["vocab"], opts["length"], opts["seed"])
    beta = opts["beta"]
    star = task.optimum(beta)
    rows = []
    for cfg in D.CONFIGURATIONS:
        for lag in opts["lags"]:
            row = {"configuration": cfg.name, "lag": lag, "anchor": toy_anchor(cfg.name, lag)}
            ends = {}
            for mode, samples, lr in (("exact", None, opts["lr"]),
                                      ("sampled", opts["samples"], opts["sampled_lr"])):
                tr = D.train(task, cfg, beta, lag, opts["steps"], lr, samples, opts["seed"])
                ends[mode] = D.T.sequence_prob(tr.final_logits, task.space)
                row[mode] = {"kl_to_optimum": tr.kl_to_optimum, "reward": tr.reward,
                             "kl_to_ref": tr.kl_to_ref, "top_mass": tr.top_mass,
                             "max_grad_norm": tr.max_grad_norm, "finite": tr.finite,
                             "last_update": tr.last_update, "ends_at": D.ends_at(tr, task, beta),
                             "kl_to_optimum_curve": list(tr.kl_to_optimum_curve)}
            # Sampling noise keeps a sampled run off any fixed point: it gets a distance to
            # where the exact run ended, not a label.
            row["sampled"]["kl_to_exact_end"] = D.reverse_kl(ends["sampled"], ends["exact"])
            rows.append(row)
    ref = D.T.sequence_prob(task.ref_logits, task.space)
    return {"settings": opts, "machine": f"{platform.node()} ({platform.machine()}, "
            f"{os.cpu_count()} cores, {platform.system()}), torch {torch.__version__}",
            "optimum": {"reward": float(star @ task.reward),
                        "kl_to_ref": D.reverse_kl(star, ref)},
            "max_reward": float(task.reward.max()), "sequences": int(task.reward.numel()),
            "rows": rows}


def _num(v: float) -> str:
    return "-" if v != v else f"{v:.2e}" if abs(v) < 1e-2 or abs(v) >= 1e4 else f"{v:.3f}"


def table_markdown(result: dict) -> str:
    s = result["settings"]
    lines = [
        "# The toy trained to its fixed point",
        "",
        f"Written by `klrl kl-fixed-points --out docs/sweeps/toy` on {result['machine']}. "
        f"Toy: vocabulary {s['vocab']} with EOS, length {s['length']} "
        f"({result['sequences']} sequences), seed {s['seed']}, rewards uniform on [0, 1]; "
        f"beta {s['beta']:g}; {s['steps']} gradient steps of size {s['lr']:g} on the logits "
        f"from the reference; mu = the policy `lag` steps earlier. pi* (proportional to "
        f"ref x exp(r / beta)) has reward {result['optimum']['reward']:.3f} and KL to the "
        f"reference {result['optimum']['kl_to_ref']:.3f}; the best sequence has reward "
        f"{result['max_reward']:.3f}. Exact: every update is the exact expectation under mu; "
        f"n = {s['samples']}: {s['samples']} sequences drawn from mu per update, leave-one-out "
        f"baselines, steps of size {s['sampled_lr']:g}: sampling noise keeps such a run off "
        "any fixed point, so it gets its distance to where the exact run ended, which is "
        "small where that end is a fixed point and large where there is none (no KL, K1 in "
        "the loss: the sampled run, at its smaller steps, is only part of the way). "
        "*Diverged*: a non-finite step (the plot's curve stops there; the row's values are "
        "the last finite ones). The method: "
        "[KL regularisation](../../kl.md#where-each-configuration-leads).",
        "",
        "| configuration | lag | ends at (exact) | KL(pi‖pi*) | reward | KL(pi‖ref) | "
        "top sequence's mass | largest gradient norm | n samples: KL to the exact end | "
        "KL(pi‖pi*), n | KL(pi‖ref), n |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        e, n = r["exact"], r["sampled"]
        lines.append(
            f"| <a id=\"{r['anchor']}\"></a>{r['configuration']} | {r['lag']} | "
            f"**{e['ends_at']}** | {_num(e['kl_to_optimum'])} | {_num(e['reward'])} | "
            f"{_num(e['kl_to_ref'])} | {_num(e['top_mass'])} | {_num(e['max_grad_norm'])} | "
            f"{_num(n['kl_to_exact_end'])} | {_num(n['kl_to_optimum'])} | "
            f"{_num(n['kl_to_ref'])} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lags = result["settings"]["lags"]
    fig, axes = plt.subplots(1, len(lags), figsize=(5 * len(lags), 4), sharey=True,
                             squeeze=False)  # one lag: still a row of axes
    axes = axes[0]
    every = 10  # kl.dynamics.train's record_every
    for ax, lag in zip(axes, lags):
        for r in (r for r in result["rows"] if r["lag"] == lag):
            curve = r["exact"]["kl_to_optimum_curve"]
            # Curves that coincide (no KL and K1 in the loss on-policy; prefix variants) stay
            # visible: the no-KL control thick and faint underneath, prefix variants dashed.
            name = r["configuration"]
            style = {"lw": 5, "alpha": 0.35} if name == "no KL" else \
                {"ls": "--"} if "prefix" in name else {}
            ax.plot([i * every for i in range(len(curve))], curve, label=name, **style)
        ax.set_yscale("log")
        ax.set_title(f"lag {lag} (exact expectation)")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("KL(pi || pi*)")
    axes[-1].legend(fontsize=7, loc="lower left")
    fig.suptitle(f"Where each KL configuration leads on the toy (beta "
                 f"{result['settings']['beta']:g}): distance to the regularised optimum")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args) -> int:
    opts = dict(DEFAULTS)
    for key in ("beta", "steps", "lr", "samples", "sampled_lr", "seed"):
        if getattr(args, key) is not None:
            opts[key] = getattr(args, key)
    if args.lags:
        opts["lags"] = args.lags
    out = Path(args.out)
    try:
        check_out(out)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result = compute(opts)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fixed_points.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "table.md").write_text(table_markdown(result))
    plot(result, out / "fixed_points.png")
    print(table_markdown(result))
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("kl-fixed-points", help="train the toy to its fixed point for "
                              "every KL configuration", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for table.md, fixed_points.json "
                   "and fixed_points.png")
    p.add_argument("--beta", type=number_in(0, low_open=True), default=None,
                   help=f"kl.beta, above 0 (default {DEFAULTS['beta']})")
    p.add_argument("--lags", type=_lags, default=None,
                   help="comma-separated distinct lags >= 0 (default 0,2,8)")
    p.add_argument("--steps", type=whole_in(1), default=None,
                   help=f"updates, at least 1 (default {DEFAULTS['steps']})")
    p.add_argument("--lr", type=number_in(0, low_open=True), default=None,
                   help=f"step size, above 0 (default {DEFAULTS['lr']})")
    p.add_argument("--samples", type=whole_in(2), default=None, help="sequences per sampled "
                   f"update, at least 2 (default {DEFAULTS['samples']})")
    p.add_argument("--sampled-lr", type=number_in(0, low_open=True), default=None,
                   dest="sampled_lr",
                   help="step size of the sampled runs, above 0 (default "
                   f"{DEFAULTS['sampled_lr']})")
    p.add_argument("--seed", type=whole_in(0, SEED_MAX), default=None,
                   help=f"seed of the toy and the samples, 0 to {SEED_MAX} (default 0)")
    p.set_defaults(func=run)
