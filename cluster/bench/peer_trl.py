"""TRL's GRPOTrainer on klrl's workload, for `klrl bench --peer trl` (cluster/bench/peers.py).

TRL is not a dependency of klrl: the optional `peers` extra installs it (`pip install -e
'.[peers]'`), and `missing_extra` says when it is absent. TRL runs in a subprocess (`python -m
cluster.bench.peer_trl SPEC OUT`), so its imports and threads never touch the caller, with the
torch/OpenMP threads of klrl's parts at max_lag 0 (`cfg.worker_rollout.threads`: generation and
training alternate there, as in TRL, and each phase gets every core the run reserves).

What TRL gets from the TrainConfig (`grpo_config_kwargs`, tested setting by setting):
- the model directory; the training prompts in klrl's order (`PromptStream.for_run`: the same
  problems at every step), as text or, where klrl applies the chat template, as the same chat
  messages (actors/prompting.py), which TRL tokenizes as klrl does;
- per step one generation of prompts_per_step x samples_per_prompt completions
  (`generation_batch_size`, `num_generations`), cut into `learner.mini_batches` optimizer steps
  (`steps_per_generation`), `learner.epochs` passes (`num_iterations`); the same max new
  tokens, temperature, top_k/top_p, learning rate, AdamW settings, warm-up and schedule (the
  child swaps TRL's scheduler for klrl's own `learner.schedule`: transformers' warm-up starts
  from 0, klrl's from lr/(W+1)), beta, seed and dtype;
- the task's scorer (or the config's plug-in `task.reward`) as the one reward function.

The loss: TRL's `dr_grpo` divides the token sum by batch x max_completion_length, klrl by the
number of sequences: the same gradient divided by max_new_tokens, a constant. AdamW does not
see a constant factor (bar its eps), and clipping at grad_clip / max_new_tokens clips where
klrl clips, so both take the same step. TRL's KL is always K3 in the loss and its baseline the
group mean: `differences` lists what else in a config TRL cannot follow.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from cluster.bench.peer_record import PeerRun
from cluster.config.train_config import TrainConfig
from kl.advantage import ADVANTAGE_ESTIMATORS, GROUP_MEAN
from kl.surrogate import IMPORTANCE_CORRECTIONS

PEER_PACKAGES = ("trl", "accelerate")
TRL_SERIES = "1.16"  # the release the mapping below was read from (the extra pins it)
TRL_LOSS = "dr_grpo"
PROGRESS, PROGRESS_EVERY_S = "klrl-progress: ", 15.0  # the child's progress lines, how often shown
# Variables that would make accelerate in the child believe it is one rank of a group.
_DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def missing_extra() -> str | None:
    """The first package of the `peers` extra that cannot be imported, or None. `import trl`
    is cheap (its modules load lazily); accelerate would load torch, so it is only looked up."""
    try:
        import trl  # noqa: F401
    except ImportError:
        return "trl"
    import importlib.util

    return next((p for p in PEER_PACKAGES[1:] if importlib.util.find_spec(p) is None), None)


def grpo_config_kwargs(cfg: TrainConfig, steps: int, output_dir: str | Path) -> dict[str, Any]:
    """GRPOConfig keyword arguments for `steps` klrl steps of `cfg` (module docstring)."""
    r, lc = cfg.rollout, cfg.learner
    batch = r.prompts_per_step * r.samples_per_prompt
    model_init = {"dtype": "float32"}  # bf16 runs as klrl's: fp32 weights, bf16 compute
    if lc.attn_implementation:
        model_init["attn_implementation"] = lc.attn_implementation
    return {
        "output_dir": str(output_dir), "seed": cfg.seed,
        # One generation per klrl step, in klrl's prompt order.
        "num_generations": r.samples_per_prompt, "generation_batch_size": batch,
        "per_device_train_batch_size": batch // lc.mini_batches, "gradient_accumulation_steps": 1,
        "num_iterations": lc.epochs, "max_steps": steps * lc.updates_per_batch,
        "shuffle_dataset": False,
        # Sampling.
        "max_completion_length": r.max_new_tokens, "temperature": r.temperature,
        "top_k": r.vllm_top_k, "top_p": r.top_p, "use_vllm": False,
        # Optimizer and schedule.
        "learning_rate": lc.lr, "adam_beta1": lc.adam_beta1, "adam_beta2": lc.adam_beta2,
        "adam_epsilon": lc.adam_eps, "weight_decay": lc.weight_decay, "optim": "adamw_torch",
        "warmup_steps": lc.warmup_steps,
        "lr_scheduler_type": {"constant": "constant_with_warmup", "linear": "linear",
                              "cosine": "cosine"}[lc.lr_schedule],
        "max_grad_norm": lc.grad_clip / r.max_new_tokens,
        # Objective.
        "beta": cfg.kl.beta, "loss_type": TRL_LOSS, "scale_rewards": cfg.advantage.normalize,
        "epsilon": lc.ppo_clip_eps,
        # Model and device.
        "model_init_kwargs": model_init, "bf16": lc.dtype == "bfloat16",
        "gradient_checkpointing": lc.gradient_checkpointing,
        "use_cpu": lc.device_kind == "cpu", "trust_remote_code": cfg.model.trust_remote_code,
        # Quiet: no checkpoints, no trackers, one log line at the end.
        "save_strategy": "no", "report_to": "none", "disable_tqdm": True,
        "logging_steps": steps * lc.updates_per_batch, "log_completions": False,
    }


def differences(cfg: TrainConfig) -> list[str]:
    """What TRL does differently on `cfg`, beyond the sampler (transformers' generate against
    vLLM) and the scoring (in-process against klrl's scoring pool)."""
    kl, adv, lc, r = cfg.kl, cfg.advantage, cfg.learner, cfg.rollout
    out = []
    if kl.beta > 0 and (kl.estimator, kl.placement) != ("k3", "loss"):
        out.append(f"KL form: klrl {kl.estimator} in the {kl.placement}, TRL k3 in the loss")
    if kl.beta > 0 and IMPORTANCE_CORRECTIONS[kl.importance].reweights:
        out.append(f"KL importance: klrl {kl.importance}, TRL none")
    if ADVANTAGE_ESTIMATORS[adv.estimator].baseline is not GROUP_MEAN:
        out.append(f"advantage: klrl {adv.estimator}, TRL the group mean (grpo)")
    if adv.normalize != "none":
        out.append(f"advantage std: TRL the sample std (n-1) + 1e-4, klrl the population std "
                   f"+ {adv.eps:g}")
    if lc.updates_per_batch > 1 and lc.task_off_policy != "ppo_clip":
        out.append(f"off-policy updates: klrl {lc.task_off_policy}, TRL the PPO clip")
    if lc.entropy_coef > 0:
        out.append("entropy bonus: klrl only")
    if r.temperature != 1.0:
        out.append("temperature: TRL trains the tempered policy, klrl the temperature-1 policy")
    if cfg.task.stop:
        out.append("stop strings: klrl only (TRL stops at EOS or the length)")
    if cfg.model.ref_path:
        out.append("reference: klrl model.ref_path, TRL the starting policy")
    if lc.num_ranks > 1 or r.num_workers > 1:
        out.append("parallelism: klrl several workers/ranks, TRL one process")
    return out


def run_trl(cfg: TrainConfig, workload: str, steps: int, warmup: int, work_dir: Path,
            learns: bool = True) -> PeerRun:
    """`steps` klrl steps' worth of TRL GRPO on `cfg` (its model.path set), in a subprocess;
    its output goes to WORK_DIR/trl-<workload>.log."""
    if cfg.model.path is None:
        raise ValueError("run_trl needs model.path: the directory both trainers load")
    work_dir.mkdir(parents=True, exist_ok=True)
    kwargs = grpo_config_kwargs(cfg, steps, work_dir / f"trl-{workload}")
    threads = cfg.worker_rollout.threads
    spec = {"config": cfg.model_dump(mode="json"), "steps": steps, "threads": threads,
            "grpo": kwargs}
    spec_path, out_path = work_dir / f"trl-{workload}.spec.json", work_dir / f"trl-{workload}.json"
    log_path = work_dir / f"trl-{workload}.log"
    spec_path.write_text(json.dumps(spec))
    # OpenMP reads its thread count once, when torch loads: set before the process starts.
    env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS} | {
        "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        child = subprocess.Popen([sys.executable, "-m", "cluster.bench.peer_trl", str(spec_path),
                                  str(out_path)], stdout=log, stderr=subprocess.STDOUT, env=env)
        code = _wait_reporting(child, log_path, workload, deadline_s=4 * 3600)
    wall = time.perf_counter() - t0
    if code != 0:
        tail = log_path.read_text()[-4000:]
        raise RuntimeError(f"TRL run {workload} failed ({code}; log {log_path}):\n{tail}")
    out = json.loads(out_path.read_text())
    if not out["versions"]["trl"].startswith(f"{TRL_SERIES}."):
        print(f"warning: TRL {out['versions']['trl']} runs a mapping read from TRL {TRL_SERIES} "
              "(the peers extra pins it)", file=sys.stderr)
    settings = {"threads": threads, "startup_seconds": out["startup_seconds"],
                "generation": "transformers generate (use_vllm=False)",
                "objective": f"k3 in the loss, group-mean advantage, loss_type {TRL_LOSS}",
                "grpo_config": {k: v for k, v in kwargs.items() if k != "output_dir"},
                "differences": differences(cfg)}
    return PeerRun("trl", workload, cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt,
                   warmup, out["step_seconds"], out["rewards"], wall, out["versions"], settings,
                   learns)


def _wait_reporting(child: subprocess.Popen, log_path: Path, workload: str,
                    deadline_s: float) -> int:
    """Wait for the TRL process, printing its newest progress line (PROGRESS) every
    PROGRESS_EVERY_S seconds, so a long comparison is never silent; killed past deadline_s."""
    start = time.monotonic()
    while True:
        try:
            return child.wait(timeout=PROGRESS_EVERY_S)
        except subprocess.TimeoutExpired:
            if time.monotonic() - start > deadline_s:
                child.kill()
                child.wait()
                raise TimeoutError(f"TRL run {workload} took over {deadline_s:g} s "
                                   f"(log {log_path})")
            lines = [ln for ln in log_path.read_text(errors="replace").splitlines()
                     if ln.startswith(PROGRESS)]
            print(f"[bench] {workload}: TRL {lines[-1][len(PROGRESS):] if lines else 'starting'} "
                  f"({time.monotonic() - start:.0f} s)", flush=True)


# ----------------------------------------------------------------------------- the subprocess


def _child(spec: dict) -> dict:
    """Run TRL as `spec` says; returns per-step times and rewards."""
    t0 = time.perf_counter()
    import torch

    torch.set_num_threads(spec["threads"])  # OMP_NUM_THREADS too, from run_trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import rewards
    from actors.prompting import PromptRenderer
    from cluster.train.batching import policy_tokenizer
    from cluster.train.prompts import PromptStream
    from learner.schedule import make_scheduler

    cfg = TrainConfig.model_validate(spec["config"])
    steps, updates = spec["steps"], cfg.learner.updates_per_batch
    if Path(cfg.model.path).is_dir():
        os.environ["HF_HUB_OFFLINE"] = "1"
    stream = PromptStream.for_run(cfg, cfg.model.path)
    problems = [p for _ in range(steps) for p in stream.next_batch(cfg.rollout.prompts_per_step)[0]]
    renderer = PromptRenderer.for_task(policy_tokenizer(cfg.model.path, cfg.model), cfg.task)
    rows = [{"prompt": renderer.messages(p.prompt) if renderer.use_chat_template else p.prompt,
             "problem_index": i} for i, p in enumerate(problems)]
    task = rewards.get_task(cfg.task.name, **cfg.task.options)
    scorer = rewards.load_scorer(cfg.task.reward) if cfg.task.reward else task.scorer
    batch_rewards: list[float] = []

    def task_reward(completions, problem_index, **_):
        out = [_score(scorer, c if isinstance(c, str) else c[-1]["content"], problems[i])
               for c, i in zip(completions, problem_index)]
        batch_rewards.append(statistics.fmean(out))
        return out

    ticks: list[float] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            ticks.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            ticks.append(time.perf_counter())
            print(f"{PROGRESS}step {state.global_step // updates}/{steps}", flush=True)

    schedule = make_scheduler(cfg.learner, steps * updates)

    class Trainer(GRPOTrainer):
        def create_scheduler(self, num_training_steps, optimizer=None):
            if self.lr_scheduler is None:  # klrl's schedule (module docstring)
                self.lr_scheduler = schedule(optimizer or self.optimizer)
            return self.lr_scheduler

    trainer = Trainer(model=cfg.model.path, reward_funcs=[task_reward],
                      args=GRPOConfig(**spec["grpo"]), train_dataset=Dataset.from_list(rows),
                      callbacks=[Clock()])
    trainer.train()
    ends = ticks[:1] + ticks[updates::updates]  # the start, then the end of each klrl step
    return {"step_seconds": [b - a for a, b in itertools.pairwise(ends)], "rewards": batch_rewards,
            "startup_seconds": ticks[0] - t0, "versions": _versions()}


def _score(scorer, text: str, problem) -> float:
    """The reward, 0.0 for a failure (klrl's scoring pool does the same, and counts them)."""
    try:
        value = float(scorer(text, problem))
    except Exception:  # noqa: BLE001 - any scorer failure is reward 0, as in klrl
        return 0.0
    return value if math.isfinite(value) else 0.0


def _versions() -> dict[str, str]:
    names = ("trl", "transformers", "accelerate", "torch", "datasets")
    return {n: metadata.version(n) for n in names} | {"python": sys.version.split()[0]}


if __name__ == "__main__":
    spec_file, out_file = sys.argv[1:3]
    Path(out_file).write_text(json.dumps(_child(json.loads(Path(spec_file).read_text()))))
