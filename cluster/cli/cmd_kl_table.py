"""`klrl kl-table`: every KL configuration's exact expected gradient on a seeded toy.

For each configuration it prints the cosine to the true gradient g* = grad KL(pi||ref), the
relative error |E g - g*| / |g*| and the per-sample gradient variance, on-policy and
off-policy, whether the exact expectation matches docs/design.md's table, and a sweep of the bias
against the behaviour policy's lag. Everything is exact enumeration (no sampling), so the
numbers are deterministic for a seed; it runs in seconds on CPU.
"""
from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

SWEEP_VARIANTS = [
    ("k1", "reward", "none", None), ("k3", "reward", "none", None), ("k1", "loss", "none", None),
    ("k3", "loss", "none", None), ("k1", "reward", "token", None), ("k1", "reward", "sequence", None),
    ("k1", "reward", "prefix", None), ("k1", "reward", "prefix", 2.0), ("k3", "reward+loss", "prefix", None),
]


class KLTableConfig(BaseModel):
    """The toy problem and the lags shown by `klrl kl-table` (configs/kl_table.yaml)."""

    model_config = ConfigDict(extra="forbid")

    seed: int = Field(0, ge=0, description="Seed of the toy's policy, reference and drift direction.")
    vocab: int = Field(3, ge=2, le=6, description="Toy vocabulary size (token 0 is EOS when eos).")
    length: int = Field(4, ge=1, le=6, description="Maximum sequence length of the toy.")
    eos: bool = Field(True, description="Token 0 ends a sequence (variable lengths) when true.")
    ref_scale: float = Field(1.0, gt=0, le=10, description="How far the reference logits are from the policy's.")
    drift: float = Field(0.15, gt=0, le=5, description="Behaviour drift per unit of lag (logit scale).")
    off_policy_lag: float = Field(3.0, gt=0, le=100, description="Lag of the off-policy columns.")
    lags: list[float] = Field([0, 1, 2, 3, 4, 6, 8, 10], min_length=1, description="Lags of the bias sweep.")
    truncate: float = Field(2.0, gt=0, le=1e6, description="Cap C shown for the truncated prefix rows.")


def compute(cfg: KLTableConfig) -> dict:
    import torch

    from kl import toy as T
    from kl.analysis import (
        KLVariant,
        all_variants,
        cosine,
        expected_grad,
        gradient_variance,
        is_exact_correction,
        on_policy_prediction,
        reference_grads,
        relative_error,
        unbiased_for_g_star,
    )

    # The toy's tensors are tiny: thread start-up and contention cost more than the math.
    torch.set_num_threads(1)

    def make(lag):
        return T.ToyProblem.make(cfg.vocab, cfg.length, cfg.eos, cfg.seed, cfg.ref_scale, lag, cfg.drift)

    on, off = make(0.0), make(cfg.off_policy_lag)
    refs = {"on": reference_grads(on), "off": reference_grads(off)}
    variants = [v for v in all_variants((cfg.truncate,)) if v.truncate is None or v.importance == "prefix"]
    rows = []
    for v in variants:
        row = {"config": v.name, "estimator": v.estimator, "placement": v.placement,
               "importance": v.importance, "truncate": v.truncate,
               "unbiased_on_policy": unbiased_for_g_star(v),
               "unbiased_off_policy": unbiased_for_g_star(v) and is_exact_correction(v)}
        for key, toy in (("on", on), ("off", off)):
            g, r = expected_grad(toy, v), refs[key]
            row[f"{key}_cosine"] = cosine(g, r.g_star)
            row[f"{key}_rel_error"] = relative_error(g, r.g_star)
            row[f"{key}_variance"] = gradient_variance(toy, v)
            row[f"{key}_norm_ratio"] = float(g.norm() / r.g_star.norm())  # |E g| / |g*|
            if key == "on":
                g_on = g
        pred = on_policy_prediction(v, refs["on"])
        row["matches_design_table"] = bool(
            (g_on - pred).norm() <= 1e-6 * max(float(pred.norm()), 1e-12) or float(g_on.abs().max()) < 1e-12)
        rows.append(row)
    sweep = {}
    toys = [make(lag) for lag in cfg.lags]
    g_stars = [reference_grads(t).g_star for t in toys]
    for est, pl, imp, c in SWEEP_VARIANTS:
        v = KLVariant(est, pl, imp, c)
        sweep[v.name] = [relative_error(expected_grad(t, v), g) for t, g in zip(toys, g_stars)]
    return {"config": cfg.model_dump(), "num_sequences": int(on.space.tokens.shape[0]),
            "rows": rows, "lag_sweep": {"lags": list(cfg.lags), "rel_error": sweep}}


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    cfg = result["config"]
    table = Table(title=f"KL gradient estimators on a {cfg['vocab']}-token, length-{cfg['length']} toy "
                        f"({result['num_sequences']} sequences, exact). rel.err = |E g - g*| / |g*|")
    lag = f"lag {cfg['off_policy_lag']:g}"
    for col in ("config", "design table", "on: cos", "on: err", "on: var",
                f"{lag}: cos", f"{lag}: err", f"{lag}: var", "exact off-policy"):
        table.add_column(col, justify="left" if col == "config" else "right", no_wrap=True)
    for r in result["rows"]:
        zero = r["on_norm_ratio"] < 1e-9  # exactly zero in expectation: a cosine means nothing
        table.add_row(r["config"], "ok" if r["matches_design_table"] else "MISMATCH",
                      "(zero)" if zero else f"{r['on_cosine']:.3f}", f"{r['on_rel_error']:.3f}", f"{r['on_variance']:.3f}",
                      f"{r['off_cosine']:.3f}", f"{r['off_rel_error']:.3f}", f"{r['off_variance']:.3f}",
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


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = result["lag_sweep"]
    fig, ax = plt.subplots(figsize=(10, 5.5))
    for name, errs in sweep["rel_error"].items():
        exact = ("prefix" in name or "sequence" in name) and "C=" not in name
        ax.plot(sweep["lags"], errs, "-" if exact else "--", marker="o", ms=3, lw=2 if exact else 1.3,
                label=name + ("  (exact correction)" if exact else ""))
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


def run(args) -> int:
    from cluster.config.loader import ConfigError, load_config

    try:
        cfg = load_config(KLTableConfig, args.config, args.overrides)
    except ConfigError as exc:
        print(exc)
        return 2
    result = compute(cfg)
    print_table(result)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    if args.plot:
        plot(result, Path(args.plot))
        print(f"wrote {args.plot}")
    return 0 if all(r["matches_design_table"] for r in result["rows"]) else 1


def register(subparsers) -> None:
    p = subparsers.add_parser("kl-table", help="exact bias/variance of every KL configuration on a toy",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=None, help="YAML with toy settings (default: built-in defaults)")
    p.add_argument("--json", default=None, help="also write the results as JSON here")
    p.add_argument("--plot", default=None, help="write a PNG of bias against lag here")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. seed=3 off_policy_lag=5")
    p.set_defaults(func=run)
