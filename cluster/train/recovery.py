"""The run's one way back: start, resume, the in-run learner restart and a worker's
replacement, each "go back to checkpoint k (or to the start), keep what the transport lets
outlive the failure, rebuild the rest", in one object the controller holds (`Recovery`).

- start: back to step 0; nothing kept; every part started, the step-0 evaluation logged.
- `--resume`: back to `resume_from` (its reference model checked); the run directory and its
  counters kept; every part started, each worker re-synced to the checkpoint's weights.
- learner restart: back to the newest complete checkpoint, or step 0; the metrics log kept
  (rewound), and the workers with their engines where the transport's
  `engines_outlive_the_learner` (shm, object_store: their calls settled, then rewound); the
  learner group started again, and the workers too where their engines cannot outlive it
  (nccl, cuda_ipc).
- worker replaced (WorkerPool.restart): at the current step; every other part kept; that
  worker started again and re-synced, or refused where the transport's `why_no_replacement`
  says so.

Each of the first three ends in `_go_back`: the learner loads the checkpoint (or holds the
starting weights), the schedule and counters return to it (the batches in flight are
generated again from `prompt_position`, same prompts, same seeds), and the workers are given
those weights (re-synced when fresh, rewound when kept). So the guarantees of resume hold for
every way back: bit-identical at max_lag 0, nothing skipped or trained twice above it
(docs/checkpoints.md); the exactness, resume and self-healing tests are its judges
(tests/test_resume.py, test_faults.py, test_worker_replacement.py).

The checkpoints the run goes back to are written here too (`checkpoint`, `checkpoint_for`):
what a way back reads is what a checkpoint holds.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from actors.weight_sync import transport
from cluster.config.loader import ConfigError
from cluster.train import checkpoint as ckpt
from cluster.train.learner_restarts import failure_line
from cluster.train.run_log import RunLog, keep_logs_through
from cluster.train.stopping import RunStopped
from cluster.train.weight_sync_state import WeightSyncState


class Recovery:
    """The controller's way back (module docstring). It reads and sets the controller's run
    state (step, data position, counters, parts); the controller keeps how parts start."""

    def __init__(self, controller):
        self.c = controller
        traits = transport(controller.cfg.sync.transport)
        # the transport's traits decide what a failure leaves standing
        self.workers_outlive_the_learner = traits.engines_outlive_the_learner
        self.why_no_worker_replacement = traits.why_no_replacement
        self._reference_sha256: str | None = None

    # ---------------------------------------------------------------- start and resume
    def start(self) -> dict:
        """Start the run, or resume it from `resume_from`; the step-0 evaluation of a fresh
        run ({} on a resume)."""
        c = self.c
        state = self._resume_state()
        c.log = RunLog(c.cfg, c.run_dir, resume_wandb_id=state and state.wandb_id,
                       rewind_to=state and state.step)
        c._start_parts()
        if state is None:
            first = c._evaluate(c.step)
            c.log.log({"step": 0, "policy_version": 0, **first})
            return first
        self._go_back(state, c.resume_from, workers_kept=False)
        c.pool.restarts = state.worker_restarts
        c.learner_restarts.count = state.learner_restarts
        c.learner_restarts.steps_lost = state.learner_steps_lost
        print(f"resumed {c.run_dir} at step {c.step} from {c.resume_from.name}")
        return {}

    def _resume_state(self) -> ckpt.ControllerState | None:
        """The checkpoint's controller state (after checking the reference model is the one
        it started from; train()'s preflight checked the config), and the metrics log cut
        back to the checkpoint's step: later rows (and hf/ exports) are redone."""
        c = self.c
        if c.resume_from is None:
            return None
        state = ckpt.read_checkpoint(c.resume_from)  # its config: checked by preflight
        if state.reference_sha256 != self.reference_sha256:
            raise ConfigError(f"cannot resume {c.resume_from}: the reference model's weights "
                              f"in {c.cfg.model.ref_path or c.model_dir} differ from the ones "
                              "the run started from")
        keep_logs_through(c.run_dir, state.step)
        ckpt.drop_hf_exports_after(c.run_dir, state.step)
        return state

    # ---------------------------------------------------------------- learner restart
    def restart_learner(self, failure: Exception) -> None:
        """The learner group broke (learner_restarts.heals): do in the run what `--resume`
        does after it, counting faults on; everything the steps decide goes back to the
        checkpoint, the workers kept where the transport lets their engines outlive the
        learner. LearnerRestartsExhausted when no restart is left."""
        c, t0 = self.c, time.perf_counter()
        checkpoint = ckpt.latest_checkpoint(c.run_dir)
        state = ckpt.read_checkpoint(checkpoint) if checkpoint is not None else None
        back_to = state.step if state is not None else 0
        why = failure_line(failure, c.learner)
        c.learner_restarts.take(why, c.step, back_to)
        lost_from, worker_restarts = c.step, c.pool.restarts
        keep = self.workers_outlive_the_learner
        print(f"{why}; restarting the learner", file=sys.stderr, flush=True)
        self.stop_parts(raise_errors=True, keep_log=True, keep_workers=keep)
        try:
            if keep:  # the old transport's files stay until the loads queued on them are done
                c.pool.settle([call for b in c.pending for call in b.calls]
                              + [load.call for load in c.weights.loads])
                c.weights.cleanup()
            c.pending.clear()
            c.last_batches = {}
            c.weights = WeightSyncState(c.cfg.sync, c.run_dir.name)
            c.log.rewind(back_to)
            ckpt.drop_hf_exports_after(c.run_dir, back_to)
            if keep:
                c._start_learner()
                c.weights.connect(c.learner, c.pool)
            else:
                c._start_parts()
                c.pool.restarts, c.reissued_logged = worker_restarts, 0
            self._go_back(state, checkpoint, workers_kept=keep)
        except RunStopped as stop:  # e.g. a worker hung in its (re)start: the new group does
            stop.write_checkpoint = False  # not hold the run's state; the last one is kept
            raise
        print(c.learner_restarts.describe(checkpoint.name if checkpoint else "step 0",
                                          lost_from, back_to, time.perf_counter() - t0,
                                          workers_kept=keep),
              file=sys.stderr, flush=True)

    # ---------------------------------------------------------------- what is kept
    def stop_parts(self, raise_errors: bool = True, keep_log: bool = False,
                   keep_workers: bool = False) -> None:
        """Stop every part (but the log when `keep_log`, and the workers with the weights
        published to them when `keep_workers`: a learner restart), each on its own: a part
        that fails (a log that cannot be closed) must not keep the others (workers, learner
        ranks, shm files) alive. Every failure is printed; once all parts have run, the first
        is raised (when `raise_errors`)."""
        c = self.c
        parts = [(name, getattr(part, method)) for name, part, method in (
            ("metrics log", None if keep_log else c.log, "close"),
            ("rollout workers", None if keep_workers else c.pool, "kill_all"),
            ("learner", c.learner, "shutdown")) if part is not None]
        if not keep_workers:
            parts.append(("published weights", c.weights.cleanup))  # shm: /dev/shm is RAM
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

    # ---------------------------------------------------------------- worker replacement
    def worker_replaced(self, worker) -> None:
        """A replaced worker (WorkerPool.restart) gets the weights of the moment."""
        self.c.weights.resync(worker)

    # ---------------------------------------------------------------- the way back
    def _go_back(self, state: ckpt.ControllerState | None, checkpoint: Path | None,
                 workers_kept: bool) -> None:
        """Put the new learner and the schedule where the complete `checkpoint` left them
        (None: where the run started, the new learner holding the starting weights), then the
        workers: kept ones load its weights over a later version, fresh ones are re-synced."""
        c = self.c
        if state is not None:
            c.step = c.learner.load_checkpoint(checkpoint, ckpt.LEARNER_TAG)
            assert c.step == state.step, \
                f"learner restored step {c.step}, controller {state.step}"
            c.prompts.position = state.prompt_position
            c.nonfinite_total, c.nonfinite_run = state.nonfinite_total, state.nonfinite_run
            c.dropped_stale = state.dropped_stale
            if c.episodes is not None:  # the failed share keeps counting across a resume
                c.episodes.restore(state.env_samples, state.env_failures)
        else:
            c.step, c.prompts.position, c.dropped_stale = 0, 0, 0
            c.nonfinite_total = c.nonfinite_run = 0
        if workers_kept:
            c.weights.rewind()
        elif state is not None:
            c.weights.resume()

    # ---------------------------------------------------------------- what it goes back to
    def checkpoint(self) -> Path:
        """Write a complete checkpoint of the run at the current step (atomic; see
        cluster/train/checkpoint.py). Invariant: every prompt before `prompt_position` was
        trained on by a step <= step, and none after it (batches in flight are replayed)."""
        c = self.c
        state = ckpt.ControllerState(
            step=c.step, prompt_position=c.trained_position,
            nonfinite_total=c.nonfinite_total, nonfinite_run=c.nonfinite_run,
            dropped_stale=c.dropped_stale, worker_restarts=c.pool.restarts if c.pool else 0,
            learner_restarts=c.learner_restarts.count,
            learner_steps_lost=c.learner_restarts.steps_lost, wandb_id=c.log.wandb_id,
            env_samples=c.episodes.samples if c.episodes else 0,
            env_failures=c.episodes.failures if c.episodes else 0,
            reference_sha256=self.reference_sha256, config=c.cfg.model_dump(mode="json"))
        return ckpt.write_checkpoint(c.run_dir, state, c.learner.save_checkpoint,
                                     keep=c.cfg.keep_checkpoints)

    def checkpoint_for(self, stop: RunStopped) -> None:
        """Give `stop` the checkpoint to resume from: a new one, or the last complete one when
        the learner cannot write one (it hung, now or while writing this one)."""
        stop.run_dir = self.c.run_dir
        if stop.write_checkpoint and self.c.learner is not None:
            try:
                stop.checkpoint = self.checkpoint()
                return
            except RunStopped as hung:  # the learner hung writing it: that is the news
                self.checkpoint_for(hung)
                raise hung from stop
        stop.checkpoint = ckpt.latest_checkpoint(self.c.run_dir)

    @property
    def reference_sha256(self) -> str:
        """The KL reference's identity (model.ref_path, else the policy's starting weights),
        checked on resume so a resumed run pulls toward the same reference."""
        if self._reference_sha256 is None:
            c = self.c
            self._reference_sha256 = ckpt.model_sha256(c.cfg.model.ref_path or c.model_dir)
        return self._reference_sha256
