"""Ray start-up and actor placement for a training run."""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import ray

from cluster.config.loader import ConfigError
from cluster.config.train_config import TrainConfig
from cluster.tiny.model import init_default_model
from cluster.train.door.preflight import check_ray_address


def start_ray(cfg: TrainConfig) -> Path | None:
    """Join RAY_ADDRESS / cfg.ray.address, or start a local loopback cluster sized for the run.
    Returns the session directory of the cluster this process started (and so must stop,
    `stop_ray`), None when it joined one."""
    if ray.is_initialized():
        return None
    address = os.environ.get("RAY_ADDRESS") or cfg.ray.address
    if address:
        check_ray_address(address)
        try:
            ray.init(address=address, log_to_driver=True)
        except (ConnectionError, RuntimeError) as exc:  # one line, not Ray's traceback
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ConfigError(
                f"ray.address={address}: cannot join the Ray cluster ({reason}). Check that "
                "`ray start --head` runs there (`ray status --address ...`); a cluster started "
                "with token authentication also needs RAY_AUTH_MODE=token here") from None
        return None
    num_cpus = cfg.ray.num_cpus or max(int(cfg.reserved_cpus + 0.999), os.cpu_count() or 1)
    # address="local": a new cluster even if another one runs on this machine (ray.init's
    # default would join it, against `ray.address: null` meaning "start a local cluster").
    context = ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                       _node_ip_address="127.0.0.1", log_to_driver=True)
    return Path(context.address_info["session_dir"])


def stop_ray(session_dir: Path, keep_logs: bool = False) -> None:
    """Stop the local cluster `start_ray` started, and remove its session directory (Ray's
    logs, sockets and spilled objects under Ray's temp directory, /tmp/ray by default: one
    per run, which an 88-run sweep would leave 88 of) unless `keep_logs` (a run that failed:
    Ray's own logs may say why). Only that directory: other clusters on the machine keep
    theirs; Ray's `session_latest` link goes with it when it points there."""
    import shutil

    ray.shutdown()
    if keep_logs or not session_dir.name.startswith("session_"):
        return
    shutil.rmtree(session_dir, ignore_errors=True)
    latest = session_dir.parent / "session_latest"
    if latest.is_symlink() and Path(os.readlink(latest)).name == session_dir.name:
        latest.unlink(missing_ok=True)


def resolve_model(cfg: TrainConfig) -> Path:
    """The policy's model directory: the configured one (absolute once the driver has resolved
    the config's paths, or a hub name), or the embedded tiny model's, made absolute (KLRL_HOME
    may be relative) so that every actor finds it."""
    if cfg.model.path:
        return Path(cfg.model.path)
    return Path(init_default_model(recipe=cfg.model.embedded)).absolute()


def start_learner(cfg: TrainConfig, model_dir: Path, run_id: str, steps: int | None = None,
                  wait=None):
    """The learner group, given what learner/ may not read itself (it imports only kl/): the
    weight transport of actors/, where its models come from (`model.ref_path`, `revision`,
    `trust_remote_code`), and the run's optimizer steps, where a decaying LR schedule ends
    (`steps`: the run's planned steps, fewer than total_steps when data.epochs end it first;
    default total_steps). `wait`: how its calls are waited for (the controller's
    cluster.train.deadlines.LearnerDeadlines); the process group's timeout is
    faults.learner_timeout_s, the ceiling of every learner call, so a collective stuck that
    long raises in the ranks that still run."""
    from actors.weight_sync import WeightPublisher
    from learner.group import LearnerGroup

    optimizer_steps = (steps or cfg.total_steps) * cfg.learner.updates_per_batch
    return LearnerGroup(learner_model_files(cfg, model_dir), cfg.rank_learner, cfg.kl,
                        cfg.advantage, seed=cfg.seed, publisher=WeightPublisher(run_id, cfg.sync),
                        total_optimizer_steps=optimizer_steps,
                        resources=cfg.ray.learner_resources, wait=wait,
                        collective_timeout_s=cfg.faults.learner_timeout_s)


def start_engines_and_learner(cfg: TrainConfig, start_engines: Callable[[], None],
                              engines_ready: Callable[[], None],
                              start_learner: Callable[[], None]) -> None:
    """Start the rollout workers' engines and the learner: side by side (each start is mostly
    imports and model loading, in processes of their own), but where a learner rank may share
    a GPU with an engine (`TrainConfig.learner_may_share_a_gpu`), the learner only once every
    engine has reported ready. vLLM sizes its KV cache from the memory the whole GPU frees
    and takes while it profiles (vLLM 0.26: vllm/utils/mem_utils.py, and the "Error in memory
    profiling" assert of its GPU worker): a learner loading its model in that window shrinks
    the cache or, freeing memory in it, fails the engine's start ("no memory for cache blocks"
    at the sizes people train). The callables start, wait for and start the parts; the
    caller keeps what each made, so that a failure of the next still stops it."""
    start_engines()
    if cfg.learner_may_share_a_gpu:
        engines_ready()
        start_learner()
    else:
        start_learner()
        engines_ready()


def learner_model_files(cfg: TrainConfig, model_dir: Path):
    """Where the learner loads policy, reference and tokenizer from (`model_dir`: the resolved
    policy, resolve_model's), with the model section's hub revision and remote-code setting."""
    from learner.loading import ModelFiles

    return ModelFiles(policy=str(model_dir), reference=cfg.model.ref_path,
                      revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code)
