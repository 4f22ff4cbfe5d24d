"""The door of the commands that are not a training run here: `klrl eval` (a model and a task's
splits, before vLLM), `klrl report` (a directory of runs, and where the report goes, before
anything is plotted or written), `klrl submit` (what can be checked on this machine before the
job is uploaded; the job runs `klrl train`'s own door where it runs) and `klrl slurm` (where
its sbatch script is written). Same style: ConfigError, one or two lines.
"""
from __future__ import annotations

from pathlib import Path

from cluster.config.loader import ConfigError
from cluster.config.train_config import TrainConfig
from cluster.train.door.models import check_model_dir
from cluster.train.door.paths import cannot_write_in
from cluster.train.door.tasks import check_plugins_of
from cluster.train.door.wandb import wandb_mode_env_problem
from cluster.train.run_log import (
    config_path,
    final_dir,
    has_metrics,
    is_finished,
    metrics_path,
    read_metrics,
)


def check_eval_model(model: str) -> Path:
    """`klrl eval MODEL_DIR`: a Hugging Face model directory with weights and a tokenizer
    (`door.models.check_model_dir`); a run directory is named as one, with its final model."""
    path = Path(model).expanduser()
    if not path.exists():
        raise ConfigError(f"MODEL_DIR {model}: no such directory; give a Hugging Face model "
                          "directory (e.g. runs/NAME/final), or 'default' for the tiny model")
    if path.is_dir() and (config_path(path).is_file() or has_metrics(path)):
        where = (f"evaluate its trained policy: klrl eval {final_dir(path)}" if is_finished(path)
                 else "it has no final model yet; evaluate an export of it (RUN_DIR/hf/step_N) "
                 "or let it finish")
        raise ConfigError(f"MODEL_DIR {model} is a run directory, not a model; {where}")
    check_model_dir(path, "MODEL_DIR")
    return path


def check_report_dir(path: Path, out: str | None) -> None:
    """`klrl report DIR [--out OUT]`: DIR a run directory or one holding runs, at least one of
    whose metrics logs has a row to report; OUT, when it exists, a directory (report.md and
    its plots go into it)."""
    if out is not None and Path(out).exists() and not Path(out).is_dir():
        raise ConfigError(f"--out {out} is a file; give a directory (report.md and its plots "
                          "are written into it)")
    if not path.is_dir():
        raise ConfigError(f"{path}: no such directory; give a run directory or a directory of "
                          "runs (a sweep's)")
    runs = [path] if has_metrics(path) else [p for p in sorted(path.iterdir()) if has_metrics(p)]
    if not runs:
        raise ConfigError(f"{path}: no run directory (with metrics.jsonl) here or directly inside")
    if not any(read_metrics(run) for run in runs):
        shown = ", ".join(str(metrics_path(run)) for run in runs[:3]) + (
            f" and {len(runs) - 3} more" if len(runs) > 3 else "")
        raise ConfigError(f"{path}: nothing to report: no metrics log here holds a row (a JSON "
                          f"object with an integer step, as a run writes one per step): {shown}")


def check_report_out(where: Path, out: str | None) -> None:
    """`klrl report`: the directory the report goes into (`where`: --out, else what
    `write_report` chooses) can be written: it is a directory one can write in, or can be made
    (no file in the way, its nearest existing ancestor writable), so the report is not lost to
    a traceback after the reading."""
    if exc := cannot_write_in(where):
        name = f"--out {out}" if out is not None else f"{where} (the report directory)"
        raise ConfigError(f"{name}: cannot write the report there ({exc.strerror or exc}); "
                          "give --out DIR where a directory can be written")


def check_slurm_dir(slurm_dir: Path) -> None:
    """`klrl slurm`: the directory its sbatch script is written into (OUTPUT_DIR/slurm) can be
    written on this machine (the login node), before sbatch is run."""
    if exc := cannot_write_in(slurm_dir):
        raise ConfigError(f"output_dir={slurm_dir.parent}: cannot write the sbatch script into "
                          f"{slurm_dir} ({exc.strerror or exc}); choose a writable output_dir "
                          "on storage the nodes share")


def check_submission(cfg: TrainConfig, job_env: dict[str, str]) -> None:
    """`klrl submit`: what this machine can check of a run that runs on a cluster. Its
    plug-ins (imported here, as they travel with the job: task.reward callable as a scorer,
    plug-in tasks with their options and splits), and the job's WANDB_MODE (`--env`). Paths,
    resources and the wandb key are the cluster's: the job's own door checks them there."""
    check_plugins_of(cfg)
    if why := wandb_mode_env_problem(cfg, job_env, "--env"):
        raise ConfigError(why)
