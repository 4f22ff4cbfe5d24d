"""The GPU smoke run's own steps (cluster/bench/gpu_smoke.py), each a subcommand that writes
its findings as JSON to `$SMOKE_DETAILS` and exits 0 when its checks hold, 1 when not, 124
when it ran out of its time (`$SMOKE_TIMEOUT_S`):

- sanity: versions, the CUDA device, FlashAttention 3, klrl's packages; then one fp32 and one
  bf16 engine of klrl's own building (`actors.engine.make_llm`), each in a process of its own,
  saying which attention backend and which model runner vLLM picked (`engine_facts`);
- demo NAME: a short training run of `DEMOS` (the CLI, as users run it) and its metrics read
  back: batch mode over cuda_ipc at max_lag 0 (several syncs, each resetting the prefix cache
  with async scheduling on; the fp32 default; the log-ratio maxima), and in-flight updates at
  max_lag 2 on a random model whose responses run to their limit (updates land mid-generation:
  multi-version share > 0, preemptions, the lag bound);
- tf32: an fp32 engine's sampled-token log-probs against HF transformers in fp32 (eager
  attention, TF32 off) on the same tokens, with Triton's fp32 dots in TF32 and in IEEE fp32
  (TRITON_F32_DEFAULT, each with a Triton cache of its own): how much of the fp32 gap TF32 is.

Nothing here runs without CUDA: the smoke driver skips these steps first.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from cluster.config.loader import REPO_ROOT

MEMORY = 0.3      # each probe engine's gpu_memory_utilization: room for the next one
PROMPTS = 16      # prompts of an engine probe, one sample each
TOKENS = 32       # sampled tokens per prompt
BACKEND_LINE = re.compile(r"(Using .*(?:backend|FlashAttention).*|.*[Mm]odel [Rr]unner.*V2.*)")
MARGIN_S = 15     # kept back from the step's time for reading and writing the findings


def details(found: dict[str, Any]) -> None:
    path = os.environ.get("SMOKE_DETAILS")
    text = json.dumps(found, indent=1, sort_keys=True, default=str)
    if path:
        Path(path).write_text(text)
    print(text, flush=True)


def time_left(default: float = 300) -> float:
    return float(os.environ.get("SMOKE_TIMEOUT_S", default)) - MARGIN_S


def work_dir() -> Path:
    return Path(os.environ.get("SMOKE_WORK", "/tmp/klrl-smoke"))


def random_model(name: str = "random_tiny") -> Path:
    """A random tiny Qwen2 (built in well under a second): its responses seldom end before
    their limit, which the in-flight demo needs."""
    from cluster.tiny.model import build_random_model

    path = work_dir() / "models" / name
    return path if (path / "config.json").is_file() else build_random_model(path, seed=0)


def demo_model() -> Path:
    """The demo model (the payload carries it into KLRL_HOME), else the random one."""
    from cluster.tiny.model import default_model_dir

    path = default_model_dir()
    return path if (path / "config.json").is_file() else random_model()


# --------------------------------------------------------------------------- engines


def engine(model: str, dtype: str, out: Path, seed: int = 0) -> None:
    """One engine of klrl's building: its facts and a batch of sampled tokens with their
    log-probs, into `out` (the child process of `run_engine`)."""
    from actors.engine import engine_facts, make_llm, sample_params, shutdown_llm
    from actors.outputs import sampled_logprobs

    t0 = time.perf_counter()
    # eager: no CUDA-graph capture (tens of seconds of the window); the attention backend and
    # the model runner vLLM picks, and the kernels' numerics, do not depend on it
    llm = make_llm(model, dtype=dtype, gpu_memory_utilization=MEMORY, max_model_len=256,
                   seed=seed, enforce_eager=True)
    start_s = time.perf_counter() - t0
    facts = engine_facts(llm)
    prompts = [f"{a}+{b}=" for a, b in zip(range(10, 10 + PROMPTS), range(40, 40 + PROMPTS))]
    params = [sample_params(TOKENS, seed=seed + i, logprobs=0) for i in range(PROMPTS)]
    t1 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    samples = [{"prompt_ids": list(o.prompt_token_ids), "token_ids": list(o.outputs[0].token_ids),
                "logprobs": sampled_logprobs(o.outputs[0])} for o in outputs]
    out.write_text(json.dumps({"dtype": dtype, "facts": facts, "start_s": start_s,
                               "generate_s": time.perf_counter() - t1, "samples": samples,
                               "TRITON_F32_DEFAULT": os.environ.get("TRITON_F32_DEFAULT")}))
    shutdown_llm(llm)


def run_engine(model: Path, dtype: str, tag: str, timeout_s: float,
               env: dict[str, str] | None = None) -> dict[str, Any]:
    """`engine` in a process of its own (one engine per process: module docstring of
    actors.engine), its output shown; the lines where vLLM names its attention backend kept."""
    out = work_dir() / f"engine_{tag}.json"
    out.unlink(missing_ok=True)
    t0 = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "cluster.bench.gpu_probe", "engine",
                               str(model), dtype, str(out)], cwd=REPO_ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              timeout=max(timeout_s, 1), env={**os.environ, **(env or {})})
        code, text = done.returncode, done.stdout
    except subprocess.TimeoutExpired as e:
        code, text = None, e.stdout or ""
        text = text.decode(errors="replace") if isinstance(text, bytes) else text
    print(text, flush=True)
    found: dict[str, Any] = {"returncode": code, "seconds": round(time.perf_counter() - t0, 1),
                             "log_lines": sorted(set(BACKEND_LINE.findall(text)))[:12]}
    if out.is_file():
        found |= json.loads(out.read_text())
    return found


def sanity() -> int:
    import torch

    import vllm

    found: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                             "vllm": vllm.__version__}
    for name in ("ray", "deepspeed", "transformers", "triton"):
        try:
            found[name] = __import__(name).__version__
        except Exception as e:  # noqa: BLE001 - a missing package is the finding
            found[name] = f"import failed: {type(e).__name__}: {e}"
    found["device"] = {"name": torch.cuda.get_device_name(0),
                       "capability": list(torch.cuda.get_device_capability(0)),
                       "count": torch.cuda.device_count(),
                       "nccl": list(torch.cuda.nccl.version())}
    try:
        from vllm.vllm_flash_attn.flash_attn_interface import (
            fa_version_unsupported_reason,
            is_fa_version_supported,
        )

        found["fa3"] = is_fa_version_supported(3) or fa_version_unsupported_reason(3)
    except Exception as e:  # noqa: BLE001
        found["fa3"] = f"not importable: {type(e).__name__}: {e}"
    import actors  # noqa: F401 - klrl's packages, as Ray's workers import them
    import kl  # noqa: F401
    import learner  # noqa: F401
    import rewards  # noqa: F401
    cli = subprocess.run([sys.executable, "-m", "cluster.cli", "--help"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=120)
    found["klrl_imports"] = "ok" if cli.returncode == 0 else cli.stderr[-500:]
    model = random_model()
    found["engines"] = {}
    for k, dtype in enumerate(("float32", "bfloat16")):
        left = (time_left() - (time.perf_counter() - T0)) / (2 - k)  # a hung first leaves half
        found["engines"][dtype] = {k: v for k, v in run_engine(model, dtype, dtype, left).items()
                                   if k != "samples"}
    details(found)
    return 0 if all(e["returncode"] == 0 for e in found["engines"].values()) else 1


# --------------------------------------------------------------------------- TF32


def hf_logprobs(model_dir: Path, samples: list[dict[str, Any]],
                device: str = "cuda") -> list[list[float]]:
    """Each sample's sampled-token log-probs under HF transformers in exact fp32 (eager
    attention; TF32 off for matmuls and cuDNN) on `device`."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager").to(device).eval()
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s["prompt_ids"] + s["token_ids"]], device=device)
            logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
            n = len(s["prompt_ids"])
            rows = torch.arange(n - 1, n - 1 + len(s["token_ids"]), device=device)
            out.append(logp[rows, torch.tensor(s["token_ids"], device=device)].tolist())
    return out


def compare(model_dir: Path, samples: list[dict[str, Any]], device: str = "cuda") -> dict:
    """The largest and mean |engine - HF fp32| over the sampled tokens of `samples`."""
    want = hf_logprobs(model_dir, samples, device)
    diffs = [abs(a - b) for s, w in zip(samples, want) for a, b in zip(s["logprobs"], w)]
    return {"max_abs_logprob_diff": max(diffs), "mean_abs_logprob_diff": sum(diffs) / len(diffs),
            "tokens_compared": len(diffs)}


def tf32() -> int:
    model = demo_model()
    found: dict[str, Any] = {"model": str(model), "prompts": PROMPTS, "tokens": TOKENS}
    for precision in ("tf32", "ieee"):
        left = (time_left() - (time.perf_counter() - T0)) / (2 if precision == "tf32" else 1)
        env = {"TRITON_F32_DEFAULT": precision,
               "TRITON_CACHE_DIR": str(work_dir() / f"triton_{precision}")}
        ran = run_engine(model, "float32", f"tf32_{precision}", left - 20, env)
        row = {k: ran.get(k) for k in ("returncode", "seconds", "facts", "log_lines",
                                       "TRITON_F32_DEFAULT")}
        if ran.get("samples"):
            row |= compare(model, ran["samples"])
        found[precision] = row
    ok = all("max_abs_logprob_diff" in found[p] for p in ("tf32", "ieee"))
    if ok:
        found["ieee_over_tf32"] = (found["ieee"]["max_abs_logprob_diff"]
                                   / max(found["tf32"]["max_abs_logprob_diff"], 1e-12))
    details(found)
    return 0 if ok else 1


# --------------------------------------------------------------------------- demo runs


def _demo_overrides(name: str) -> list[str]:
    from cluster.bench.gpu import gpu_overrides

    common = [*gpu_overrides("float32", "cuda_ipc"), "eval_every=0", "eval.num_problems=8",
              "eval.samples=0", "logging.wandb_mode=disabled", f"run_name=smoke_{name}",
              f"output_dir={work_dir() / 'runs'}"]
    if name == "batch_lag0":
        return [*common, "max_lag=0", "total_steps=6"]
    if name == "in_flight_lag2":
        return [*common, f"model.path={random_model()}", "rollout.in_flight_updates=true",
                "max_lag=2", "total_steps=8", "rollout.max_new_tokens=96",
                "rollout.prompts_per_step=16"]
    raise SystemExit(f"no demo {name!r}: batch_lag0, in_flight_lag2")


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A run's metrics, as the checks need them: the extremes over its steps."""
    steps = [r for r in rows if "reward/mean" in r]

    def values(key):
        return [r[key] for r in steps if isinstance(r.get(key), (int, float))]

    def extreme(key, fn):
        v = values(key)
        return fn(v) if v else None

    later = [r["time/step"] for r in steps[2:] if isinstance(r.get("time/step"), (int, float))]
    return {"steps": len(steps), "ratio_min": extreme("is/ratio_min", min),
            "ratio_max": extreme("is/ratio_max", max),
            "abs_log_ratio_max": extreme("is/abs_log_ratio_max", max),
            "abs_log_ratio_token_mean_max": extreme("is/abs_log_ratio_token_mean", max),
            "lag_max": extreme("lag/max", max), "token_lag_max": extreme("lag/token_max", max),
            "multi_version_share_max": extreme("lag/multi_version_share", max),
            "preempted": sum(values("rollout/preempted")) if values("rollout/preempted")
            else None,
            "step_s_mean_after_2": sum(later) / len(later) if later else None,
            "gen_tokens_per_s_max": extreme("throughput/gen_tokens_per_s", max)}


def demo(name: str) -> int:
    from cluster.train.run_log import read_metrics

    overrides = _demo_overrides(name)
    command = [sys.executable, "-m", "cluster.cli", "train", "configs/tiny_cpu.yaml", *overrides]
    print("$", " ".join(command), flush=True)
    try:
        code = subprocess.run(command, cwd=REPO_ROOT, timeout=max(time_left(), 1)).returncode
    except subprocess.TimeoutExpired:
        code = None
    run_dir = work_dir() / "runs" / f"smoke_{name}"
    rows = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    from cluster.config.train_config import load_train_config

    cfg = load_train_config(REPO_ROOT / "configs" / "tiny_cpu.yaml", overrides)
    found: dict[str, Any] = {
        "returncode": code, "overrides": overrides,
        # what the config made of the settings the step is there to check
        "engine_dtype": cfg.worker_rollout.dtype,
        "start_order": ("the learner after every engine" if cfg.learner_may_share_a_gpu
                        else "side by side"),
        "engine_kwargs": cfg.rollout.engine_kwargs} | summarise(rows)
    want = int(next(o for o in overrides if o.startswith("total_steps="))
               .split("=")[1])
    checks = {"all steps ran": found["steps"] == want}
    if name == "in_flight_lag2":
        checks |= {"samples span two versions (multi-version share > 0)":
                   (found["multi_version_share_max"] or 0) > 0,
                   "lag within max_lag 2": found["lag_max"] is not None and found["lag_max"] <= 2
                   and (found["token_lag_max"] is None or found["token_lag_max"] <= 2)}
    else:
        checks |= {"on-policy (lag 0)": found["lag_max"] == 0}
    found["checks"] = checks
    details(found)
    if code is None:
        return 124
    return 0 if code == 0 and all(checks.values()) else 1


T0 = time.perf_counter()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.bench.gpu_probe",
                                     description=(__doc__ or "").split("\n\n")[0])
    sub = parser.add_subparsers(dest="probe", required=True)
    sub.add_parser("sanity")
    sub.add_parser("tf32")
    p = sub.add_parser("demo")
    p.add_argument("name", choices=["batch_lag0", "in_flight_lag2"])
    p = sub.add_parser("engine")  # run_engine's child
    p.add_argument("model")
    p.add_argument("dtype")
    p.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    if args.probe == "engine":
        engine(args.model, args.dtype, args.out)
        return 0
    return {"sanity": sanity, "tf32": tf32}.get(args.probe, lambda: demo(args.name))()


if __name__ == "__main__":
    sys.exit(main())
