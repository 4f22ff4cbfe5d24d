"""How config values become labels: dotted keys, run names and report labels.

Shared by `klrl sweep` (run names, sweep.py) and `klrl report` (configuration labels and
plot styles, report.py / report_plots.py). They live in a module of their own so that those
three import it rather than each other: report and sweep importing each other would be an
import cycle.
"""
from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

# How reports name each evaluation set (rewards.config.EVAL_SETS).
SET_LABELS = {"in_domain": "in-domain", "out_of_domain": "out-of-domain",
              "far_out_of_domain": "far out-of-domain", "retained": "retained"}

# Config keys that differ between runs without making them different configurations.
NOT_CONFIGURATION = ("seed", "run_name", "output_dir", "logging.")
ALWAYS_NAMED = ("kl.estimator", "kl.placement")
# Label order: the KL configuration first, then the async lag, then anything else.
KEY_ORDER = ["kl.estimator", "kl.placement", "kl.importance", "kl.truncate", "kl.beta",
             "kl.kl_in_advantage", "max_lag"]

# Short forms for run names: kl.beta=0.05 -> b0.05, max_lag=2 -> lag2, seed=0 -> s0; the KL
# estimator and placement are their own names (k1, reward). Other keys: <last part>_<value>.
_PREFIX = {"kl.beta": "b", "max_lag": "lag", "seed": "s", "kl.truncate": "C",
           "kl.importance": "is_", "learner.lr": "lr", "total_steps": "T"}
_BARE = {"kl.estimator", "kl.placement"}


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """Nested config dicts as one dict of dotted keys (`{"kl": {"beta": 0}}` -> `kl.beta`)."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out |= flatten(value, f"{prefix}{key}.")
        else:
            out[prefix + key] = value
    return out


def value_token(key: str, value: Any) -> str:
    """A grid value as it appears in run names and report labels (`b0.05`, `k3`, `lag2`)."""
    text = format(value, "g") if isinstance(value, float) else str(value)
    prefix = "" if key in _BARE else _PREFIX.get(key, key.rsplit(".", 1)[-1] + "_")
    return re.sub(r"[^\w.\-]", "_", prefix + text)


def configuration_keys(runs: Sequence[Any]) -> list[str]:
    """The KL estimator and placement (what "a configuration" means here, always named), then
    the config keys whose values differ between the runs (seed, names and logging aside).
    kl.beta is also named when a run has none (0): its estimator and placement then mean
    nothing, and a label without `b0` would pass a no-KL control off as a KL configuration."""
    keys = {k for r in runs for k in r.config if not k.startswith(NOT_CONFIGURATION)}
    no_kl = any(r.config.get("kl.beta") == 0 for r in runs)
    chosen = [k for k in keys if k in ALWAYS_NAMED or (k == "kl.beta" and no_kl)
              or len({json.dumps(r.config.get(k), sort_keys=True) for r in runs}) > 1]
    return sorted(chosen,
                  key=lambda k: (KEY_ORDER.index(k) if k in KEY_ORDER else len(KEY_ORDER), k))
