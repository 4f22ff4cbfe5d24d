"""Engine overheads for `klrl bench`: klrl's actors against the raw engines they drive.

- Rollout: `RolloutWorker.generate` called through Ray (scoring, Rollout records and the Ray
  round trip included) against `vllm.LLM.generate` called directly in one fresh process, on
  the same prompts with the same SamplingParams (same seeds, so the very same tokens); and
  against the floor, the same requests in that process without log-probs (vLLM making the
  text, as for any user who wants no log-probs), timed in turn with the raw calls.
- Learner: `LearnerGroup.train_step` (batch sharding, Ray transfer, metrics merge included)
  against a bare DeepSpeed step in one fresh process: the same model, DeepSpeed config,
  optimizer, clipping and loss (`learner.loss.PolicyLoss`) on the same batch.

Each baseline runs in a subprocess with the thread count of the actor it is compared with, set
before torch is imported, kept between calls as a session (`python -m cluster.bench.engines
serve raw-vllm|bare-deepspeed SPEC`), so that its repetitions interleave with klrl's (raw,
klrl, then klrl, raw, ...) and a machine's drift reaches both alike; each waits idle while
the other runs. Each ratio comes with the range of the pairs' ratios. Every figure is the
median of `reps` timed repetitions after `warmup` untimed ones (WARMUP_REPS but in
`klrl bench --quick`).

On CUDA (`klrl bench --device cuda`) the baselines run on the machine's first GPU, the one the
actors share on a one-GPU machine: vLLM with the worker's engine settings (its memory share
included), DeepSpeed with the batch moved to the GPU in each step as the learner rank moves it,
and the step timed up to `torch.cuda.synchronize()`.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

WORKER_INDEX = 0  # cluster.train.worker_pool starts worker 0 first; its seeds are the ones replayed
# Untimed repetitions before the timed ones, in the baselines and through klrl alike (the
# default of BenchPlan.warmup_reps). A fresh
# process's first steps are slower (allocator and page-cache warm-up: a bare DeepSpeed step's
# first two repetitions), and a baseline still in them would make klrl look faster than its
# own baseline (docs/bench.md, "Fair baselines").
WARMUP_REPS = 2


@dataclass
class Overhead:
    """One engine measured raw and through klrl. tokens: tokens processed per repetition
    (rollout: generated response tokens; learner: prompt + response tokens trained on)."""

    name: str
    tokens: int
    raw_seconds: float        # median seconds per repetition, raw engine in one process
    klrl_seconds: float       # median seconds per repetition through the klrl actor
    engine_seconds: float     # the part of klrl_seconds the actor spent inside the engine
    reps: int
    # Rollout: median seconds per repetition of the raw engine without log-probs, scaled to
    # `tokens` (the floor); None for the learner.
    floor_seconds: float | None = None
    # Learner: the peak resident set (CPU) or peak allocated GPU memory, bytes, of the bare
    # DeepSpeed process and of klrl's rank 0 (memory is bounded by learner.token_budget, not
    # the batch); None for the rollout.
    raw_peak_bytes: int | None = None
    klrl_peak_bytes: int | None = None
    # The range of the interleaved pairs' ratios (klrl seconds / raw seconds of the same
    # repetition): the spread of the median `overhead_ratio`.
    ratio_min: float | None = None
    ratio_max: float | None = None

    @property
    def raw_tokens_per_s(self) -> float:
        return self.tokens / self.raw_seconds

    @property
    def klrl_tokens_per_s(self) -> float:
        return self.tokens / self.klrl_seconds

    @property
    def overhead_ratio(self) -> float:
        """Raw throughput / klrl throughput: 1.0 means klrl adds nothing."""
        return self.klrl_seconds / self.raw_seconds

    @property
    def floor_ratio(self) -> float | None:
        """Floor throughput / klrl throughput: what klrl's rollout costs against raw vLLM
        asked for no log-probs (1.0: the sampled tokens' log-probs and klrl are free)."""
        return None if self.floor_seconds is None else self.klrl_seconds / self.floor_seconds

    @property
    def outside_engine_ms(self) -> float:
        """Milliseconds per call outside the engine (rollout: building requests, converting
        outputs, scoring, the records' trip through Ray; learner: batching and the calls)."""
        return (self.klrl_seconds - self.engine_seconds) * 1e3

    def to_dict(self) -> dict[str, Any]:
        floor = {} if self.floor_seconds is None else {
            "floor_tokens_per_s": self.tokens / self.floor_seconds,
            "floor_ratio": self.floor_ratio}
        return asdict(self) | {"raw_tokens_per_s": self.raw_tokens_per_s,
                               "klrl_tokens_per_s": self.klrl_tokens_per_s,
                               "overhead_ratio": self.overhead_ratio,
                               "outside_engine_ms": self.outside_engine_ms} | floor


# --------------------------------------------------------------------------- rollout


def measure_rollout(worker, cfg, problems: list, reps: int,
                    warmup: int = WARMUP_REPS) -> tuple[Overhead, list]:
    """Rollout overhead of `worker` (a started RolloutWorker actor built from TrainConfig
    `cfg`) on `problems`; also returns the rollouts of the last repetition (the learner's
    batch). Repetition r uses seed r in both, so both generate the same tokens. The floor
    (raw vLLM without log-probs) is timed per token: asked for no log-probs, a GPU engine may
    take another sampling kernel and so other tokens."""
    import ray

    group_ids = list(range(len(problems)))
    spec = {"model_dir": str(cfg.model.path),
            "rollout": cfg.worker_rollout.model_dump(mode="json"), "seed": cfg.seed,
            "prompts": [p.prompt for p in problems], "stop": list(cfg.task.stop), "reps": reps,
            "warmup": warmup}
    raw: dict[str, list] = {"seconds": [], "tokens": [], "floor_seconds": [], "floor_tokens": []}
    klrl_s, engine_s, tokens, rollouts = [], [], [], []
    with _Session("raw-vllm", spec) as session:
        for r in range(warmup + reps):
            for who in (("raw", "klrl") if r % 2 == 0 else ("klrl", "raw")):
                if who == "raw":
                    got = session.call(f"rep {r}")
                    if r >= warmup:
                        for key, value in got.items():
                            raw[key].append(value)
                    continue
                t0 = time.perf_counter()
                batch = ray.get(worker.generate.remote(problems, group_ids, r))
                if r >= warmup:
                    klrl_s.append(time.perf_counter() - t0)
                    engine_s.append(batch.gen_seconds)
                    tokens.append(batch.num_response_tokens)
                rollouts = batch.rollouts
    raw_s = raw["seconds"]
    if tokens != raw["tokens"]:  # same seeds must give the same tokens, else not the same work
        # On a GPU, kernels may round differently in the two processes and flip a sample's
        # length: within 5% the raw time is scaled to the worker's tokens, per repetition.
        close = all(abs(k - r) <= 0.05 * k for k, r in zip(tokens, raw["tokens"]))
        if cfg.rollout.num_gpus_per_worker == 0 or not close:
            raise RuntimeError(f"raw vLLM generated {raw['tokens']} tokens, the worker {tokens}")
        print(f"[bench] note: raw vLLM generated {raw['tokens']} tokens, the worker {tokens}; "
              "raw times scaled to the worker's tokens", flush=True)
        raw_s = [s * k / r for s, k, r in zip(raw_s, tokens, raw["tokens"])]
    floor_s = [s * k / f for s, k, f in zip(raw["floor_seconds"], tokens, raw["floor_tokens"])]
    ratios = [k / r for k, r in zip(klrl_s, raw_s)]
    return Overhead("rollout", tokens[-1], statistics.median(raw_s),
                    statistics.median(klrl_s), statistics.median(engine_s), reps,
                    statistics.median(floor_s), ratio_min=min(ratios),
                    ratio_max=max(ratios)), rollouts


def _raw_vllm(spec: dict):
    """Baseline session: vLLM alone in this process, configured as RolloutWorker configures it
    (its engine settings, less the weight-reload extension klrl adds) and asked what the
    worker asks (`RolloutWorker._request_params`); and the floor, the same requests without
    log-probs. Each `rep R` times both, in alternating order."""
    from actors.config import RolloutConfig, SyncConfig

    cfg = RolloutConfig(**spec["rollout"])
    from actors.engine import make_llm, request_params, shutdown_llm
    from actors.outputs import decodes_texts_itself
    from actors.rollout_worker import configure_engine_process, engine_options

    configure_engine_process(cfg)  # what RolloutWorker does before its engine starts
    options = engine_options(cfg, SyncConfig(), spec["seed"])
    options.pop("worker_extension_cls")
    llm = make_llm(spec["model_dir"], **options)
    prompts, stop = spec["prompts"], spec["stop"]
    detokenize = not decodes_texts_itself(llm.get_tokenizer(), stop)

    def timed(r: int, floor: bool) -> tuple[float, int]:
        params = request_params(cfg, r, WORKER_INDEX, len(prompts), stop, detokenize=detokenize,
                                with_logprobs=not floor)
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return (time.perf_counter() - t0,
                sum(len(c.token_ids) for o in outputs for c in o.outputs))

    def rep(r: str) -> dict:
        """Repetition r (seed r): the raw requests and the floor's, in alternating order."""
        out = {}
        for floor in (int(r) % 2 == 1, int(r) % 2 == 0):
            seconds, tokens = timed(int(r), floor)
            out |= ({"floor_seconds": seconds, "floor_tokens": tokens} if floor
                    else {"seconds": seconds, "tokens": tokens})
        return out

    try:
        yield {"rep": rep}
    finally:
        shutdown_llm(llm)


# --------------------------------------------------------------------------- learner


def measure_learner(group, cfg, batch, reps: int, warmup: int = WARMUP_REPS) -> Overhead:
    """Learner overhead of `group` (a started LearnerGroup built from TrainConfig `cfg`) on
    `batch` (a TrainBatch). Each repetition is a real optimizer step in both, interleaved with
    the bare DeepSpeed process's (raw, klrl, then klrl, raw, ...), so that a machine's drift
    reaches both alike; the ratio is the median's, with the range of the pairs' ratios."""
    import torch

    with tempfile.TemporaryDirectory(prefix="klrl-bench-") as tmp:
        path = Path(tmp) / "batch.pt"
        torch.save({f: getattr(batch, f) for f in batch.__dataclass_fields__}, path)
        spec = {"model_dir": str(cfg.model.path),
                "learner": cfg.rank_learner.model_dump(mode="json"),
                "kl": cfg.kl.model_dump(mode="json"),
                "advantage": cfg.advantage.model_dump(mode="json"),
                "seed": cfg.seed, "batch": str(path)}
        raw_s, klrl_s, engine_s = [], [], []
        with _Session("bare-deepspeed", spec) as raw:
            for r in range(warmup + reps):
                pair: dict[str, float] = {}
                for who in (("raw", "klrl") if r % 2 == 0 else ("klrl", "raw")):
                    if who == "raw":
                        pair["raw"] = raw.call("step")["seconds"]
                        continue
                    t0 = time.perf_counter()
                    metrics = group.train_step(batch)
                    pair["klrl"] = time.perf_counter() - t0
                    # In DeepSpeed and torch: the optimizer steps and the reference forward.
                    pair["engine"] = metrics["time/learner_step"] + metrics["time/reference"]
                if r >= warmup:
                    raw_s.append(pair["raw"])
                    klrl_s.append(pair["klrl"])
                    engine_s.append(pair["engine"])
            raw_peak = raw.call("peak")["peak_bytes"]
    ratios = [k / r for k, r in zip(klrl_s, raw_s)]
    tokens = int(batch.attention_mask.sum())
    return Overhead("learner", tokens, statistics.median(raw_s),
                    statistics.median(klrl_s), statistics.median(engine_s), reps,
                    raw_peak_bytes=raw_peak,
                    klrl_peak_bytes=group.memory()[0][
                        "peak_gpu" if cfg.learner.device_kind == "cuda" else "peak_rss"],
                    ratio_min=min(ratios), ratio_max=max(ratios))


class _Session:
    """A baseline kept in a subprocess between calls, so that its repetitions interleave with
    klrl's: `python -m cluster.bench.engines serve KIND SPEC` reads one command a line on
    stdin and answers each with one JSON line behind REPLY (what the libraries print to
    stdout is skipped)."""

    def __init__(self, kind: str, spec: dict):
        self.kind, self.spec = kind, spec

    def __enter__(self) -> _Session:
        self._tmp = tempfile.TemporaryDirectory(prefix="klrl-bench-")
        spec_path = Path(self._tmp.name) / "spec.json"
        spec_path.write_text(json.dumps(self.spec))
        self._err = open(Path(self._tmp.name) / "stderr", "w+")  # noqa: SIM115 - closed in __exit__
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "cluster.bench.engines", "serve", self.kind, str(spec_path)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True)
        return self

    def call(self, command: str) -> dict:
        self._proc.stdin.write(command + "\n")
        self._proc.stdin.flush()
        for line in self._proc.stdout:
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY):])
        self._err.seek(0)
        raise RuntimeError(f"baseline {self.kind} ended ({self._proc.wait()}) during "
                           f"{command!r}:\n{self._err.read()[-4000:]}")

    def __exit__(self, *exc) -> None:
        try:
            if self._proc.poll() is None:
                self._proc.stdin.close()
                self._proc.wait(timeout=120)
        finally:
            if self._proc.poll() is None:
                self._proc.kill()
            self._err.close()
            self._tmp.cleanup()


REPLY = "KLRL-BENCH-REPLY "


def _bare_deepspeed(spec: dict):
    """Baseline session (a generator yielding its commands): one DeepSpeed engine in this
    process, single rank (gloo), configured as LearnerRank configures it, each `step` an
    optimizer step on the batch with the learner's loss in the learner's micro-batches
    (learner/micro_batches.py: the same forwards, packed or padded, under the same token
    budget); `peak` its peak memory."""
    from kl.config import AdvantageConfig, KLConfig
    from learner.config import LearnerConfig

    cfg = LearnerConfig(**spec["learner"])
    threads = cfg.threads
    os.environ.update({"OMP_NUM_THREADS": str(threads), "LOCAL_RANK": "0", "LOCAL_SIZE": "1"})
    import deepspeed
    import torch

    from learner import micro_batches
    from learner.batch import TrainBatch
    from learner.loading import ModelFiles, load_causal_lm
    from learner.loss import PolicyLoss
    from learner.process_group import host_store, init_process_group, remove_shm_buffers

    torch.set_num_threads(threads)
    cuda = cfg.device_kind == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    kl_cfg, adv_cfg = KLConfig(**spec["kl"]), AdvantageConfig(**spec["advantage"])
    store = host_store("127.0.0.1", 1)  # as a learner's rank 0 meets its group
    port = store.port
    init_process_group(cuda, 0, 1, "127.0.0.1", port, store)
    torch.manual_seed(spec["seed"])
    files = ModelFiles(spec["model_dir"])
    policy = load_causal_lm(files.policy, files, cfg).train()  # as LearnerRank loads both
    ref = load_causal_lm(files.reference_path, files, cfg).to(device)
    ref.eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr,
                                  betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                                  weight_decay=cfg.weight_decay)
    batch = TrainBatch(**torch.load(spec["batch"]))
    engine, *_ = deepspeed.initialize(model=policy, optimizer=optimizer,
                                      config=cfg.deepspeed_config(batch.num_sequences, 1))
    policy_loss = PolicyLoss(kl_cfg, adv_cfg, cfg)  # built once, as a LearnerRank builds it

    def step() -> dict:
        t0 = time.perf_counter()
        ref_logp = micro_batches.logprobs(ref, batch, cfg, device)
        micro_batches.accumulate(engine, batch, ref_logp, policy_loss, batch.num_sequences,
                                 lambda loss, _logp: engine.backward(loss), device)
        # as LearnerRank's optimizer does
        if not cfg.deepspeed_wraps_optimizer and cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.grad_clip)
        engine.step()
        if cuda:
            torch.cuda.synchronize()
        return {"seconds": time.perf_counter() - t0}

    try:
        yield {"step": step, "peak": lambda: {"peak_bytes": _peak_bytes(cuda)}}
    finally:
        remove_shm_buffers("127.0.0.1", port)  # DeepSpeed's CPU comm buffers outlive the process


def _peak_bytes(cuda: bool) -> int:
    """This process's peak memory: the GPU's peak allocation, or the peak resident set."""
    if cuda:
        import torch

        return int(torch.cuda.max_memory_allocated())
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# --------------------------------------------------------------------------- subprocesses

SESSIONS = {"raw-vllm": _raw_vllm, "bare-deepspeed": _bare_deepspeed}  # `_Session`s


def _serve(kind: str, spec: dict) -> None:
    """A session's subprocess: its commands by name, one a line on stdin, until stdin ends."""
    session = SESSIONS[kind](spec)
    commands = next(session)
    try:
        for line in sys.stdin:
            name, *args = line.split()
            print(REPLY + json.dumps(commands[name](*args)), flush=True)
    finally:
        session.close()


if __name__ == "__main__":
    _serve(sys.argv[2], json.loads(Path(sys.argv[3]).read_text()))  # serve KIND SPEC
