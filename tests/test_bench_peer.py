"""`klrl bench --peer trl` without running it: the refusal without the peers extra, the
GRPOConfig settings built from a TrainConfig, and the figures both sides are reduced to. No
Ray, vLLM, DeepSpeed or TRL (one test checks the kwargs against TRL's GRPOConfig where the
extra is installed, and is skipped otherwise)."""
from __future__ import annotations

import importlib.util
import sys

import pytest

from cluster.bench.peer_record import PeerRun
from cluster.bench.peer_trl import TRL_LOSS, differences, grpo_config_kwargs
from cluster.cli.main import main
from cluster.config.loader import DEMO_CONFIG, PLAIN_GRPO
from cluster.config.train_config import load_train_config
from cluster.train.gains import reward_gain_per_1k

# A setting away from its default wherever TRL has a counterpart, so that a mapping that
# ignored the config (or took the wrong field) shows.
SHARED = ["seed=7", "rollout.prompts_per_step=16", "rollout.samples_per_prompt=4",
          "rollout.max_new_tokens=7", "rollout.temperature=0.9", "rollout.top_k=5",
          "rollout.top_p=0.95", "learner.task_off_policy=none", "learner.lr=3e-5",
          "learner.adam_beta1=0.8", "learner.adam_beta2=0.99", "learner.adam_eps=1e-7",
          "learner.weight_decay=0.01", "learner.warmup_steps=3", "learner.lr_schedule=cosine",
          "learner.grad_clip=0.5", "learner.epochs=2", "learner.mini_batches=4",
          "learner.ppo_clip_eps=0.3", "learner.gradient_checkpointing=true", "kl.beta=0.02",
          "advantage.normalize=batch", "model.trust_remote_code=true"]


def test_without_the_peers_extra_bench_peer_is_refused_in_one_line(capsys, monkeypatch):
    if importlib.util.find_spec("trl") is not None:  # the extra is installed here: hide it
        monkeypatch.setitem(sys.modules, "trl", None)
    assert main(["bench", "--peer", "trl"]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # nothing started, nothing announced
    assert err.count("\n") == 1, err
    assert "trl" in err and "pip install -e '.[peers]'" in err


def test_grpo_config_maps_every_shared_setting(tmp_path):
    cfg = load_train_config(DEMO_CONFIG, SHARED)
    kw = grpo_config_kwargs(cfg, steps=10, output_dir=tmp_path)
    assert kw == kw | {
        "seed": 7, "output_dir": str(tmp_path),
        # 16 prompts x 4 samples per step, in klrl's order, cut into 4 optimizer steps, 2 passes.
        "num_generations": 4, "generation_batch_size": 64, "per_device_train_batch_size": 16,
        "gradient_accumulation_steps": 1, "num_iterations": 2, "max_steps": 10 * 2 * 4,
        "shuffle_dataset": False,
        "max_completion_length": 7, "temperature": 0.9, "top_k": 5, "top_p": 0.95,
        "use_vllm": False,
        "learning_rate": 3e-5, "adam_beta1": 0.8, "adam_beta2": 0.99, "adam_epsilon": 1e-7,
        "weight_decay": 0.01, "optim": "adamw_torch", "warmup_steps": 3,
        "lr_scheduler_type": "cosine",
        # dr_grpo's loss is klrl's over max_new_tokens: the clip scales with it.
        "max_grad_norm": 0.5 / 7, "loss_type": TRL_LOSS,
        "beta": 0.02, "scale_rewards": "batch", "epsilon": 0.3,
        "model_init_kwargs": {"dtype": "float32"}, "bf16": False,
        "gradient_checkpointing": True, "use_cpu": True, "trust_remote_code": True,
        "save_strategy": "no", "report_to": "none",
    }, kw
    assert TRL_LOSS == "dr_grpo"


def test_grpo_config_of_the_demo_and_its_defaults(tmp_path):
    """The demo as the comparison runs it: one optimizer step per batch of 32 x 8, top_k off
    in both (-1 in klrl, 0 in TRL), constant LR after warm-up."""
    kw = grpo_config_kwargs(load_train_config(DEMO_CONFIG, list(PLAIN_GRPO)), 300, tmp_path)
    assert (kw["generation_batch_size"], kw["per_device_train_batch_size"],
            kw["max_steps"]) == (256, 256, 300)
    assert (kw["top_k"], kw["top_p"], kw["lr_scheduler_type"]) == (0, 1.0, "constant_with_warmup")
    assert kw["max_grad_norm"] == 1.0 / 6 and kw["beta"] == 0.05 and kw["learning_rate"] == 1e-4


def test_grpo_config_kwargs_are_trl_fields(tmp_path):
    """Where the extra is installed: TRL's own GRPOConfig takes the kwargs and derives the
    batch shape klrl has (steps_per_generation = mini_batches)."""
    trl = pytest.importorskip("trl")
    cfg = load_train_config(DEMO_CONFIG, [s for s in SHARED if "trust_remote_code" not in s])
    args = trl.GRPOConfig(**grpo_config_kwargs(cfg, 10, tmp_path))
    assert (args.steps_per_generation, args.generation_batch_size,
            args.num_generations) == (4, 64, 4)


def test_differences_name_what_trl_cannot_follow():
    demo = differences(load_train_config(DEMO_CONFIG))
    assert any("KL form: klrl k1 in the reward, TRL k3 in the loss" in d for d in demo), demo
    assert any("advantage: klrl rloo" in d for d in demo), demo
    same = differences(load_train_config(DEMO_CONFIG, list(PLAIN_GRPO)))
    assert [d.split(":")[0] for d in same] == ["advantage std"], same
    hot = differences(load_train_config(DEMO_CONFIG, [*PLAIN_GRPO, "rollout.temperature=0.7"]))
    assert any(d.startswith("temperature") for d in hot)


def test_peer_config_runs_the_chosen_objective_at_max_lag_0(tmp_path):
    from cluster.bench.peers import PEERS_FULL, peer_config

    demo = PEERS_FULL[0]
    same = peer_config(demo, tmp_path, "same", tmp_path / "runs")
    assert (same.kl.estimator, same.kl.placement,
            same.advantage.estimator) == ("k3", "loss", "grpo")
    assert (same.max_lag, same.total_steps, same.model.path) == (0, demo.steps, str(tmp_path))
    own = peer_config(demo, tmp_path, "klrl", tmp_path / "runs")
    assert (own.kl.estimator, own.kl.placement, own.advantage.estimator) == ("k1", "reward", "rloo")
    assert (own.kl.beta, own.learner.lr) == (same.kl.beta, same.learner.lr)


def test_peer_run_figures_leave_out_warm_up_and_the_last_step():
    run = PeerRun("trl", "w", samples_per_step=10, warmup=2,
                  step_seconds=[9.0, 5.0, 1.0, 2.0, 1.0, 7.0],
                  rewards=[0.1, 0.2, 0.3, 0.4, 0.5, 0.6],
                  wall_seconds=30.0)
    assert run.measured_steps == 3 and run.samples_per_s == pytest.approx(30 / 4.0)
    # The docs' definition: last 10% minus first 10% (one step each here) per 1k samples.
    assert run.reward_gain_per_1k == pytest.approx(1000 * (0.6 - 0.1) / 60)
    assert run.reward_gain_per_1k == reward_gain_per_1k(run.rewards, 10)
    d = run.to_dict()
    assert (d["reward_before"], d["reward_after"]) == (0.1, 0.6)
    random = PeerRun("klrl", "w", 10, 2, [1.0] * 4, [0.0] * 4, 4.0, learns=False)
    assert random.reward_gain_per_1k is None
    assert random.to_dict()["reward_gain_per_1k_samples"] is None
    with pytest.raises(ValueError, match="none to measure"):
        PeerRun("klrl", "w", 10, 2, [1.0] * 3, [0.0] * 3, 3.0)


def _side(trainer: str, seconds: float, learns: bool = True) -> dict:
    settings = {"threads": 2 if trainer == "trl" else {"rollout_worker": 2, "learner_rank": 2},
                "differences": ["advantage std: TRL the sample std (n-1) + 1e-4"]}
    versions = {"klrl": "klrl 0.1.0", "trl": "1.16.0", "transformers": "5.19.0", "torch": "2.13.0"}
    return PeerRun(trainer, "w", 256, 2, [seconds] * 6, [0.1, 0.2, 0.3, 0.3, 0.4, 0.5], 9.0,
                   versions, settings, learns).to_dict()


def test_peer_table_prints_both_trainers_side_by_side(capsys):
    import json

    from cluster.bench.peers import check_peers, print_peer_table

    result = {"peers": {"trl": {"objective": "same", "workloads": {
        "demo-1M": {"klrl": _side("klrl", 0.5), "klrl_lag2": _side("klrl", 0.2),
                    "trl": _side("trl", 0.25)},
        "random-25M": {"klrl": _side("klrl", 2.0, False), "klrl_lag2": _side("klrl", 1.0, False),
                       "trl": _side("trl", 2.0, False)}}}},
        "machine": {"cpu_model": "cpu", "cpus": 2, "memory_gib": 24.0, "gpu": None,
                    "load_avg_before": [0.1, 0.1, 0.1], "load_avg_after": [0.2, 0.2, 0.2]}}
    json.dumps(result)  # JSON-ready as it stands
    print_peer_table(result)
    out = capsys.readouterr().out
    assert "klrl against TRL GRPOTrainer" in out and "objective: same" in out
    assert "512.0" in out and "1024.0" in out and "0.50x" in out  # 256 samples / 0.5 s and / 0.25 s
    assert "klrl (max_lag 0)" in out and "klrl (max_lag 2)" in out
    assert "1280.0" in out and "1.25x" in out  # klrl at max_lag 2: 256 samples / 0.2 s
    assert "n/a (random weights)" in out and "differs: advantage std" in out
    assert check_peers(result) == []
    result["peers"]["trl"]["workloads"]["demo-1M"]["trl"]["samples_per_s"] = float("nan")
    assert check_peers(result) == ["demo-1M/trl"]
    del result["peers"]["trl"]["workloads"]["random-25M"]["klrl_lag2"]
    assert check_peers(result) == ["demo-1M/trl", "random-25M/klrl_lag2"]


def test_a_running_trl_process_shows_its_progress(tmp_path, monkeypatch, capsys):
    """The parent prints the child's newest progress line while it runs (a 300-step TRL run
    is otherwise a minute or more of silence), and returns its exit code; a real child
    process writes the lines, as the TRL process does."""
    import subprocess

    from cluster.bench import peer_trl

    monkeypatch.setattr(peer_trl, "PROGRESS_EVERY_S", 0.3)
    log_path = tmp_path / "child.log"
    script = ("import time\nfor k in range(1, 4):\n"
              f"    print('{peer_trl.PROGRESS}step %d/3' % k, flush=True)\n    time.sleep(0.5)\n")
    with open(log_path, "w") as log:
        child = subprocess.Popen([sys.executable, "-c", script], stdout=log,
                                 stderr=subprocess.STDOUT)
        assert peer_trl._wait_reporting(child, log_path, "w", deadline_s=60) == 0
    shown = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[bench] w: TRL")]
    assert shown and all("step" in ln or "starting" in ln for ln in shown), shown
    assert any("step 2/3" in ln or "step 3/3" in ln for ln in shown), shown


def test_a_trl_process_past_its_deadline_is_killed(tmp_path, monkeypatch):
    import subprocess

    from cluster.bench import peer_trl

    monkeypatch.setattr(peer_trl, "PROGRESS_EVERY_S", 0.2)
    log_path = tmp_path / "child.log"
    with open(log_path, "w") as log:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                 stdout=log, stderr=subprocess.STDOUT)
        with pytest.raises(TimeoutError, match="took over 0.5 s"):
            peer_trl._wait_reporting(child, log_path, "w", deadline_s=0.5)
    assert child.poll() is not None  # killed, not left behind
