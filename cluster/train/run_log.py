"""The run directory (`runs/<name>/`) and metrics logging (metrics.jsonl + wandb).

The local directory is always written, whatever wandb does: `config.yaml` (resolved),
`metrics.jsonl` (one JSON object per step, flushed each line so a crash loses nothing),
`checkpoints/`, `final/`. wandb mirrors the same metrics; its mode comes from the config, else
WANDB_MODE, else offline (files only, no account needed).
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from cluster.config.loader import dump_config


def default_run_name(cfg) -> str:
    k = cfg.kl
    trunc = f"-C{k.truncate:g}" if k.truncate is not None else ""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return f"{k.estimator}-{k.placement.replace('+', '_')}-{k.importance}{trunc}-b{k.beta:g}-lag{cfg.max_lag}-s{cfg.seed}-{stamp}"


class RunLog:
    """Owns runs/<name>/ and the metrics sinks. Use as a context manager."""

    def __init__(self, cfg, run_dir: Path, resume_wandb_id: str | None = None):
        self.cfg, self.dir = cfg, Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        dump_config(cfg, self.dir / "config.yaml")
        self._metrics = open(self.dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115 - open for the run
        self._wandb = None
        self.wandb_id = resume_wandb_id
        self._start_wandb()

    def _start_wandb(self) -> None:
        mode = self.cfg.logging.wandb_mode or os.environ.get("WANDB_MODE") or "offline"
        if mode == "disabled":
            return
        import wandb

        lg = self.cfg.logging
        self._wandb = wandb.init(
            project=lg.wandb_project, group=lg.wandb_group, tags=lg.tags or None, mode=mode,
            name=self.dir.name, dir=str(self.dir), config=self.cfg.model_dump(mode="json"),
            id=self.wandb_id, resume="allow" if self.wandb_id else None)
        self.wandb_id = self._wandb.id

    def log(self, metrics: dict) -> None:
        clean = {k: (v if not isinstance(v, float) or math.isfinite(v) else str(v)) for k, v in metrics.items()}
        self._metrics.write(json.dumps(clean) + "\n")
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in metrics.items() if k != "step"}, step=int(metrics["step"]))

    def close(self) -> None:
        self._metrics.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
