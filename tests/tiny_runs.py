"""The train config of the short end-to-end runs on the tiny random model (test_resume.py,
its SLURM job included, and test_lora.py): a few steps of 4 prompts x 4 samples at max_lag 0,
rewarded for short answers (tests/scorers.py) so that the random model has a signal, no
evaluation but the required one."""
from cluster.config.loader import DEMO_CONFIG
from cluster.config.train_config import load_train_config


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
