"""Pre-flight: the door of a training run (`klrl train`, `klrl demo`, each run of a local
`klrl sweep`). Every check it can make before it starts anything (the tiny model build, Ray,
DeepSpeed, vLLM) or writes anything, so that a mistake costs a second and one message, not a
traceback from an actor and a run directory that then blocks the name.

`train()` (cluster/train/run.py) calls `preflight` first, unless its caller just did (`klrl
train` runs it on the terminal before it names the run, and hands train() the result); a local
`klrl sweep` calls it for every unfinished run before it starts the first
(cluster/sweeps/sweep.py, preflight_runs). Each rule lives with what
it checks (cluster/train/door/ lists them all); this module calls them in order, on the
config with its paths made absolute (`door.paths.resolve_paths`). Raises ConfigError (or
FileExistsError for a name already taken); `klrl train` exits 2. Lines worth saying that are
no refusal (malformed dataset rows within the allowed share) go to stderr as warnings.

One check needs Ray up and so runs after it starts, before any actor (`check_cluster_resources`,
with a ray.address: the nodes of a cluster are known once joined).
"""
from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from cluster.config.loader import ConfigError
from cluster.config.train_config import TrainConfig
from cluster.train import checkpoint as ckpt
from cluster.train.door.models import (
    check_context,
    check_hub_name,
    check_model_dir,
    check_model_path,
)
from cluster.train.door.paths import check_output_dir, check_shm_dir, resolve_paths
from cluster.train.door.resources import check_cluster_resources, check_local_resources
from cluster.train.door.resume import check_checkpoint, check_run_exists
from cluster.train.door.tasks import check_tasks
from cluster.train.door.wandb import check_wandb
from cluster.train.run_log import default_run_name, has_metrics, is_finished
from cluster.train.run_meaning import check_resume_meaning

__all__ = ["check_cluster_resources", "check_environment", "check_lora", "check_output_dir",
           "check_ray_address", "preflight", "resolve_paths"]


def check_environment(cfg: TrainConfig) -> None:
    """What the config needs from this machine: its models, its plug-in scorer and tasks, its
    dataset files, a valid WANDB_MODE and a wandb key, a Ray address that answers, the
    resources and the shm directory it asks for. `cfg`'s paths must be absolute
    (`resolve_paths`)."""
    check_models(cfg)
    notes = check_tasks(cfg)  # plug-ins, data options, dataset files: each task built once
    check_engine_kwargs(cfg.rollout.engine_kwargs)
    check_wandb(cfg)
    address = os.environ.get("RAY_ADDRESS") or cfg.ray.address
    check_ray_address(address)
    if not address:
        check_local_resources(cfg)
    check_shm_dir(cfg)
    for note in notes:
        print(f"warning: {note}", file=sys.stderr, flush=True)


def check_models(cfg: TrainConfig) -> None:
    """model.path and model.ref_path: a model directory here (`door.models.check_model_dir`)
    or a hub name that is cached or that the hub serves; either's context must hold
    rollout.max_model_len. null (the embedded tiny model) passes."""
    for field, path, tokenizer in (("model.path", cfg.model.path, True),
                                   ("model.ref_path", cfg.model.ref_path, False)):
        if path is None:
            continue
        if Path(path).expanduser().exists():
            config = check_model_dir(Path(path).expanduser(), field, tokenizer)
        else:
            check_model_path(path, field)  # the shape of a hub name, before asking the hub
            config = check_hub_name(path, field, cfg.model.revision)
        if config is not None:
            check_context(config, field, cfg.rollout.max_model_len)


def check_ray_address(address: str | None) -> None:
    """A `host:port` GCS address must accept a TCP connection within 5 s: ray.init would
    otherwise wait for minutes on an address where nothing listens. ("auto" and ray:// client
    addresses are left to ray.init.) Here, before the tiny model is built, and again when Ray
    is joined (cluster/train/launch.py)."""
    if not address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as exc:
        raise ConfigError(f"ray.address={address}: nothing answers there ({exc.strerror or exc}); "
                          "start the cluster with `ray start --head` (its GCS port, 6379 by "
                          "default) or fix the address") from None


def check_engine_kwargs(engine_kwargs: dict) -> None:
    """Every rollout.engine_kwargs key must be an argument of the installed vLLM's engine
    (`actors.engine.unknown_engine_args`); the keys klrl sets itself are refused earlier, by
    RolloutConfig. Imports vLLM (seconds) only when engine_kwargs is set."""
    from actors.engine import unknown_engine_args

    if unknown := unknown_engine_args(engine_kwargs):
        import vllm

        raise ConfigError("rollout.engine_kwargs: " + "; ".join(
            f"{k!r} is not an argument of vLLM {vllm.__version__}'s engine"
            + (f" (did you mean {hint!r}?)" if hint else "") for k, hint in unknown.items())
            + "; see vLLM's EngineArgs")


def check_lora(cfg: TrainConfig, model_dir: Path | str | None) -> None:
    """learner.lora against the model, before anything starts: vLLM must serve LoRA for its
    architecture, and each named target module must be a linear layer of it. `model_dir`: the
    policy's directory or hub name, None for the embedded tiny model (its architecture, which
    needs no build). Builds the model on the meta device (no weights) and imports vLLM's model
    registry (a few seconds)."""
    spec = cfg.learner.lora
    if spec is None:
        return
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    hub = {"revision": cfg.model.revision, "trust_remote_code": cfg.model.trust_remote_code}
    if model_dir is None:
        from transformers import Qwen2Config

        from cluster.tiny.model import DEFAULT_SIZE  # every embedded recipe's architecture

        model_dir = "the embedded tiny model"
        config = Qwen2Config(**DEFAULT_SIZE, architectures=["Qwen2ForCausalLM"])
    else:
        config = AutoConfig.from_pretrained(str(model_dir), **hub)
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_lora

    for arch in config.architectures or []:
        cls = ModelRegistry._try_load_model_cls(arch)  # vLLM's own lookup of an architecture
        if cls is not None and not supports_lora(cls):
            raise ConfigError(f"learner.lora: vLLM cannot serve LoRA adapters for {arch} (the "
                              f"model at {model_dir}); train every weight (learner.lora=null)")
    if spec.target_modules == "all-linear":
        return
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config, trust_remote_code=cfg.model.trust_remote_code)
    linear = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    missing = [t for t in spec.target_modules
               if not any(n == t or n.endswith("." + t) for n in linear)]
    if missing:
        leaves = sorted({n.rsplit(".", 1)[-1] for n in linear})
        raise ConfigError(f"learner.lora.target_modules: {model_dir} has no linear layer named "
                          f"{', '.join(missing)}; its linear layers are {', '.join(leaves)}")


def preflight(cfg: TrainConfig, resume: bool = False) -> tuple[Path, Path | None]:
    """Check everything that can be checked before the run starts, touching nothing.
    Returns (run directory, checkpoint to resume from or None), both absolute."""
    cfg = resolve_paths(cfg)
    check_environment(cfg)
    check_lora(cfg, cfg.model.path)
    run_dir = Path(cfg.output_dir) / (cfg.run_name or default_run_name(cfg))
    if not run_dir.is_dir():
        check_output_dir(run_dir)
    if resume:
        check_run_exists(run_dir)
    resume_from = ckpt.latest_checkpoint(run_dir) if resume else None
    if resume_from is not None:
        _check_resumable(cfg, run_dir, resume_from, check_checkpoint(resume_from))
    elif has_metrics(run_dir) and not resume:
        raise FileExistsError(f"{run_dir} already holds a run; choose another run_name, or "
                              f"continue it with `klrl train --resume {run_dir}`")
    elif resume and is_finished(run_dir):
        raise ConfigError(
            f"cannot resume {run_dir}: the run finished and kept no checkpoint "
            "(checkpoint_every: 0), so resuming would retrain it from step 0. To train on from "
            f"its final weights, start a new run with model.path={run_dir / 'final'} (they "
            "are then also its KL reference); runs with checkpoint_every > 0 checkpoint at the "
            "end and extend with `klrl train --resume RUN_DIR total_steps=N`")
    return run_dir, resume_from


def _check_resumable(cfg: TrainConfig, run_dir: Path, resume_from: Path,
                     state: ckpt.ControllerState) -> None:
    check_resume_meaning(run_dir, resume_from, state.config, cfg.model_dump(mode="json"))
    if is_finished(run_dir) and state.step >= cfg.total_steps:
        raise ConfigError(
            f"cannot resume {run_dir}: it finished at step {state.step} (total_steps: "
            f"{cfg.total_steps}); to train longer, raise it: `klrl train --resume {run_dir} "
            f"total_steps={2 * state.step}`")
