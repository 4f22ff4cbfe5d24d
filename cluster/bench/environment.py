"""`klrl bench --only environment`: what a slow environment costs the rollout (multi-turn,
docs/multi-turn.md). The headline workload's rollout worker generates the same episodes with
an environment that answers at once and with one that takes DELAY_S a turn, on threads of the
worker (the default) and in a pool of environment actors (task.environment.pool):

- rollout samples/s of each, and the ratio slow / instant for each placement (the issue's
  target: 0.8 or more);
- the environment's share of the generate call: a sample's seconds in its environment (its
  reset and steps, `Rollout.env_seconds`; the episodes' calls run side by side) over the
  call's wall time, mean over samples; beside it the share of the call outside the engine
  (the environment rounds, and the scoring and records every call has: the instant
  environment's is that floor).

Both environments answer the same text at the same turns, so with the same seeds the three
settings generate the same tokens: only where the environment runs and how long it takes
differ.
"""
from __future__ import annotations

import statistics
import time
from typing import Any

from cluster.config.train_config import TrainConfig
from rewards.environment import Environment, EnvStep

DELAY_S = 0.05       # the slow environment's seconds per step
TURNS = 3            # policy turns per episode: two replies, then the episode ends
TOKENS_PER_TURN = 8  # each turn's sampling budget
REPLY = " ok\n"


class Answering(Environment):
    """Replies REPLY after each of the first TURNS - 1 turns and ends the episode after the
    last (reward 0: the bench measures time), each step after `delay_s` seconds."""

    def __init__(self, delay_s: float = 0.0):
        self.delay_s = delay_s

    def reset(self, problem):
        self.turns = 0

    def step(self, turn):
        if self.delay_s:
            time.sleep(self.delay_s)
        self.turns += 1
        if self.turns < TURNS:
            return EnvStep(reply=REPLY)
        return EnvStep(done=True, reward=0.0)


# name -> (seconds per step, environment actors per worker; 0: threads of the worker)
SETTINGS = {"instant": (0.0, 0), "slow_threads": (DELAY_S, 0), "slow_pool": (DELAY_S, 1)}


def environment_config(cfg: TrainConfig, delay_s: float, actors: int) -> TrainConfig:
    """`cfg` with the bench's environment (validated as a run's config would be)."""
    env = {"name": f"{__name__}:Answering", "options": {"delay_s": delay_s},
           "max_turns": TURNS, "max_tokens_per_turn": TOKENS_PER_TURN,
           "pool": {"actors_per_worker": actors, "cpus_per_actor": 0}}
    rollout = {"max_new_tokens": max(cfg.rollout.max_new_tokens,
                                     TURNS * (TOKENS_PER_TURN + len(REPLY)))}
    data = cfg.model_dump(mode="json")
    data["task"]["environment"] = env
    data["rollout"] |= rollout
    return TrainConfig.model_validate(data)


def measure_environment(cfg: TrainConfig, problems: list, reps: int,
                        warmup: int) -> dict[str, Any]:
    """The environment section of the bench JSON: each setting's samples/s and outside-engine
    share (medians over `reps` generate calls after `warmup`), and the slow / instant ratios."""
    import ray

    from cluster.bench.outside import stop_worker
    from cluster.train.worker_pool import start_worker

    group_ids = list(range(len(problems)))
    settings: dict[str, dict[str, float]] = {}
    for name, (delay_s, actors) in SETTINGS.items():
        run_cfg = environment_config(cfg, delay_s, actors)
        print(f"[bench] environment: {name} ({delay_s * 1000:g} ms a step, "
              f"{f'{actors} environment actor' if actors else 'threads of the worker'})",
              flush=True)
        worker = start_worker(run_cfg, run_cfg.model.path, 0)
        try:
            rates, shares, env_shares, turns = [], [], [], []
            for r in range(warmup + reps):
                t0 = time.perf_counter()
                batch = ray.get(worker.generate.remote(problems, group_ids, r))
                wall = time.perf_counter() - t0
                if r >= warmup:
                    rates.append(len(batch.rollouts) / wall)
                    shares.append(max(0.0, 1.0 - batch.gen_seconds / wall))
                    env_shares.append(sum(x.env_seconds for x in batch.rollouts)
                                      / len(batch.rollouts) / wall)
                    turns.append(sum(x.turns for x in batch.rollouts) / len(batch.rollouts))
                failed = [x.env_failure for x in batch.rollouts if x.env_failure]
                if failed:
                    raise RuntimeError(f"the bench's environment failed: {failed[0]}")
        finally:
            stop_worker(worker)
        settings[name] = {"samples_per_s": statistics.median(rates),
                          "environment_share": statistics.median(env_shares),
                          "outside_engine_share": statistics.median(shares),
                          "turns_mean": statistics.median(turns)}
    instant = settings["instant"]["samples_per_s"]
    return {"delay_ms": DELAY_S * 1000, "reps": reps, "samples": len(problems) *
            cfg.rollout.samples_per_prompt, "settings": settings,
            "ratio_threads": settings["slow_threads"]["samples_per_s"] / instant,
            "ratio_pool": settings["slow_pool"]["samples_per_s"] / instant}
