"""The central controller: schedules generation under max_lag, trains, syncs weights.

Async invariant (enforced in `_take_batch`, asserted before training): a rollout sampled
with weights of version v is trained by the learner at version s only if s - v <= max_lag.
The pipeline keeps at most max_lag + 1 global batches in flight. Workers apply weight
updates and generation requests in the order they were sent (Ray runs an actor's calls
serially), so a batch requested right after the update to version s is generated with
version s and trained at step s + max_lag at the latest. max_lag = 0 is synchronous
on-policy RL: generate, train, sync, repeat.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import ray
import torch

import kl
from actors.records import Rollout
from cluster.prompts import PromptStream
from cluster.run_log import RunLog
from cluster.train_config import TrainConfig


@dataclass
class InFlight:
    """One global batch being generated: one request per rollout worker."""

    refs: list
    requested_at_version: int
    requested_at: float = field(default_factory=time.perf_counter)


class Controller:
    def __init__(self, cfg: TrainConfig, run_dir: Path, model_dir: Path):
        self.cfg, self.run_dir, self.model_dir = cfg, Path(run_dir), Path(model_dir)
        self.step = 0                # optimizer steps taken == learner policy version
        self.pending: deque[InFlight] = deque()
        self.sync_refs: list = []    # outstanding load_weights calls, checked before use
        self.dropped_stale = 0       # rollouts discarded for lag > max_lag (should stay 0)
        self.published_version = 0   # version of the weights the workers were last sent
        self.nonfinite_run = self.nonfinite_total = 0  # refused (NaN/inf) learner steps
        self.prompts = PromptStream(cfg.task, cfg.seed)
        self.learner = self.workers = self.log = None

    # ---------------------------------------------------------------- main loop
    def run(self) -> dict:
        """Train for cfg.total_steps; returns the last metrics. Tears everything down on exit."""
        from cluster.progress import TrainProgress

        try:
            self._start()
            last = self._evaluate(self.step)
            self.log.log({"step": self.step, "policy_version": self.step, **last})
            with TrainProgress(self.cfg.total_steps, self.step) as progress:
                while self.step < self.cfg.total_steps:
                    t0 = time.perf_counter()
                    self._fill_pipeline()
                    batch, gen_metrics = self._take_batch()
                    metrics = self._train(batch) | gen_metrics
                    metrics |= self._sync_weights()
                    metrics |= self._maybe_evaluate()
                    self._maybe_checkpoint()
                    metrics["time/step"] = time.perf_counter() - t0
                    self.log.log({"step": self.step, "policy_version": self.step, **metrics})
                    progress.update(self.step, metrics)
                    last = metrics
            self._finish()
            return last
        finally:
            self._shutdown()

    # ---------------------------------------------------------------- steps
    def _start(self) -> None:
        from cluster.launch import start_learner, start_workers

        self.log = RunLog(self.cfg, self.run_dir)
        self.learner = start_learner(self.cfg, self.model_dir, run_id=self.run_dir.name)
        self.workers = start_workers(self.cfg, self.model_dir)
        if self.cfg.sync.transport == "nccl":  # GPU only: one NCCL group, learner rank 0 -> workers
            self.learner.connect_nccl(self.workers)

    def _fill_pipeline(self) -> None:
        """Request generation until max_lag + 1 global batches are in flight."""
        per_worker = self.cfg.rollout.prompts_per_step // len(self.workers)
        while len(self.pending) < self.cfg.max_lag + 1:
            problems, group_ids = self.prompts.next_batch(self.cfg.rollout.prompts_per_step)
            seed = self.cfg.seed * 1_000_003 + self.prompts.position
            refs = [w.generate.remote(problems[i * per_worker:(i + 1) * per_worker],
                                      group_ids[i * per_worker:(i + 1) * per_worker], seed + i)
                    for i, w in enumerate(self.workers)]
            self.pending.append(InFlight(refs, self.step))

    def _take_batch(self):
        """Wait for the oldest batch; drop (and count) any rollout older than max_lag."""
        inflight = self.pending.popleft()
        t0 = time.perf_counter()
        batches = ray.get(inflight.refs)
        wait_s = time.perf_counter() - t0
        self._check_syncs()
        rollouts: list[Rollout] = []
        for b in batches:
            if self.step - b.policy_version > self.cfg.max_lag:
                self.dropped_stale += len(b.rollouts)
                continue
            rollouts += b.rollouts
        if not rollouts:  # everything was stale: request a fresh batch at the current version
            self._fill_pipeline()
            return self._take_batch()
        lags = [self.step - r.policy_version for r in rollouts]
        assert max(lags) <= self.cfg.max_lag, "lag bound violated"  # the invariant above
        gen_s = max(b.gen_seconds for b in batches)
        tokens = sum(b.num_response_tokens for b in batches)
        failures = sum(r.score_failure is not None for r in rollouts)
        rewards = [r.reward for r in rollouts]
        return rollouts, {
            "lag/max": max(lags), "lag/mean": sum(lags) / len(lags), "lag/dropped_total": self.dropped_stale,
            "reward/mean": sum(rewards) / len(rewards), "reward/score_failures": failures,
            "time/generate": gen_s, "time/wait_for_rollouts": wait_s,
            "throughput/gen_tokens_per_s": tokens / gen_s if gen_s > 0 else 0.0,
        }

    def _train(self, rollouts: list[Rollout]) -> dict:
        from learner.batch import TrainBatch

        t0 = time.perf_counter()
        rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float64)
        group_ids = torch.tensor([r.group_id for r in rollouts])
        adv = kl.compute_advantages(rewards, group_ids, estimator=self.cfg.advantage.estimator,
                                    normalize=self.cfg.advantage.normalize, eps=self.cfg.advantage.eps)
        batch = TrainBatch.from_rollouts(rollouts, adv, pad_id=self.pad_id)
        metrics = self.learner.train_step(batch)
        self.step = self.learner.version
        self._count_nonfinite(bool(metrics.get("nonfinite")))
        return metrics | {"time/train": time.perf_counter() - t0, "nonfinite/total": self.nonfinite_total}

    def _count_nonfinite(self, refused: bool) -> None:
        """A refused step leaves the weights (and version) unchanged; too many in a row stop
        the run, since the data or the model has gone bad in a way retrying will not fix."""
        self.nonfinite_run = self.nonfinite_run + 1 if refused else 0
        self.nonfinite_total += refused
        if self.nonfinite_run >= self.cfg.max_consecutive_nonfinite:
            raise RuntimeError(
                f"{self.nonfinite_run} consecutive non-finite (NaN/inf) learner steps; the last "
                f"was the attempt at step {self.step + 1}. Weights are those of step {self.step}.")

    def _sync_weights(self) -> dict:
        """Publish the new weights and queue their load on every worker (not awaited here:
        each worker applies it before its next generate call; failures surface in _check_syncs)."""
        if self.step == self.published_version:
            return {}  # a refused step changed nothing: the workers already hold these weights
        t0 = time.perf_counter()
        self.published_version = self.step
        update = self.learner.export_weights(self.cfg.sync.transport, self.cfg.sync.shm_dir)
        self.sync_refs += [w.load_weights.remote(update) for w in self.workers]
        return {"time/weight_publish": time.perf_counter() - t0}

    def _check_syncs(self) -> None:
        """Every queued weight load must have finished, or failed loudly, within the timeout."""
        if self.sync_refs:
            ray.get(self.sync_refs, timeout=self.cfg.sync.timeout_s)
            self.sync_refs = []

    def _maybe_evaluate(self) -> dict:
        every = self.cfg.eval_every
        if self.step == self.cfg.total_steps or (every and self.step % every == 0):
            return self._evaluate(self.step)
        return {}

    def _evaluate(self, step: int) -> dict:
        """Greedy (and sampled) accuracy on the eval sets with worker 0's current weights (version `step`)."""
        ev, task = self.cfg.eval, self.cfg.task
        sets = {}
        for name, s in (("in_domain", ev.in_domain), ("out_of_domain", ev.out_of_domain)):
            if s is not None:
                sets[name] = (s.task or task.name, s.options if s.task else task.options, s.split)
        self._check_syncs()
        result = ray.get(self.workers[0].evaluate.remote(sets, ev.num_problems, ev.samples))
        return {f"eval/{name}/{key}": value for name, accs in result.items() for key, value in accs.items()}

    def _maybe_checkpoint(self) -> None:
        every = self.cfg.checkpoint_every
        if every and self.step % every == 0:
            self.learner.save_checkpoint(self.run_dir / "checkpoints", tag=f"step_{self.step}")

    def _finish(self) -> None:
        self.learner.save_hf(self.run_dir / "final")

    def _shutdown(self) -> None:
        if self.log is not None:
            self.log.close()
        for w in self.workers or []:
            ray.kill(w)
        if self.learner is not None:
            self.learner.shutdown()
        from actors.weight_sync import remove_published

        remove_published(self.run_dir.name, self.cfg.sync.shm_dir)  # /dev/shm is RAM

    @property
    def pad_id(self) -> int:
        if not hasattr(self, "_pad_id"):
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(self.model_dir)
            self._pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        return self._pad_id
