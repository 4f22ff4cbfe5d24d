"""`klrl train --dry-run`: every check a real start makes, and nothing started or written.

A real start runs the door (`door.preflight`: the config's paths, models, dataset files,
plug-ins, wandb, the Ray address, local resources, the LoRA targets, the resume target), then
builds the embedded tiny model if it is not cached, starts or joins Ray, checks a joined
cluster's nodes (`door.resources.check_cluster_resources`) and builds the prompt stream, which
refuses epochs that do not hold one batch and a `data.max_prompt_length` no prompt fits. The dry
run makes all of these checks but the build: the prompt stream is built here (the tokenizer
of a model that exists; a tiny model not built yet is said so), and a cluster named by
ray.address or RAY_ADDRESS is joined for its nodes' resources and left at once. No local Ray
is started, no model built, no run directory made. Raises ConfigError (or FileExistsError) as
a real start would.
"""
from __future__ import annotations

import os
from pathlib import Path

from cluster.config.train_config import TrainConfig


def dry_run(cfg: TrainConfig, resume: bool) -> list[str]:
    """Check `cfg` as `klrl train` would start it (`resume`: with --resume); returns what the
    start would do, one line each."""
    from cluster.tiny.model import RECIPES, default_model_dir
    from cluster.train.door.paths import resolve_paths
    from cluster.train.door.preflight import preflight
    from cluster.train.prompts import PromptStream

    cfg = resolve_paths(cfg)
    run_dir, resume_from = preflight(cfg, resume)
    lines = [f"run {cfg.run_name}: " + (f"would resume from {resume_from}" if resume_from
                                        else f"would start in {run_dir}")]
    model_dir: Path | str | None = cfg.model.path
    if model_dir is None:
        built = default_model_dir(recipe=cfg.model.embedded)
        if built.is_dir():  # a build is renamed into place whole
            model_dir = built
            lines.append(f"model: the embedded tiny model ({built})")
        else:
            lines.append(f"model: the embedded tiny model, not built yet: the start builds it "
                         f"first into {built} ({RECIPES[cfg.model.embedded].build_time})")
    else:
        lines.append(f"model: {model_dir}")
    if model_dir is not None or cfg.data.max_prompt_length is None:
        stream = PromptStream.for_run(cfg, model_dir)
        lines.append(f"data: {cfg.task.name}, split {cfg.task.train_split}: "
                     + (f"{stream.block_size} prompts" if stream.finite else "generated"))
    else:
        lines.append("data: data.max_prompt_length is checked once the model is built")
    if address := os.environ.get("RAY_ADDRESS") or cfg.ray.address:
        lines.append(_cluster_resources(cfg, address))
    return lines


def _cluster_resources(cfg: TrainConfig, address: str) -> str:
    """Join the cluster at `address` as a real start does, check that its nodes hold the run's
    requests, and leave it (it keeps running)."""
    import ray

    from cluster.train.door.resources import check_cluster_resources
    from cluster.train.launch import start_ray

    start_ray(cfg)
    try:
        check_cluster_resources(cfg)
        nodes = sum(bool(n.get("Alive")) for n in ray.nodes())
    finally:
        ray.shutdown()
    return f"resources: the Ray cluster at {address} ({nodes} alive node(s)) holds the requests"
