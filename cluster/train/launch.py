"""Ray start-up and actor placement for a training run."""
from __future__ import annotations

import os
from pathlib import Path

import ray

from cluster.config.loader import ConfigError
from cluster.config.train_config import TrainConfig
from cluster.tiny.model import init_default_model
from cluster.train.preflight import check_ray_address


def start_ray(cfg: TrainConfig) -> bool:
    """Join RAY_ADDRESS / cfg.ray.address, or start a local loopback cluster sized for the run.
    Returns True when this process started (and so must stop) the cluster."""
    if ray.is_initialized():
        return False
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
        return False
    num_cpus = cfg.ray.num_cpus or max(int(cfg.reserved_cpus + 0.999), os.cpu_count() or 1)
    # address="local": a new cluster even if another one runs on this machine (ray.init's
    # default would join it, against `ray.address: null` meaning "start a local cluster").
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=True)
    return True


def resolve_model(cfg: TrainConfig) -> Path:
    """The policy's model directory: the configured one (absolute once the driver has resolved
    the config's paths, or a hub name), or the embedded tiny model's, made absolute (KLRL_HOME
    may be relative) so that every actor finds it."""
    if cfg.model.path:
        return Path(cfg.model.path)
    return Path(init_default_model()).absolute()


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

    return LearnerGroup(learner_model_files(cfg, model_dir), cfg.rank_learner, cfg.kl, cfg.advantage,
                        seed=cfg.seed, run_id=run_id, publisher=WeightPublisher(),
                        total_optimizer_steps=(steps or cfg.total_steps) * cfg.learner.updates_per_batch,
                        resources=cfg.ray.learner_resources, wait=wait,
                        collective_timeout_s=cfg.faults.learner_timeout_s)


def learner_model_files(cfg: TrainConfig, model_dir: Path):
    """Where the learner loads policy, reference and tokenizer from (`model_dir`: the resolved
    policy, resolve_model's), with the model section's hub revision and remote-code setting."""
    from learner.loading import ModelFiles

    return ModelFiles(policy=str(model_dir), reference=cfg.model.ref_path,
                      revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code)


def connect_nccl(learner, workers: list) -> None:
    """GPU with sync.transport=nccl, once before the first export: join learner rank 0 and
    every rollout worker (`RolloutWorker.init_nccl`) in vLLM's NCCL weight-transfer group.
    First it compares their CUDA device UUIDs and refuses a GPU shared by two of them, which
    NCCL would refuse ("Duplicate GPU detected"); TrainConfig already refuses GPU requests
    that let Ray share one. Here rather than in learner/ because it drives the rollout
    workers. Written against vLLM's API; not exercised by the CPU test-suite."""
    from actors.nccl_transfer import check_nccl_devices
    from learner.group import get_all

    check_nccl_devices(learner.cuda_device_uuid(),
                       get_all([w.cuda_device_uuids.remote() for w in workers]))
    infos = learner.nccl_sender_init(len(workers))
    joins = [w.init_nccl.remote(info) for w, info in zip(workers, infos)]
    get_all(joins + [learner.nccl_sender_connect()])


def connect_cuda_ipc(learner, workers: list) -> None:
    """GPU with sync.transport=cuda_ipc, before the first export (and for a replaced worker
    before its re-sync): refuse a worker whose engine is not on learner rank 0's GPU, where
    the IPC handles could not be opened (`check_cuda_ipc_devices`; TrainConfig already
    refuses GPU requests that cannot put them on one GPU), then ready each worker's IPC
    weight transfer (`RolloutWorker.init_cuda_ipc`). Here rather than in learner/ because it
    drives the rollout workers. Written against vLLM's API; not exercised by the CPU
    test-suite."""
    from actors.ipc_transfer import check_cuda_ipc_devices
    from learner.group import get_all

    check_cuda_ipc_devices(learner.cuda_device_uuid(),
                           get_all([w.cuda_device_uuids.remote() for w in workers]))
    get_all([w.init_cuda_ipc.remote() for w in workers])
