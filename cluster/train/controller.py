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

import dataclasses
import functools
import sys
import time
from collections import deque
from pathlib import Path

from actors.records import POOL_ERROR, Rollout, RolloutBatch, engine_idle_share
from actors.seeds import generate_seed
from actors.weight_sync import transport
from cluster.config.loader import ConfigError
from cluster.config.train_config import TrainConfig
from cluster.train import checkpoint as ckpt
from cluster.train.batching import pad_token_id, policy_tokenizer, shaping_metrics, train_batch
from cluster.train.deadlines import LearnerDeadlines
from cluster.train.episodes import EpisodeBook
from cluster.train.launch import start_engines_and_learner, start_learner
from cluster.train.learner_restarts import LearnerRestarts, failure_line, heals
from cluster.train.learning_signal import NoSignalWatch, signal_metrics
from cluster.train.progress import TrainProgress
from cluster.train.prompts import PromptStream
from cluster.train.run_log import (
    RunLog,
    completion_text,
    final_dir,
    keep_logs_through,
    sample_rows,
)
from cluster.train.staleness import token_lag_metrics
from cluster.train.stopping import RunStopped
from cluster.train.weight_sync_state import WeightSyncState
from cluster.train.worker_pool import InFlight, WorkerPool


class Controller:
    """One run from start to end: owns the schedule (the batches in flight under max_lag, the
    prompt stream's position), the step count and the non-finite streak, and the run's parts
    (the worker pool, the learner group, the metrics log, the weight sync's books in
    `weights`), which it starts, checkpoints with the run and stops."""

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
        self.prompts = PromptStream.for_run(cfg, model_dir)  # loads a dataset split here
        self.learner = self.pool = self.log = None
        self.learner_restarts = LearnerRestarts(cfg.faults.max_learner_restarts)
        self._reference_sha256: str | None = None
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
                        self._restart_learner(failure)
            completed = True
            return last
        except RunStopped as stop:
            self._checkpoint_for(stop)
            raise
        finally:
            # A failed or stopped run raises its own exception; a part that then fails to
            # stop as well is printed, not raised in its place.
            self._shutdown(raise_errors=completed)

    # ---------------------------------------------------------------- steps
    def _take_step(self, progress: TrainProgress) -> dict:
        """One step: generate (under max_lag), train, publish, evaluate, checkpoint, log."""
        self._honour_stop_request()
        t0 = time.perf_counter()
        self._fill_pipeline()
        batch, gen_metrics = self._take_batch()
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
                    **self.prompts.metrics(self._trained_position)}
        self.log.log({"step": self.step, "policy_version": self.step, **metrics})
        self._maybe_log_samples(batch, trained_by)
        progress.update(self.step, metrics)
        return metrics

    def _start(self) -> dict:
        """Start (or resume) the run; returns the step-0 evaluation of a fresh run."""
        state = self._read_resume_state()
        self.log = RunLog(self.cfg, self.run_dir, resume_wandb_id=state and state.wandb_id,
                          rewind_to=state and state.step)
        self._start_parts()
        if state is None:
            first = self._evaluate(self.step)
            self.log.log({"step": 0, "policy_version": 0, **first})
            return first
        self._restore(state, self.resume_from)
        self.weights.resume()
        self.pool.restarts = state.worker_restarts
        self.learner_restarts.count = state.learner_restarts
        self.learner_restarts.steps_lost = state.learner_steps_lost
        print(f"resumed {self.run_dir} at step {self.step} from {self.resume_from.name}")
        return {}

    def _start_parts(self) -> None:
        """Start the rollout workers and the learner group, and join them for the weight sync:
        side by side, or on a GPU the learner may share, the engines first (launch.py)."""
        def start_pool():  # a replaced worker is re-synced by the weight sync of the moment
            self.pool = WorkerPool(self.cfg, self.model_dir,
                                   on_restart=lambda worker: self.weights.resync(worker))

        start_engines_and_learner(self.cfg, start_pool, lambda: self.pool.wait_started(),
                                  self._start_learner)
        self.weights.connect(self.learner, self.pool)

    def _start_learner(self) -> None:
        self.learner = start_learner(self.cfg, self.model_dir, run_id=self.run_dir.name,
                                     steps=self._planned_steps(),
                                     wait=LearnerDeadlines(self.cfg.faults))

    def _restore(self, state: ckpt.ControllerState, checkpoint: Path) -> None:
        """Put the new learner and the schedule where the complete `checkpoint` left them; the
        batches that were in flight are generated again from `prompt_position` on (same
        prompts, same seeds). The caller gives the workers the restored weights."""
        self.step = self.learner.load_checkpoint(checkpoint, ckpt.LEARNER_TAG)
        assert self.step == state.step, \
            f"learner restored step {self.step}, controller {state.step}"
        self.prompts.position = state.prompt_position
        self.nonfinite_total, self.nonfinite_run = state.nonfinite_total, state.nonfinite_run
        self.dropped_stale = state.dropped_stale
        if self.episodes is not None:  # the failed share keeps counting across a resume
            self.episodes.restore(state.env_samples, state.env_failures)

    def _restart_learner(self, failure: Exception) -> None:
        """The learner group broke (learner_restarts.heals): do in the run what `--resume`
        does after it (cluster/train/learner_restarts.py), counting faults on; everything the
        steps decide goes back to the checkpoint. Where the transport allows
        (`engines_outlive_the_learner`: shm, object_store) the rollout workers keep their
        engines: their calls in flight, which belong to the lost steps, are settled and each
        loads the checkpoint's weights; otherwise every part but the log is started again.
        LearnerRestartsExhausted when no restart is left."""
        t0 = time.perf_counter()
        checkpoint = ckpt.latest_checkpoint(self.run_dir)
        state = ckpt.read_checkpoint(checkpoint) if checkpoint is not None else None
        back_to = state.step if state is not None else 0
        why = failure_line(failure, self.learner)
        self.learner_restarts.take(why, self.step, back_to)
        lost_from, worker_restarts = self.step, self.pool.restarts
        keep = transport(self.cfg.sync.transport).engines_outlive_the_learner
        print(f"{why}; restarting the learner", file=sys.stderr, flush=True)
        self._shutdown(raise_errors=True, keep_log=True, keep_workers=keep)
        try:
            if keep:  # the old transport's files stay until the loads queued on them are done
                self.pool.settle([c for b in self.pending for c in b.calls]
                                 + [load.call for load in self.weights.loads])
                self.weights.cleanup()
            self.pending.clear()
            self.last_batches = {}
            self.weights = WeightSyncState(self.cfg.sync, self.run_dir.name)
            self.log.rewind(back_to)
            ckpt.drop_hf_exports_after(self.run_dir, back_to)
            if keep:
                self._start_learner()
                self.weights.connect(self.learner, self.pool)
            else:
                self._start_parts()
                self.pool.restarts, self.reissued_logged = worker_restarts, 0
            if state is not None:
                self._restore(state, checkpoint)
            else:  # no checkpoint yet: the new group holds the starting weights, as at step 0
                self.step, self.prompts.position, self.dropped_stale = 0, 0, 0
                self.nonfinite_total = self.nonfinite_run = 0
            if keep:
                self.weights.rewind()
            elif state is not None:
                self.weights.resume()
        except RunStopped as stop:  # e.g. a worker hung in its (re)start: the new group does
            stop.write_checkpoint = False  # not hold the run's state; the last one is kept
            raise
        print(self.learner_restarts.describe(checkpoint.name if checkpoint else "step 0",
                                             lost_from, back_to, time.perf_counter() - t0,
                                             workers_kept=keep),
              file=sys.stderr, flush=True)

    def _read_resume_state(self) -> ckpt.ControllerState | None:
        """The checkpoint's controller state (after checking the reference model is the one
        it started from; train()'s preflight checked the config), and the metrics log cut
        back to the checkpoint's step: later rows (and hf/ exports) are redone."""
        if self.resume_from is None:
            return None
        state = ckpt.read_checkpoint(self.resume_from)  # its config: checked by preflight
        if state.reference_sha256 != self.reference_sha256:
            raise ConfigError(f"cannot resume {self.resume_from}: the reference model's weights "
                             f"in {self.cfg.model.ref_path or self.model_dir} differ from the ones "
                              "the run started from")
        keep_logs_through(self.run_dir, state.step)
        ckpt.drop_hf_exports_after(self.run_dir, state.step)
        return state

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
        lags = [self.step - r.policy_version for r in rollouts]
        per_token = token_lag_metrics(rollouts, self.step)
        assert max(lags) <= self.cfg.max_lag, "lag bound violated"  # the invariant above
        assert per_token["lag/token_max"] <= self.cfg.max_lag, "token lag bound violated"
        updates = self.cfg.learner.updates_per_batch
        gen_s = max(b.gen_seconds for b in batches)
        tokens = sum(b.num_response_tokens for b in batches)
        failures = sum(r.score_failure is not None for r in rollouts)
        pool_errors = sum(any(r.score_failure == POOL_ERROR for r in b.rollouts) for b in batches)
        rewards = [r.reward for r in rollouts]
        lengths = [len(r.response_ids) for r in rollouts]
        return rollouts, per_token | env_metrics | self._engine_idle(batches) | {
            "lag/max": max(lags), "lag/mean": sum(lags) / len(lags),
            "lag/dropped_total": self.dropped_stale,
            # In optimizer steps: update k of this batch trains on data lag * updates + k steps
            # older than its weights (equal to lag/max with one update per batch).
            "lag/max_optimizer_steps": max(lags) * updates + updates - 1,
            "rollout/policy_version": sum(r.policy_version for r in rollouts) / len(rollouts),
            "reward/mean": sum(rewards) / len(rewards), "reward/score_failures": failures,
            "faults/scoring_pool_errors": pool_errors,  # generate calls whose pool failed
            "time/generate": gen_s, "time/wait_for_rollouts": wait_s,
            "throughput/gen_tokens_per_s": tokens / gen_s if gen_s > 0 else 0.0,
            "rollout/response_tokens_mean": sum(lengths) / len(lengths),
            "rollout/response_tokens_max": max(lengths),
            # requests of the step's batches preempted by in-flight weight updates (0
            # batch-level): with lag/multi_version_share, whether anything was in flight
            "rollout/preempted": sum(b.preempted for b in batches),
        }

    def _engine_idle(self, batches: list[RolloutBatch]) -> dict:
        """rollout/engine_idle_share: the mean over workers of the share of the time since
        their previous batch that their engine sat idle (actors.records.engine_idle_share;
        none on a worker's first batch, or its replacement's)."""
        shares = [share for b in batches if (before := self.last_batches.get(b.worker))
                  and (share := engine_idle_share(before, b)) is not None]
        self.last_batches |= {b.worker: dataclasses.replace(b, rollouts=[]) for b in batches}
        return {"rollout/engine_idle_share": sum(shares) / len(shares)} if shares else {}

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
            self._checkpoint()

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

    def _checkpoint(self) -> Path:
        """Write a complete checkpoint of the run at the current step (atomic; see
        cluster/train/checkpoint.py). Invariant: every prompt before `prompt_position` was trained
        on by a step <= self.step, and none after it (batches in flight are replayed)."""
        state = ckpt.ControllerState(
            step=self.step, prompt_position=self._trained_position,
            nonfinite_total=self.nonfinite_total, nonfinite_run=self.nonfinite_run,
            dropped_stale=self.dropped_stale,
            worker_restarts=self.pool.restarts if self.pool else 0,
            learner_restarts=self.learner_restarts.count,
            learner_steps_lost=self.learner_restarts.steps_lost, wandb_id=self.log.wandb_id,
            env_samples=self.episodes.samples if self.episodes else 0,
            env_failures=self.episodes.failures if self.episodes else 0,
            reference_sha256=self.reference_sha256, config=self.cfg.model_dump(mode="json"))
        return ckpt.write_checkpoint(self.run_dir, state, self.learner.save_checkpoint,
                                     keep=self.cfg.keep_checkpoints)

    def _checkpoint_for(self, stop: RunStopped) -> None:
        """Give `stop` the checkpoint to resume from: a new one, or the last complete one when
        the learner cannot write one (it hung, now or while writing this one)."""
        stop.run_dir = self.run_dir
        if stop.write_checkpoint and self.learner is not None:
            try:
                stop.checkpoint = self._checkpoint()
                return
            except RunStopped as hung:  # the learner hung writing it: that is the news
                self._checkpoint_for(hung)
                raise hung from stop
        stop.checkpoint = ckpt.latest_checkpoint(self.run_dir)

    def _finish(self) -> None:
        if self.cfg.checkpoint_every:  # so that the run can be extended with --resume
            self._checkpoint()
        self.learner.save_hf(final_dir(self.run_dir))

    def _shutdown(self, raise_errors: bool = True, keep_log: bool = False,
                  keep_workers: bool = False) -> None:
        """Stop every part (but the log when `keep_log`, and the workers with the weights
        published to them when `keep_workers`: a learner restart), each on its own: a part
        that fails (a log that cannot be closed) must not keep the others (workers, learner
        ranks, shm files) alive. Every failure is printed; once all parts have run, the first
        is raised (when `raise_errors`)."""
        parts = [(name, getattr(part, method)) for name, part, method in (
            ("metrics log", None if keep_log else self.log, "close"),
            ("rollout workers", None if keep_workers else self.pool, "kill_all"),
            ("learner", self.learner, "shutdown")) if part is not None]
        if not keep_workers:
            parts.append(("published weights", self.weights.cleanup))  # shm: /dev/shm is RAM
        errors = []
        for name, stop in parts:
            try:
                stop()
            except Exception as exc:  # noqa: BLE001 - every part gets its turn; raised below
                print(f"shutdown: stopping the {name} failed: {type(exc).__name__}: {exc}",
                      file=sys.stderr)
                errors.append(exc)
        if errors and raise_errors:
            raise errors[0]

    @property
    def _trained_position(self) -> int:
        """Every prompt before this data position was trained on, none after it (batches in
        flight are replayed on resume)."""
        return self.pending[0].start_position if self.pending else self.prompts.position

    @property
    def reference_sha256(self) -> str:
        """The KL reference's identity (model.ref_path, else the policy's starting weights),
        checked on resume so a resumed run pulls toward the same reference."""
        if self._reference_sha256 is None:
            self._reference_sha256 = ckpt.model_sha256(self.cfg.model.ref_path or self.model_dir)
        return self._reference_sha256

    @functools.cached_property
    def pad_id(self) -> int:
        return pad_token_id(self.tokenizer)
