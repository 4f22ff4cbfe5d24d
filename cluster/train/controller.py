"""The central controller: schedules generation under max_lag, trains, syncs weights (the
sync's books, deadlines and transport: cluster/train/weight_sync_state.py).

Async invariant, per token (enforced in `_take_batch`, asserted before training): a token
sampled with weights of version v is trained by the learner at version s only if
s - v <= max_lag. The rule reads a rollout's `policy_version`, the version of its OLDEST
token (the only version of its tokens with batch-level generation), so the oldest token of a
sample decides. The pipeline keeps at most max_lag + 1 global batches in flight, and a batch
requested right after the update to version s holds no token older than s, in either
generation mode (actors/generation/): batch-level because a worker applies weight updates and
generation requests in the order they were sent (Ray runs an actor's calls serially), so the
batch is generated with version s; continuous (`rollout.in_flight_updates`) because the update
to s is sent (`publish`) before the batch is requested with min_version s, and the worker
starts no request before it holds a version >= min_version (its later tokens may come from
newer versions, applied while the request is in flight). Either way it is trained at step
s + max_lag at the latest.
max_lag = 0 is synchronous on-policy RL: generate, train, sync, repeat.
"""
from __future__ import annotations

import functools
import sys
import time
from collections import deque
from pathlib import Path

from actors.records import Rollout, RolloutBatch
from actors.seeds import generate_seed
from cluster.config.train_config import TrainConfig
from cluster.train import checkpoint as ckpt
from cluster.train.batching import pad_token_id, policy_tokenizer, shaping_metrics, train_batch
from cluster.train.deadlines import LearnerDeadlines
from cluster.train.dynamic_sampling import DynamicSampler
from cluster.train.episodes import EpisodeBook
from cluster.train.launch import start_engines_and_learner, start_learner
from cluster.train.learner_restarts import LearnerRestarts, heals
from cluster.train.learning_signal import NoSignalWatch, signal_metrics
from cluster.train.progress import TrainProgress
from cluster.train.prompts import PromptStream
from cluster.train.recovery import Recovery
from cluster.train.run_log import completion_text, final_dir, sample_rows
from cluster.train.step_metrics import batch_metrics
from cluster.train.stopping import RunStopped
from cluster.train.weight_sync_state import WeightSyncState
from cluster.train.worker_pool import InFlight, WorkerPool


class Controller:
    """One run from start to end: owns the schedule (the batches in flight under max_lag, the
    prompt stream's position), the step count and the non-finite streak, and the run's parts
    (the worker pool, the learner group, the metrics log, the weight sync's books in
    `weights`), which it starts and stops. Every way back (start, resume, learner restart,
    worker replacement) and the checkpoints they read are `recovery`'s (recovery.py)."""

    def __init__(self, cfg: TrainConfig, run_dir: Path, model_dir: Path,
                 resume_from: Path | None = None, stop_requested=lambda: None):
        self.cfg, self.run_dir, self.model_dir = cfg, Path(run_dir), Path(model_dir)
        self.resume_from = resume_from   # a complete checkpoint directory, or None
        self.stop_requested = stop_requested  # -> a RunStopped to raise at the next step, or None
        self.step = 0                # optimizer steps taken == learner policy version
        self.pending: deque[InFlight] = deque()
        self.weights = WeightSyncState(cfg.sync, self.run_dir.name)
        self.mode = cfg.rollout.generation  # how generation is scheduled (actors/generation/)
        self.dropped_stale = 0       # rollouts discarded for lag > max_lag (should stay 0)
        self.reissued_logged = 0     # pool.reissued_samples when the last step was logged
        self.last_batches: dict[int, RolloutBatch] = {}  # per worker, without its rollouts
        self.nonfinite_run = self.nonfinite_total = 0  # refused (NaN/inf) learner steps
        self.no_signal = NoSignalWatch(cfg.logging.no_signal_steps)
        ds = cfg.dynamic_sampling  # drop zero-spread groups, refill (dynamic_sampling.py)
        self.sampler = (DynamicSampler(cfg.rollout.prompts_per_step, ds.max_batches_per_step,
                                       cfg.learner.updates_per_batch) if ds.enabled else None)
        self.prompts = PromptStream.for_run(cfg, model_dir)  # loads a dataset split here
        self.learner = self.pool = self.log = None
        self.learner_restarts = LearnerRestarts(cfg.faults.max_learner_restarts)
        self.recovery = Recovery(self)
        # multi-turn (task.environment): the environment's failures and the episode metrics
        self.episodes = EpisodeBook(cfg.task.environment) if cfg.task.environment.enabled else None

    # ---------------------------------------------------------------- main loop
    def run(self) -> dict:
        """Train up to cfg.total_steps; returns the last metrics. On RunStopped, checkpoints
        first; tears everything down on any exit."""
        completed = False
        try:
            last = self._start()
            with TrainProgress(self._planned_steps(), self.step) as progress:
                progress.show_evaluation(self.step, last)
                while True:
                    try:
                        while self._another_step():
                            last = self._take_step(progress)
                        self._finish()
                        break
                    except Exception as failure:  # noqa: BLE001 - re-raised unless it heals
                        if not heals(failure, self.learner):
                            raise
                        self.recovery.restart_learner(failure)
            completed = True
            return last
        except RunStopped as stop:
            self.recovery.checkpoint_for(stop)
            raise
        finally:
            # A failed or stopped run raises its own exception; a part that then fails to
            # stop as well is printed, not raised in its place.
            self.recovery.stop_parts(raise_errors=completed)

    # ---------------------------------------------------------------- steps
    def _take_step(self, progress: TrainProgress) -> dict:
        """One step: generate (under max_lag), train, publish, evaluate, checkpoint, log."""
        self._honour_stop_request()
        t0 = time.perf_counter()
        self._fill_pipeline()
        batch, gen_metrics = (self._take_batch() if self.sampler is None
                              else self.sampler.fill(self._take_next, self.step))
        trained_by = self.step  # the learner version that trains this batch
        metrics = self._train(batch) | gen_metrics
        metrics |= self._publish()
        metrics |= self._maybe_evaluate()
        self._maybe_checkpoint()
        self._maybe_export_hf()
        metrics |= {"time/step": time.perf_counter() - t0,
                    "faults/worker_restarts": self.pool.restarts,
                    "faults/reissued_samples": self._reissued_this_step(),
                    **self.learner_restarts.metrics(),
                    **self.prompts.metrics(self.trained_position)}
        self.log.log({"step": self.step, "policy_version": self.step, **metrics})
        self._maybe_log_samples(batch, trained_by)
        progress.update(self.step, metrics)
        return metrics

    def _start(self) -> dict:
        """Start (or resume) the run (recovery.py); the step-0 evaluation of a fresh run."""
        return self.recovery.start()

    def _start_parts(self) -> None:
        """Start the rollout workers and the learner group, and join them for the weight sync:
        side by side, or on a GPU the learner may share, the engines first (launch.py)."""
        def start_pool():  # a worker is replaced as the recovery says (its transport's traits)
            self.pool = WorkerPool(self.cfg, self.model_dir, self.recovery)

        start_engines_and_learner(self.cfg, start_pool, lambda: self.pool.wait_started(),
                                  self._start_learner)
        self.weights.connect(self.learner, self.pool)

    def _start_learner(self) -> None:
        self.learner = start_learner(self.cfg, self.model_dir, run_id=self.run_dir.name,
                                     steps=self._planned_steps(),
                                     wait=LearnerDeadlines(self.cfg.faults))

    def _honour_stop_request(self) -> None:
        stop = self.stop_requested()
        if stop is not None:
            raise stop

    def _planned_steps(self) -> int:
        """total_steps, or fewer when data.epochs hold fewer batches."""
        by_data = self.prompts.max_steps(self.cfg.rollout.prompts_per_step)
        return self.cfg.total_steps if by_data is None else min(self.cfg.total_steps, by_data)

    def _another_step(self) -> bool:
        """Whether the run takes another step: total_steps not reached, and a batch in flight
        or one more in the data (data.epochs end the run otherwise)."""
        return self.step < self.cfg.total_steps and (
            bool(self.pending) or self.prompts.has_batch(self.cfg.rollout.prompts_per_step))

    def _fill_pipeline(self) -> None:
        """Request generation until max_lag + 1 global batches are in flight (or the data's
        epochs are used up)."""
        per_worker = self.cfg.rollout.prompts_per_step // len(self.pool)
        while (len(self.pending) < self.cfg.max_lag + 1
               and self.prompts.has_batch(self.cfg.rollout.prompts_per_step)):
            start = self.prompts.position
            problems, group_ids = self.prompts.next_batch(self.cfg.rollout.prompts_per_step)
            end = self.prompts.position
            # The generation mode's min_version: continuous, the version published last (module
            # docstring); batch-level none, so the arguments (and the order of calls) stay
            # those that make a resumed run replay exactly.
            min_version = self.mode.min_version_args(self.step)
            calls = [self.pool.call(i, "generate", problems[i * per_worker:(i + 1) * per_worker],
                                    group_ids[i * per_worker:(i + 1) * per_worker],
                                    generate_seed(self.cfg.seed, end, i), *min_version)
                     for i in range(len(self.pool))]
            self.pending.append(InFlight(calls, start, self.step))

    def _take_batch(self):
        """Wait for the oldest batch; drop (and count) any rollout older than max_lag."""
        inflight = self.pending[0]  # popped only once complete: a checkpoint replays it
        t0 = time.perf_counter()
        batches = [self.pool.result(call) for call in inflight.calls]
        self.pending.popleft()
        wait_s = time.perf_counter() - t0
        self.weights.batch_generated(inflight)
        self.weights.check()
        rollouts: list[Rollout] = []
        for b in batches:
            if self.step - b.policy_version > self.cfg.max_lag:
                self.dropped_stale += len(b.rollouts)
                continue
            rollouts += b.rollouts
        env_metrics = {}
        if self.episodes is not None:  # groups the environment failed leave the batch
            rollouts, env_metrics = self.episodes.take(
                rollouts, lambda line: self.log.record_warning("environment", line))
        if not rollouts:  # everything was stale: request a fresh batch at the current version
            self._fill_pipeline()
            return self._take_batch()
        metrics = batch_metrics(batches, rollouts, self.step, dropped_total=self.dropped_stale,
                                updates_per_batch=self.cfg.learner.updates_per_batch,
                                wait_s=wait_s, last_batches=self.last_batches)
        # the invariant (module docstring), per sample and per token
        assert metrics["lag/max"] <= self.cfg.max_lag, "lag bound violated"
        assert metrics["lag/token_max"] <= self.cfg.max_lag, "token lag bound violated"
        return rollouts, metrics | env_metrics

    def _take_next(self):
        """Dynamic sampling's next global batch, requested first if none is in flight; None
        when the data's epochs are used up."""
        self._fill_pipeline()
        return self._take_batch() if self.pending else None

    def _publish(self) -> dict:
        """Publish the learner's new weights and queue their load on every worker, behind what
        the generation mode says it waits for: batch-level, the batches in flight on its
        worker (its sync.timeout_s counts from when the newest of them was generated);
        continuous, nothing, as it runs between two engine steps while they are generated."""
        return self.weights.publish(self.mode.loads_queue_behind(self.pending))

    def _reissued_this_step(self) -> int:
        """Samples sent again to a replaced worker's replacement since the last step's row."""
        since, self.reissued_logged = self.reissued_logged, self.pool.reissued_samples
        return self.pool.reissued_samples - since

    def _train(self, rollouts: list[Rollout]) -> dict:
        t0 = time.perf_counter()
        shaping, budget = self.cfg.task.overlong, self.cfg.rollout.max_new_tokens
        batch = train_batch(rollouts, self.cfg.advantage, self.pad_id, version=self.step,
                            overlong=shaping, budget=budget)
        metrics = self.learner.train_step(batch) | shaping_metrics(rollouts, shaping, budget)
        self.step = self.learner.version
        self._count_nonfinite(bool(metrics.get("nonfinite")))
        if warning := self.no_signal.update(self.step, batch.rewards, batch.advantages):
            print(f"warning: {warning}", file=sys.stderr, flush=True)
            self.log.record_warning("no_signal", warning)
        return metrics | signal_metrics(batch.rewards, batch.group_ids) | {
            "time/train": time.perf_counter() - t0, "nonfinite/total": self.nonfinite_total}

    def _count_nonfinite(self, refused: bool) -> None:
        """A refused step leaves the weights (and version) unchanged; too many in a row stop
        the run, since the data or the model has gone bad in a way retrying will not fix."""
        self.nonfinite_run = self.nonfinite_run + 1 if refused else 0
        self.nonfinite_total += refused
        if self.nonfinite_run >= self.cfg.max_consecutive_nonfinite:
            raise RunStopped(
                f"{self.nonfinite_run} consecutive non-finite (NaN/inf) learner steps; the last "
                f"was the attempt at step {self.step + 1}. Weights are those of step {self.step}.")

    def _maybe_evaluate(self) -> dict:
        every = self.cfg.eval_every
        if not self._another_step() or (every and self.step % every == 0):  # and at the end
            return self._evaluate(self.step)
        return {}

    def _evaluate(self, step: int) -> dict:
        """Evaluation with worker 0's current weights (version `step`): eval/<set>/accuracy
        (greedy pass@1), sampled_accuracy, truncated and mean_response_tokens per set
        (actors.evaluate.EvalReport.metrics)."""
        self.weights.check()
        report = self.pool.result(self.pool.call(0, "evaluate", self.cfg.eval))
        return report.metrics()

    def _maybe_checkpoint(self) -> None:
        every = self.cfg.checkpoint_every
        if every and self.step % every == 0:
            self.recovery.checkpoint()

    def _maybe_export_hf(self) -> None:
        every = self.cfg.hf_every
        if every and self.step % every == 0:
            ckpt.write_hf_export(self.run_dir, self.step, self.learner.save_hf, self.cfg.keep_hf)

    def _maybe_log_samples(self, batch: list[Rollout], trained_by: int) -> None:
        """Every logging.samples_every steps, the step's samples table (run_log.sample_rows);
        a refused step (the version did not advance) logs none."""
        lg = self.cfg.logging
        if lg.samples_every and self.step > trained_by and self.step % lg.samples_every == 0:
            self.log.log_samples(sample_rows(batch, self.step, trained_by, lg.samples_per_log,
                                             self._decode))

    def _decode(self, rollout: Rollout) -> str:
        return completion_text(self.tokenizer, rollout.prompt_ids, rollout.response_ids,
                               self.cfg.task.stop)

    @functools.cached_property
    def tokenizer(self):
        """The policy's tokenizer (pad id, sample texts), loaded on first use."""
        return policy_tokenizer(self.model_dir, self.cfg.model)

    def _finish(self) -> None:
        if self.cfg.checkpoint_every:  # so that the run can be extended with --resume
            self.recovery.checkpoint()
        self.learner.save_hf(final_dir(self.run_dir))

    @property
    def trained_position(self) -> int:
        """Every prompt before this data position was trained on, none after it (batches in
        flight are replayed on resume)."""
        return self.pending[0].start_position if self.pending else self.prompts.position

    @functools.cached_property
    def pad_id(self) -> int:
        return pad_token_id(self.tokenizer)
