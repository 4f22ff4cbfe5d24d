"""How config values become labels: dotted keys, run names and report labels.

Shared by `klrl sweep` (run names, sweeps/sweep.py) and `klrl report` (configuration labels and
plot styles, report.py / report_plots.py). They live in a module of their own so that those
three import it rather than each other: report and sweep importing each other would be an
import cycle.
"""
from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from cluster.train.run_meaning import is_free

def toy_anchor(configuration: str, lag: int) -> str:
    """The anchor of a configuration's row in `klrl kl-fixed-points`'s table (its name as
    kl.dynamics and the findings' arms spell it, e.g. "K1 in loss + importance prefix"):
    docs and reports link `sweeps/toy/table.md#<anchor>`."""
    words = "".join(c if c.isalnum() else " " for c in configuration.lower()).split()
    return "-".join([*words, "lag", str(lag)])


# How reports name each evaluation set (rewards.config.EVAL_SETS).
SET_LABELS = {"in_domain": "in-domain", "out_of_domain": "out-of-domain",
              "far_out_of_domain": "far out-of-domain", "retained": "retained"}

# Config keys that differ between runs without making them different configurations: the
# seed (a configuration's runs are its seeds) and the keys that never change what a run trains
# or measures (cluster/train/run_meaning.py's FREE, the rule `--resume` and `klrl sweep` apply
# too). A label made of them could not tell two configurations apart.
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


def label_value(config: dict[str, Any], key: str) -> Any:
    """`key`'s value in a flattened config; "on" for a section the run has (a LoRA run's
    `learner.lora`, whose values are its sub-keys), None where it has neither."""
    if key in config:
        return config[key]
    return "on" if any(k.startswith(key + ".") for k in config) else None


def _sections(runs: Sequence[Any]) -> set[str]:
    """Optional config sections that some runs have and others leave null (`learner.lora`
    with and without LoRA): one key, `lora_on` / `lora_off`, rather than every sub-key."""
    null = {k for r in runs for k, v in r.config.items() if v is None}
    return {k for k in null if any(label_value(r.config, k) == "on" for r in runs)}


def _differs(runs: Sequence[Any], key: str) -> bool:
    return len({json.dumps(label_value(r.config, key), sort_keys=True) for r in runs}) > 1


def configuration_keys(runs: Sequence[Any]) -> list[str]:
    """The KL estimator and placement (what "a configuration" means here, always named), then
    the config keys whose values differ between the runs (seed, names and bookkeeping aside).
    kl.beta is also named when a run has none (0): its estimator and placement then mean
    nothing, and a label without `b0` would pass a no-KL control off as a KL configuration. A
    section some runs leave null is one key; its sub-keys are named only where they differ
    among the runs that have it."""
    sections = _sections(runs)
    keys = {k for r in runs for k in r.config if k != "seed" and not is_free(k)} | sections
    no_kl = any(r.config.get("kl.beta") == 0 for r in runs)

    def named(key: str) -> bool:
        if key in ALWAYS_NAMED or (key == "kl.beta" and no_kl):
            return True
        section = next((s for s in sections if key.startswith(s + ".")), None)
        having = [r for r in runs if section is None or label_value(r.config, section) == "on"]
        return _differs(having, key)

    return sorted((k for k in keys if named(k)),
                  key=lambda k: (KEY_ORDER.index(k) if k in KEY_ORDER else len(KEY_ORDER), k))


def configuration_labels(runs: Sequence[Any]) -> list[str]:
    """Each run's configuration label (`k1-reward-lag2`, `k1-reward-lora_on-lr0.001`): the
    values of `configuration_keys`, in their order; "" when no key differs."""
    keys, sections = configuration_keys(runs), _sections(runs)

    def token(config: dict[str, Any], key: str) -> str:
        value = label_value(config, key)
        return value_token(key, ("on" if value == "on" else "off") if key in sections else value)

    return ["-".join(token(r.config, k) for k in keys) for r in runs]
