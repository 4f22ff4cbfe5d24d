"""Pre-flight: every check a training run can make before it starts anything (the tiny model
build, Ray, DeepSpeed, vLLM) or writes anything, so that a mistake costs a second and one
message, not a traceback from an actor and a run directory that then blocks the name.

`train()` (cluster/train/run.py) calls `preflight` first; a local `klrl sweep` calls it for
every unfinished run before it starts the first (cluster/experiments/sweep.py, preflight_runs). Each rule lives with what it
checks; this module only calls them:
- the config itself (fields, task options and splits): pydantic, at load time (train_config.py,
  rewards/config.py);
- model.path and model.ref_path: `train_config.check_model_path`;
- task.reward: `rewards.load_scorer` (imports it as the rollout workers will);
- plug-in tasks (task.name, eval.<set>.task "package.module:TaskClass"): `rewards.config.
  check_plugins` (imports them, then checks their options and splits as validation does for
  the tasks of rewards/);
- rollout.engine_kwargs: each key an argument of the installed vLLM (`check_engine_kwargs`);
- local dataset files (there, not empty, rows in the task's schema): `rewards.config.
  check_local_datasets`;
- an online wandb run's API key: `run_log.check_wandb`;
- a Ray address that nothing answers on, and an output directory where no run directory can
  be made: here;
- the run directory and resume: here, with `checkpoint.objective_changes`.
Raises ConfigError (or FileExistsError for a name already taken); `klrl train` exits 2.

One check needs Ray up and so runs after it starts, before any actor (`check_cluster_resources`).
"""
from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

from cluster.config.loader import ConfigError
from cluster.config.train_config import TrainConfig, check_model_path
from cluster.train import checkpoint as ckpt
from cluster.train.run_log import check_wandb, default_run_name, has_metrics, is_finished


def check_environment(cfg: TrainConfig) -> None:
    """What the config needs from this machine: its model, its plug-in scorer and tasks, a
    wandb key."""
    check_model_path(cfg.model.path)
    check_model_path(cfg.model.ref_path, "model.ref_path")
    from rewards import load_scorer
    from rewards.config import check_local_datasets, check_plugins

    # Plug-ins are imported here, as the rollout workers will; a failed import's message says
    # how to make it importable (rewards/plugin.py).
    if cfg.task.reward:
        try:
            load_scorer(cfg.task.reward)
        except ValueError as exc:
            raise ConfigError(f"task.reward: {exc}") from None
    try:
        check_plugins(cfg.task, cfg.eval)  # plug-in tasks; each message names its field
        cfg.data.check_task(cfg.task)  # a plug-in's epochs/order: not checked at load time
        check_local_datasets(cfg.task, cfg.eval)  # a local file: there, not empty, in schema
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    check_engine_kwargs(cfg.rollout.engine_kwargs)
    check_wandb(cfg)
    check_ray_address(os.environ.get("RAY_ADDRESS") or cfg.ray.address)


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


def check_output_dir(run_dir: Path, field: str = "output_dir") -> None:
    """The run directory must be creatable: its nearest existing ancestor a directory in which
    a directory can be made (tried with a temporary one, removed at once; root passes
    permission checks, so asking `os.access` is not enough, and /proc refuses anyway)."""
    parent = run_dir.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    try:
        if not parent.is_dir():
            raise NotADirectoryError(f"{parent} is not a directory")
        os.rmdir(tempfile.mkdtemp(prefix=".klrl-preflight-", dir=parent))
    except OSError as exc:
        raise ConfigError(f"{field}={run_dir.parent}: cannot create the run directory there "
                          f"({exc.strerror or exc}); choose a writable output_dir") from None


def check_engine_kwargs(engine_kwargs: dict) -> None:
    """Every rollout.engine_kwargs key must be an argument of the installed vLLM's engine
    (`actors.engine.unknown_engine_args`); the keys klrl sets itself are refused earlier, by
    RolloutConfig. Imports vLLM only when engine_kwargs is set (about 6 s on 2 busy cores)."""
    from actors.engine import unknown_engine_args

    if unknown := unknown_engine_args(engine_kwargs):
        import vllm

        raise ConfigError("rollout.engine_kwargs: " + "; ".join(
            f"{k!r} is not an argument of vLLM {vllm.__version__}'s engine"
            + (f" (did you mean {hint!r}?)" if hint else "") for k, hint in unknown.items())
            + "; see vLLM's EngineArgs")


def check_lora(cfg: TrainConfig, model_dir: Path) -> None:
    """learner.lora against the model, before anything starts: vLLM must serve LoRA for its
    architecture, and each named target module must be a linear layer of it. Builds the model
    on the meta device (no weights) and imports vLLM's model registry (a few seconds)."""
    spec = cfg.learner.lora
    if spec is None:
        return
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    hub = {"revision": cfg.model.revision, "trust_remote_code": cfg.model.trust_remote_code}
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
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=cfg.model.trust_remote_code)
    linear = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    missing = [t for t in spec.target_modules
               if not any(n == t or n.endswith("." + t) for n in linear)]
    if missing:
        leaves = sorted({n.rsplit(".", 1)[-1] for n in linear})
        raise ConfigError(f"learner.lora.target_modules: {model_dir} has no linear layer named "
                          f"{', '.join(missing)}; its linear layers are {', '.join(leaves)}")


def preflight(cfg: TrainConfig, resume: bool = False) -> tuple[Path, Path | None]:
    """Check everything that can be checked before the run starts, touching nothing.
    Returns (run directory, checkpoint to resume from or None)."""
    check_environment(cfg)
    run_dir = Path(cfg.output_dir) / (cfg.run_name or default_run_name(cfg))
    if not run_dir.is_dir():
        check_output_dir(run_dir)
    resume_from = ckpt.latest_checkpoint(run_dir) if resume else None
    if resume_from is not None:
        _check_resumable(cfg, run_dir, resume_from)
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


def check_cluster_resources(cfg: TrainConfig) -> None:
    """Once connected to Ray, before any actor is created: enough of the cluster's alive nodes
    carry the custom resources of ray.worker_resources / ray.learner_resources for every rollout
    worker / learner rank. Ray would otherwise keep such an actor pending forever, and the run
    would hang without a word. A necessary condition only (workers and ranks asking for the
    same resource are counted apart), read from the nodes up now: an autoscaling cluster must
    have a node with the resource running when the run starts."""
    import ray  # the caller has connected

    if not (cfg.ray.worker_resources or cfg.ray.learner_resources):
        return
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    for field, wanted, count, what in (
            ("ray.worker_resources", cfg.ray.worker_resources, cfg.rollout.num_workers, "rollout worker"),
            ("ray.learner_resources", cfg.ray.learner_resources, cfg.learner.num_ranks, "learner rank")):
        for name, amount in wanted.items():
            # how many such actors fit, node by node (the epsilon absorbs 0.1 + 0.2 arithmetic)
            fits = sum(int(n["Resources"].get(name, 0) / amount + 1e-9) for n in nodes)
            if fits < count:
                have = ", ".join(f"{n['NodeManagerAddress']} {n['Resources'].get(name, 0):g}"
                                 for n in nodes)
                raise ConfigError(
                    f"{field}: {count} {what}(s) each request {name}={amount:g}, but the Ray "
                    f"cluster's nodes hold room for {fits} ({name} per node: {have}); start the "
                    f"nodes with `ray start ... --resources='{{\"{name}\": N}}'`, or change "
                    f"{field} (a local cluster, without ray.address, has no custom resources)")


def _check_resumable(cfg: TrainConfig, run_dir: Path, resume_from: Path) -> None:
    state = ckpt.read_checkpoint(resume_from)
    if changes := ckpt.objective_changes(state.config, cfg.model_dump(mode="json")):
        raise ConfigError(
            f"cannot resume {run_dir} from {resume_from.name}: the config changed "
            f"{'; '.join(changes)}. A resumed run trains the same objective "
            f"({', '.join(ckpt.OBJECTIVE_SECTIONS)}) from the same state: drop those "
            "overrides, or start a new run (another run_name)")
    if is_finished(run_dir) and state.step >= cfg.total_steps:
        raise ConfigError(
            f"cannot resume {run_dir}: it finished at step {state.step} (total_steps: "
            f"{cfg.total_steps}); to train longer, raise it: `klrl train --resume {run_dir} "
            f"total_steps={2 * state.step}`")
