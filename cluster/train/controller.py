"""The central controller: schedules generation under max_lag, trains, syncs weights.

Async invariant (enforced in `_take_batch`, asserted before training): a rollout sampled
with weights of version v is trained by the learner at version s only if s - v <= max_lag.
The pipeline keeps at most max_lag + 1 global batches in flight. Workers apply weight
updates and generation requests in the order they were sent (Ray runs an actor's calls
serially), so a batch requested right after the update to version s is generated with
version s and trained at step s + max_lag at the latest. max_lag = 0 is synchronous
on-policy RL: generate, train, sync, repeat.

Sync deadlines: a weight load is queued behind the generate calls already sent to the worker,
so it cannot start before the newest of them has finished. Each load therefore gets its own
`sync.timeout_s`, counted from the moment that batch was generated (`PendingSync.ready_since`),
never from when the load was queued (at max_lag k it waits behind up to k generate calls).
Invariant (enforced in `_sync_weights`): before version v is published, every load of a
version below v - 1 has finished, so a worker never has to load a version whose shm file
was already replaced.
"""
from __future__ import annotations

import functools
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from actors.records import POOL_ERROR, Rollout
from actors.seeds import generate_seed
from actors.weight_sync import remove_published
from cluster.config.loader import ConfigError
from cluster.config.train_config import TrainConfig
from cluster.train import checkpoint as ckpt
from cluster.train.batching import pad_token_id, policy_tokenizer, train_batch
from cluster.train.deadlines import Deadline, Hung, LearnerDeadlines
from cluster.train.launch import connect_cuda_ipc, connect_nccl, start_learner
from cluster.train.progress import TrainProgress
from cluster.train.prompts import PromptStream
from cluster.train.run_log import (
    RunLog,
    completion_text,
    final_dir,
    keep_logs_through,
    sample_rows,
)
from cluster.train.stopping import RunStopped
from cluster.train.worker_pool import WorkerCall, WorkerPool


@dataclass
class InFlight:
    """One global batch being generated: one generate call per rollout worker."""

    calls: list[WorkerCall]      # replayed with their own seeds if a worker is replaced
    start_position: int          # data position of its first prompt (resume replays from here)
    requested_at_version: int
    requested_at: float = field(default_factory=time.perf_counter)


@dataclass
class PendingSync:
    """A queued weight load, and when it could start (see the module docstring)."""

    call: WorkerCall
    after: InFlight | None       # the newest batch queued before it on that worker
    ready_since: float | None    # time.monotonic() once `after` was generated; None before

    @property
    def version(self) -> int:
        return self.call.args[0].version


class Controller:
    def __init__(self, cfg: TrainConfig, run_dir: Path, model_dir: Path,
                 resume_from: Path | None = None, stop_requested=lambda: None):
        self.cfg, self.run_dir, self.model_dir = cfg, Path(run_dir), Path(model_dir)
        self.resume_from = resume_from   # a complete checkpoint directory, or None
        self.stop_requested = stop_requested  # -> a RunStopped to raise at the next step, or None
        self.step = 0                # optimizer steps taken == learner policy version
        self.pending: deque[InFlight] = deque()
        self.syncs: list[PendingSync] = []  # weight loads not yet confirmed
        self.dropped_stale = 0       # rollouts discarded for lag > max_lag (should stay 0)
        self.published_version = 0   # version of the weights the workers were last sent
        self.nonfinite_run = self.nonfinite_total = 0  # refused (NaN/inf) learner steps
        self.prompts = PromptStream.for_run(cfg, model_dir)  # loads a dataset split here
        self.learner = self.pool = self.log = None
        self._reference_sha256: str | None = None

    # ---------------------------------------------------------------- main loop
    def run(self) -> dict:
        """Train up to cfg.total_steps; returns the last metrics. On RunStopped, checkpoints
        first; tears everything down on any exit."""
        completed = False
        try:
            last = self._start()
            with TrainProgress(self._planned_steps(), self.step) as progress:
                progress.show_evaluation(self.step, last)
                while self._another_step():
                    self._honour_stop_request()
                    t0 = time.perf_counter()
                    self._fill_pipeline()
                    batch, gen_metrics = self._take_batch()
                    trained_by = self.step  # the learner version that trains this batch
                    metrics = self._train(batch) | gen_metrics
                    metrics |= self._sync_weights()
                    metrics |= self._maybe_evaluate()
                    self._maybe_checkpoint()
                    self._maybe_export_hf()
                    metrics |= {"time/step": time.perf_counter() - t0,
                                "faults/worker_restarts": self.pool.restarts,
                                **self.prompts.metrics(self._trained_position)}
                    self.log.log({"step": self.step, "policy_version": self.step, **metrics})
                    self._maybe_log_samples(batch, trained_by)
                    progress.update(self.step, metrics)
                    last = metrics
            self._finish()
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
    def _start(self) -> dict:
        """Start (or resume) the run; returns the step-0 evaluation of a fresh run."""
        state = self._read_resume_state()
        self.log = RunLog(self.cfg, self.run_dir, resume_wandb_id=state and state.wandb_id)
        # The workers' engines and the learner's ranks start side by side (each start is
        # mostly imports and model loading, in processes of their own).
        self.pool = WorkerPool(self.cfg, self.model_dir, on_restart=self._resync)
        self.learner = start_learner(self.cfg, self.model_dir, run_id=self.run_dir.name,
                                     steps=self._planned_steps(),
                                     wait=LearnerDeadlines(self.cfg.faults))
        self.pool.wait_started()
        if self.cfg.sync.transport == "nccl":  # GPU only: one NCCL group, learner rank 0 -> workers
            connect_nccl(self.learner, self.pool.workers)
        if self.cfg.sync.transport == "cuda_ipc":  # GPU only: the workers on learner rank 0's GPU
            connect_cuda_ipc(self.learner, self.pool.workers)
        if state is None:
            first = self._evaluate(self.step)
            self.log.log({"step": 0, "policy_version": 0, **first})
            return first
        self.step = self.learner.load_checkpoint(self.resume_from, ckpt.LEARNER_TAG)
        assert self.step == state.step, f"learner restored step {self.step}, controller {state.step}"
        self.prompts.position = state.prompt_position
        self.nonfinite_total, self.nonfinite_run = state.nonfinite_total, state.nonfinite_run
        self.dropped_stale, self.pool.restarts = state.dropped_stale, state.worker_restarts
        for w in self.pool.workers:
            self._resync(w)
        self.published_version = self.step
        print(f"resumed {self.run_dir} at step {self.step} from {self.resume_from.name}")
        return {}

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
            calls = [self.pool.call(i, "generate", problems[i * per_worker:(i + 1) * per_worker],
                                    group_ids[i * per_worker:(i + 1) * per_worker],
                                    generate_seed(self.cfg.seed, end, i))
                     for i in range(len(self.pool))]
            self.pending.append(InFlight(calls, start, self.step))

    def _take_batch(self):
        """Wait for the oldest batch; drop (and count) any rollout older than max_lag."""
        inflight = self.pending[0]  # popped only once complete: a checkpoint replays it
        t0 = time.perf_counter()
        batches = [self.pool.result(call) for call in inflight.calls]
        self.pending.popleft()
        wait_s = time.perf_counter() - t0
        for sync in self.syncs:  # loads queued right behind this batch can run from now
            if sync.after is inflight and sync.ready_since is None:
                sync.ready_since = time.monotonic()
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
        updates = self.cfg.learner.updates_per_batch
        gen_s = max(b.gen_seconds for b in batches)
        tokens = sum(b.num_response_tokens for b in batches)
        failures = sum(r.score_failure is not None for r in rollouts)
        pool_errors = sum(any(r.score_failure == POOL_ERROR for r in b.rollouts) for b in batches)
        rewards = [r.reward for r in rollouts]
        return rollouts, {
            "lag/max": max(lags), "lag/mean": sum(lags) / len(lags), "lag/dropped_total": self.dropped_stale,
            # In optimizer steps: update k of this batch trains on data lag * updates + k steps
            # older than its weights (equal to lag/max with one update per batch).
            "lag/max_optimizer_steps": max(lags) * updates + updates - 1,
            "rollout/policy_version": sum(r.policy_version for r in rollouts) / len(rollouts),
            "reward/mean": sum(rewards) / len(rewards), "reward/score_failures": failures,
            "faults/scoring_pool_errors": pool_errors,  # generate calls whose pool failed
            "time/generate": gen_s, "time/wait_for_rollouts": wait_s,
            "throughput/gen_tokens_per_s": tokens / gen_s if gen_s > 0 else 0.0,
        }

    def _train(self, rollouts: list[Rollout]) -> dict:
        t0 = time.perf_counter()
        batch = train_batch(rollouts, self.cfg.advantage, self.pad_id)
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
            raise RunStopped(
                f"{self.nonfinite_run} consecutive non-finite (NaN/inf) learner steps; the last "
                f"was the attempt at step {self.step + 1}. Weights are those of step {self.step}.")

    def _sync_weights(self) -> dict:
        """Publish the new weights and queue their load on every worker (not awaited here:
        each worker applies it before its next generate call; failures surface in _check_syncs)."""
        if self.step == self.published_version:
            return {}  # a refused step changed nothing: the workers already hold these weights
        t0 = time.perf_counter()
        # Every load of a version older than the last one published must be done before the
        # next is published: the shm transport keeps only the newest two files, cuda_ipc the
        # newest two GPU snapshots, and nccl broadcasts one version at a time. So at most one
        # version's loads are in flight per worker; confirming the older ones can wait behind
        # generate calls sent before them.
        self._check_syncs(settle_through=self.published_version - 1)
        self.published_version = self.step
        update = self.learner.export_weights(self.cfg.sync.transport, self.cfg.sync.shm_dir)
        after = self.pending[-1] if self.pending else None
        self.syncs += [PendingSync(self.pool.call(i, "load_weights", update), after,
                                   None if after else time.monotonic())
                       for i in range(len(self.pool))]
        return {"time/weight_publish": time.perf_counter() - t0}

    def _check_syncs(self, settle_through: int | None = None) -> None:
        """Every weight load that could start must finish within sync.timeout_s of that moment
        (module docstring), else the run fails loudly. Loads still queued behind a batch in
        flight are checked later, except those of versions <= `settle_through`, whose batch is
        waited for first. A worker that died meanwhile is replaced (and re-synced)."""
        timeout, waiting = self.cfg.sync.timeout_s, []
        for sync in self.syncs:
            if not self.pool.is_current(sync.call):
                continue  # its worker was replaced and re-synced to the current weights
            if (sync.ready_since is None and settle_through is not None
                    and sync.version <= settle_through):
                self._wait_for_generation(sync)
                if not self.pool.is_current(sync.call):
                    continue
            if sync.ready_since is None:
                waiting.append(sync)
                continue
            try:
                remaining = sync.ready_since + timeout - time.monotonic()
                ray.get(sync.call.ref, timeout=max(0.0, remaining))
            except RayActorError:
                self.pool.restart(sync.call.worker, "died while loading weights")
            except GetTimeoutError:
                self._on_late_load(sync, timeout)
        self.syncs = waiting

    def _on_late_load(self, sync: PendingSync, timeout: float) -> None:
        """A load past its sync.timeout_s: a worker that no longer answers (frozen, as a hang
        in the load itself or just before it leaves it) is hung and replaced like one that
        hangs in generate (one restart; the replacement is re-synced); a live worker whose
        load is that slow is a broken sync, which a restart would not mend: the run fails."""
        i, version = sync.call.worker, sync.call.args[0].version
        why = self.pool.unresponsive(i)
        if why is None:
            raise TimeoutError(f"rollout worker {i} did not load weights version {version} "
                               f"within sync.timeout_s={timeout:g} of being able to start")
        deadline = Deadline(timeout, timeout, f"sync.timeout_s={timeout:g}")
        self.pool.restart(i, Hung(f"rollout worker {i}", f"its load of weights version {version}",
                                  timeout, why, deadline).detail)

    def _wait_for_generation(self, sync: PendingSync) -> None:
        """Wait until the worker of `sync` has generated the batch queued before its load (a
        worker that dies meanwhile has answered; one that hangs is replaced); from then on the
        load can run, and its sync.timeout_s counts."""
        self.pool.wait_done([c for c in sync.after.calls if c.worker == sync.call.worker])
        sync.ready_since = time.monotonic()

    def _resync(self, worker) -> None:
        """Give a fresh worker the current weights and check it holds them (by version)."""
        if self.cfg.sync.transport == "cuda_ipc":  # a replacement may land on another GPU
            connect_cuda_ipc(self.learner, [worker])
        if self.step > 0:
            update = self.learner.export_weights(self.cfg.sync.transport, self.cfg.sync.shm_dir)
            ray.get(worker.load_weights.remote(update), timeout=self.cfg.sync.timeout_s)
        version = ray.get(worker.version.remote(), timeout=self.cfg.sync.timeout_s)
        if version != self.step:
            raise RuntimeError(f"re-synced worker holds version {version}, the learner {self.step}")

    def _maybe_evaluate(self) -> dict:
        every = self.cfg.eval_every
        if not self._another_step() or (every and self.step % every == 0):  # and at the end
            return self._evaluate(self.step)
        return {}

    def _evaluate(self, step: int) -> dict:
        """Evaluation with worker 0's current weights (version `step`): eval/<set>/accuracy
        (greedy pass@1), sampled_accuracy, truncated and mean_response_tokens per set
        (actors.evaluate.EvalReport.metrics)."""
        self._check_syncs()
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
            nonfinite_total=self.nonfinite_total, nonfinite_run=self.nonfinite_run, dropped_stale=self.dropped_stale,
            worker_restarts=self.pool.restarts if self.pool else 0, wandb_id=self.log.wandb_id,
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

    def _shutdown(self, raise_errors: bool = True) -> None:
        """Stop every part, each on its own: a part that fails (a log that cannot be closed)
        must not keep the others (workers, learner ranks, shm files) alive. Every failure is
        printed; once all parts have run, the first is raised (when `raise_errors`)."""
        parts = [(name, getattr(part, method)) for name, part, method in (
            ("metrics log", self.log, "close"), ("rollout workers", self.pool, "kill_all"),
            ("learner", self.learner, "shutdown")) if part is not None]
        parts.append(("published weights", lambda: remove_published(  # /dev/shm is RAM
            self.run_dir.name, self.cfg.sync.shm_dir)))
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
