"""The train config of the short end-to-end runs on the tiny random model (test_resume.py,
test_lora.py, and the SLURM job of test_resume.py): a few steps of 4 prompts x 4 samples at
max_lag 0, rewarded for short answers (tests/scorers.py) so that the random model has a signal,
no evaluation but the required one. And the thread that kills such a run's learner rank in a
step (the learner restart of test_resume.py and test_lora.py)."""
import os
import signal
import threading
import time

import psutil

from cluster.config.loader import DEMO_CONFIG
from cluster.config.train_config import load_train_config
from cluster.train.run_log import last_step


def tiny_run_overrides(tiny_model_dir, out, name, steps, *extra, lr=1e-3) -> list[str]:
    """The overrides of configs/tiny_cpu.yaml that make such a run (also a command line's)."""
    return ["task.reward=scorers:short_answers", f"model.path={tiny_model_dir}",
            f"output_dir={out}", f"run_name={name}", f"total_steps={steps}", "max_lag=0",
            "eval_every=0", "eval.num_problems=8", "eval.samples=0", "eval.out_of_domain=null",
            "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", f"learner.lr={lr}",
            "logging.wandb_mode=offline", *extra]


def tiny_run_config(tiny_model_dir, out, name, steps, *extra, lr=1e-3):
    return load_train_config(DEMO_CONFIG,
                             tiny_run_overrides(tiny_model_dir, out, name, steps, *extra, lr=lr))


class LearnerKiller(threading.Thread):
    """SIGKILLs this process's learner rank (its Ray cluster is this process's own: every rank is
    a descendant) once `run_dir` has logged `after_step` and the rank runs a train step (Ray
    titles the process `ray::LearnerRank.train_step` then): the next step's train step dies.
    A context manager: watching within the block; `killed` holds the pid it killed."""

    def __init__(self, run_dir, after_step: int):
        super().__init__(daemon=True)
        self.run_dir, self.after_step = run_dir, after_step
        self.killed: list[int] = []
        self.done = threading.Event()

    def __enter__(self) -> "LearnerKiller":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.join()

    def run(self):
        while not self.done.is_set() and not self.killed:
            if last_step(self.run_dir) >= self.after_step:  # the log's tail only, every 10 ms
                for p in psutil.Process(os.getpid()).children(recursive=True):
                    try:
                        if p.cmdline()[:1] == ["ray::LearnerRank.train_step"]:
                            p.send_signal(signal.SIGKILL)
                            self.killed.append(p.pid)
                            break
                    except psutil.Error:
                        continue
            time.sleep(0.01)
