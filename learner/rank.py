"""One data-parallel learner rank: a DeepSpeed engine on the policy and a frozen reference copy.

`LearnerRank` is a plain class; learner/group.py runs `num_ranks` of them as Ray actors and
drives them in lockstep (every method that touches the engine is collective: all ranks call
it, or a collective inside it hangs).

Gradient scaling. DeepSpeed averages gradients over the W ranks. Rank r computes
`PolicyLoss(...)(..., num_sequences_global=N)` on its shard, i.e. (sum over its sequences) / N,
and backpropagates W times that, so the average over ranks is (sum over all N sequences) / N: the
gradient of the global-batch loss, exactly as one rank would compute it on the whole batch.
Micro-batches of a shard (learner/micro_batches.py: a token budget or a row count, padded or
packed) all use the same N, so their gradients add up to the shard's; the group statistics
their losses need are computed over whole groups first (learner.loss.GroupStats), and the
ranks agree on how many forward passes they make (`_agree`; ZeRO-3 gathers in each).
With learner.mini_batches = M, everything above holds per global mini-batch of N / M sequences.

Non-finite refusal. An optimizer step is refused (weights, optimizer moments and LR schedule
untouched, `nonfinite: 1` reported for that update) iff the global gradient norm is NaN/inf. A rank
whose loss is non-finite backpropagates NaN on purpose, so its NaN reaches the global norm
through the gradient reduction and every rank refuses the same step (a rank-local decision
would let the ranks' weights diverge). Who checks: with ZeRO (or bf16) DeepSpeed's optimizer
finds the invalid global norm and skips the step; on the plain fp32 path (stage 0) DeepSpeed
checks nothing, so `_GuardedAdamW` computes the (already all-reduced) global norm, refuses,
and clips itself. After `engine.step()` we assert that DeepSpeed applied the step iff it was
finite.
"""
from __future__ import annotations

import gc
import math
import os
import time
from typing import Any

import torch

from kl.config import AdvantageConfig, KLConfig
from learner import lora, micro_batches
from learner.batch import TrainBatch
from learner.config import LearnerConfig
from learner.export import WeightExporter, WeightPublisher, full_weights
from learner.files import write_adapter_dir, write_model
from learner.loading import ModelFiles, load_causal_lm
from learner.loss import PolicyLoss
from learner.loss_metrics import merge_metrics
from learner.process_group import host_store, init_process_group, remove_shm_buffers
from learner.schedule import make_scheduler


class _GuardedAdamW(torch.optim.AdamW):
    """AdamW that refuses a non-finite step and clips by the global norm (`clip` > 0).

    Only for DeepSpeed's plain path (stage 0, fp32), where `engine.step()` all-reduces the
    gradients before calling `step()`, so every rank sees the same norm and makes the same
    decision. DeepSpeed reads `overflow`: True makes it skip the LR scheduler step, count a
    skipped step and report `was_step_applied() == False`.
    """

    def __init__(self, params, *, clip: float, **kw):
        super().__init__(params, **kw)
        self.clip = clip
        self.overflow = False
        self.grad_norm: float | None = None

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0) if grads else torch.zeros(())
        self.grad_norm = float(norm)
        self.overflow = not math.isfinite(self.grad_norm)
        if self.overflow:
            return None
        if self.clip > 0:
            params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
            torch.nn.utils.clip_grads_with_norm_(params, self.clip, norm)
        return super().step(closure)


class LearnerRank:
    """Data-parallel rank `rank` of `world_size`: owns its DeepSpeed engine on the policy, the
    frozen reference, the optimizer and the policy version; weights out go through its
    `WeightExporter`. Construct, then call `setup` on all ranks.
    `model`: the policy's directory, or a ModelFiles (reference, revision, remote code).
    `publisher` sends the weights out (`export_weights`, learner/export.py); None: this
    learner cannot export.
    `total_optimizer_steps`: the run's optimizer steps, which a decaying lr_schedule needs."""

    def __init__(self, rank: int, world_size: int, model: str | ModelFiles,
                 learner_cfg: LearnerConfig, kl_cfg: KLConfig, adv_cfg: AdvantageConfig,
                 seed: int, publisher: WeightPublisher | None = None,
                 total_optimizer_steps: int | None = None):
        self.rank, self.world_size = rank, world_size
        self.files = ModelFiles.of(model)
        self.total_optimizer_steps = total_optimizer_steps
        self.cfg, self.kl_cfg, self.adv_cfg = learner_cfg, kl_cfg, adv_cfg
        self.loss = PolicyLoss(kl_cfg, adv_cfg, learner_cfg)  # built and checked once
        self.seed = seed
        self.exporter = WeightExporter(publisher, rank, learner_cfg)  # weights out for a sync
        self.engine = self.ref = self.optimizer = None
        # rank 0's rendezvous store (host_rendezvous), kept for the group's life
        self._store = None
        # The policy version of these weights: rollout batches trained with at least one applied
        # optimizer step (one batch = learner.epochs x learner.mini_batches optimizer steps).
        self.version = 0
        self._progress_at = time.monotonic()  # when this rank last did a unit of work (health)
        # Ray sets OMP_NUM_THREADS from num_cpus; the run's thread rule may give more
        # (LearnerConfig.threads), and torch's intra-op pool needs telling either way.
        torch.set_num_threads(learner_cfg.threads)

    # ------------------------------------------------------------------ start-up

    def node_info(self) -> dict[str, Any]:
        """Where this rank runs: the group picks the rendezvous address from it."""
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(),
                "ip": ray.util.get_node_ip_address()}

    def host_rendezvous(self, host: str, collective_timeout_s: float | None = None) -> int:
        """Rank 0: host the process group's store on `host`, at a port the OS picks and this
        rank holds from now on (learner/process_group.py says why); returns the port."""
        self._store = host_store(host, self.world_size, collective_timeout_s)
        return self._store.port

    def health(self) -> float:
        """Seconds since this rank last made progress (a micro-batch, an optimizer step, the
        start of a train step). The group calls it on a thread of its own while another call
        runs: a frozen rank does not answer, one stuck in a collective answers an ever larger
        number (cluster/train/deadlines.py decides what is hung)."""
        return time.monotonic() - self._progress_at

    def _progress(self) -> None:
        self._progress_at = time.monotonic()

    def release_shm(self) -> int:
        """Delete the shared-memory all-reduce buffers DeepSpeed's CPU comm op created for this
        process group. They live in /dev/shm (RAM) and outlive the process: they would
        otherwise pile up run after run. Returns how many files were removed."""
        rendezvous = getattr(self, "_rendezvous", None)
        return 0 if rendezvous is None else remove_shm_buffers(*rendezvous)

    def setup(self, master_addr: str, master_port: int, local_rank: int, local_size: int,
              collective_timeout_s: float | None = None) -> dict:
        """Join the process group (`init_process_group`), load policy + reference, build the
        DeepSpeed engine.

        With Python's cyclic garbage collector off, and everything it made frozen out of the
        collector's reach afterwards: it walked the growing heap again and again while
        DeepSpeed, transformers and the models loaded, and would walk it all again at every
        later full collection. What is frozen lives as long as this process does (a rank
        serves one run and is stopped with it)."""
        enabled = gc.isenabled()
        gc.disable()
        try:
            return self._setup(master_addr, master_port, local_rank, local_size,
                               collective_timeout_s)
        finally:
            gc.freeze()
            if enabled:
                gc.enable()

    def _setup(self, master_addr: str, master_port: int, local_rank: int, local_size: int,
               collective_timeout_s: float | None) -> dict:
        import deepspeed

        cuda = self.cfg.device_kind == "cuda"
        os.environ.update({
            # On GPU Ray gives each actor its own CUDA_VISIBLE_DEVICES, so the device is cuda:0.
            "LOCAL_RANK": "0" if cuda else str(local_rank), "LOCAL_SIZE": str(local_size),
        })
        init_process_group(cuda, self.rank, self.world_size, master_addr, master_port,
                           self._store, collective_timeout_s)
        self._rendezvous = (master_addr, master_port)
        torch.manual_seed(self.seed)
        self.device = (torch.device("cuda", torch.cuda.current_device()) if cuda
                       else torch.device("cpu"))

        cfg = self.cfg
        policy = load_causal_lm(self.files.policy, self.files, cfg)
        if cfg.gradient_checkpointing:
            # Non-reentrant checkpointing: it needs no input that requires grad and recomputes
            # each layer's forward exactly, so the gradients are those without it.
            policy.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        if cfg.lora is not None:  # the base frozen; only the adapters train (learner/lora.py)
            policy = lora.wrap(policy, cfg.lora)
        policy.train()
        num_parameters = sum(p.numel() for p in policy.parameters())  # before ZeRO-3 partitions
        trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
        if cfg.lora is not None and self.files.reference is None:
            self.ref = None  # the reference is the policy's base: its adapters switched off
        else:
            ref = load_causal_lm(self.files.reference_path, self.files, cfg)
            self.ref = ref.to(self.device).eval().requires_grad_(False)

        params = [p for p in policy.parameters() if p.requires_grad]
        adam = {"lr": cfg.lr, "betas": (cfg.adam_beta1, cfg.adam_beta2), "eps": cfg.adam_eps,
                "weight_decay": cfg.weight_decay}
        self.optimizer = _make_optimizer(params, cfg, adam)
        # The LR schedule is a torch LambdaLR, so DeepSpeed checkpoints its state (last_epoch)
        # with the engine and a resumed run continues it exactly (learner/schedule.py).
        self.engine, _, _, _ = deepspeed.initialize(
            model=policy, optimizer=self.optimizer,
            lr_scheduler=make_scheduler(cfg, self.total_optimizer_steps),
            config=cfg.deepspeed_config(cfg.micro_batch_size, self.world_size))
        # Invariant relied on by the non-finite refusal (module docstring): DeepSpeed uses our
        # optimizer unwrapped exactly when it does not check and clip itself.
        assert (self.engine.optimizer is self.optimizer) == (not cfg.deepspeed_wraps_optimizer), \
            f"unexpected DeepSpeed optimizer wrapping: {type(self.engine.optimizer).__name__}"
        return {"rank": self.rank, "parameters": num_parameters, "trainable_parameters": trainable,
                "optimizer": type(self.engine.optimizer).__name__,
                # What transformers actually runs (its default when attn_implementation is null).
                "attn_implementation": [m.config._attn_implementation
                                        for m in (policy, self.ref or policy)],
                "gradient_checkpointing": policy.is_gradient_checkpointing,
                # The threads and OpenMP wait policy this process really got (group.omp_env).
                "threads": torch.get_num_threads(),
                "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}

    # ------------------------------------------------------------------ training

    def train_step(self, shard: TrainBatch, num_sequences_global: int) -> list[dict[str, float]]:
        """`learner.epochs` x `learner.mini_batches` optimizer steps on this rank's shard
        (collective: every rank calls it with an equal-sized shard). Returns this rank's
        metrics of each update, in order; group.py merges them over ranks and updates.

        Mini-batch m of every rank is the m-th cut of its shard into whole prompt groups, so
        the ranks' m-th mini-batches together are a global mini-batch of N / mini_batches
        sequences, and each update's loss is normalised by that constant. The reference
        log-probs are computed once for all updates (the reference never changes)."""
        cfg = self.cfg
        self._progress()
        t0 = time.perf_counter()
        ref_logp = self._reference_logprobs(shard)
        ref_s = time.perf_counter() - t0
        per_mini = num_sequences_global / cfg.mini_batches
        minis = [shard.shard_indices(m, cfg.mini_batches) for m in range(cfg.mini_batches)]
        updates = []
        for _ in range(cfg.epochs):
            for index in minis:
                mini = shard.select(index)
                updates.append(self._update(mini, ref_logp[index, :mini.width], per_mini))
        for k, u in enumerate(updates):  # once per batch: the first update carries it
            u["time/reference"] = ref_s if k == 0 else 0.0
        if any(not u["nonfinite"] for u in updates):
            self.version += 1
        return updates

    def _update(self, mini: TrainBatch, ref_logp: torch.Tensor, num_sequences: float) -> dict:
        """One optimizer step on `mini` (whole prompt groups), accumulated over micro-batches
        (learner/micro_batches.py: how they are cut and laid out)."""
        t0 = time.perf_counter()

        def backward(loss: torch.Tensor, logp: torch.Tensor) -> None:
            if torch.isfinite(loss):
                # DeepSpeed averages over ranks (module docstring)
                self.engine.backward(loss * self.world_size)
            else:
                # Poison this rank's gradients so the global norm is NaN on every rank.
                self.engine.backward(logp.sum() * float("nan"))

        parts = micro_batches.accumulate(self.engine, mini, ref_logp, self.loss, num_sequences,
                                         backward, self.device, self._progress, self._agree)
        lr = self.optimizer.param_groups[0]["lr"]
        self.engine.step()
        self._progress()
        applied = self.engine.was_step_applied()
        if self.cfg.deepspeed_wraps_optimizer:
            norm = self.engine.get_global_grad_norm()
            norm = float(norm) if norm is not None else float("nan")
        else:
            norm = self.optimizer.grad_norm
        finite = math.isfinite(norm)
        assert applied == finite, f"DeepSpeed step applied={applied} but grad norm {norm}"
        out = merge_metrics(parts)
        out.update({"nonfinite": float(not applied), "grad/norm": norm, "lr": lr,
                    "time/learner_step": time.perf_counter() - t0})
        return out

    def _reference_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """[B, L] log-probs under the reference: its own model, or with LoRA and no separate
        reference the policy's base (the same forward with the adapters off)."""
        if self.ref is not None:
            return self._logprobs(self.ref, batch)
        with self.engine.module.disable_adapter():
            return self._logprobs(self.engine, batch)

    def _logprobs(self, model, batch: TrainBatch) -> torch.Tensor:
        """[B, L] log-probs of `batch` under `model` (no grad), micro-batch by micro-batch."""
        return micro_batches.logprobs(model, batch, self.cfg, self.device, self._progress,
                                      self._agree)

    def _agree(self, values: list[int]) -> list[int]:
        """The element-wise maximum of `values` over the ranks (collective), so that every
        rank makes as many forward passes as the one with most (micro_batches.plan)."""
        if self.world_size == 1:
            return values
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.long, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [int(v) for v in t.tolist()]

    # ------------------------------------------------------------------ weights out

    def named_parameters_for_inference(self, device: str = "cpu",
                                       copy: bool = True) -> dict[str, torch.Tensor]:
        """Full HF-named weights on `device` (learner.export.full_weights; collective under
        ZeRO-3), `lm_head.weight` included even when tied to the embeddings."""
        return full_weights(self.engine.module, self.cfg.zero_stage == 3, device, copy)

    def export_weights(self, version: int, transport: str):
        """Publish the current weights as `version` through `transport` (collective; rank 0
        returns the WeightUpdate, the other ranks None): learner/export.py."""
        assert version == self.version, \
            f"exporting version {version} but rank {self.rank} holds {self.version}"
        return self.exporter.export(self.engine.module, self.device, version, transport)

    def open_weight_transfer(self, transport: str, num_workers: int,
                             ranks_per_worker: int = 1) -> list[dict]:
        """Rank 0, GPU only: open the transport's group (nccl: the trainer end of vLLM's
        NCCL weight-transfer group); returns each rollout worker's init info. Not exercised
        by the CPU test-suite."""
        return self.exporter.open(transport, num_workers, ranks_per_worker)

    def connect_weight_transfer(self, transport: str) -> None:
        """Rank 0: join the group `open_weight_transfer` opened (blocks until every worker
        has joined)."""
        self.exporter.connect(transport)

    def cuda_device_uuid(self) -> str:
        """GPU only: the UUID of this rank's CUDA device (the nccl transport refuses to put
        rank 0 on a GPU a rollout worker uses; cuda_ipc requires it to be theirs)."""
        return str(torch.cuda.get_device_properties(self.device).uuid)

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds, for `klrl bench`: its policy's parameters (all, and those it
        trains), the separate reference (0 when LoRA's base is the reference), the optimizer
        state (Adam's moments exist from the first step on), the process's peak resident
        set so far (the OS's count: libraries, activations and copies included) and on a GPU
        its peak allocation (0 on CPU)."""
        import resource

        params = list(self.engine.module.parameters())
        return {"weights": _nbytes(params),
                "trainable": _nbytes(p for p in params if p.requires_grad),
                "reference": 0 if self.ref is None else _nbytes(self.ref.parameters()),
                "optimizer_state": _nbytes(t for state in self.optimizer.state.values()
                                           for t in state.values() if torch.is_tensor(t)),
                "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "peak_gpu": (int(torch.cuda.max_memory_allocated(self.device))
                             if self.device.type == "cuda" else 0)}

    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        """The adapters' CPU copies under their adapter-file names (collective under ZeRO-3)."""
        return lora.adapter_tensors(self.engine.module, gather=self.cfg.zero_stage == 3)

    def save_hf(self, out_dir: str) -> str | None:
        """Write the policy in Hugging Face format (config, generation config, tokenizer,
        safetensors), loadable by transformers and vLLM. With LoRA: the adapter (PEFT's files,
        for the base model) and, with lora.save_merged, the merged model in merged/.
        Collective; rank 0 writes (learner/files.py)."""
        spec = self.cfg.lora
        if spec is None:
            weights = self.named_parameters_for_inference()
            if self.rank != 0:
                return None
            return write_model(self.engine.module, weights, out_dir, self.files)
        tensors = self.adapter_tensors()
        full = self.named_parameters_for_inference() if spec.save_merged else None
        if self.rank != 0:
            return None
        return write_adapter_dir(self.engine.module, tensors, full, spec.scaling, out_dir,
                                 self.files)

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, directory: str, tag: str, client_state: dict | None = None) -> None:
        """DeepSpeed checkpoint (weights, optimizer moments, LR scheduler). Collective; every
        rank writes its own shards, so `directory` must be shared by the ranks' nodes."""
        # The RNG state too: LoRA dropout samples, and a resumed run must not silently diverge
        # the day something else (subsampling) does.
        state = dict(client_state or {}, version=self.version, torch_rng=torch.get_rng_state())
        # With LoRA the frozen base is the model the run started from: only the adapters (and
        # their optimizer state) are saved.
        self.engine.save_checkpoint(str(directory), tag=tag, client_state=state,
                                    exclude_frozen_parameters=self.cfg.lora is not None)

    def load_checkpoint(self, directory: str, tag: str) -> dict:
        path, state = self.engine.load_checkpoint(str(directory), tag=tag,
                                                  load_optimizer_states=True,
                                                  load_lr_scheduler_states=True,
                                                  load_module_strict=self.cfg.lora is None)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint {tag!r} under {directory}")
        self.version = int(state["version"])
        torch.set_rng_state(state["torch_rng"])
        return {"version": self.version}


def _make_optimizer(params, cfg: LearnerConfig, adam: dict) -> torch.optim.Optimizer:
    """The torch optimizer DeepSpeed is handed. With offload_optimizer (GPU-only) DeepSpeed
    refuses any client optimizer but its own CPU Adam (engine._configure_optimizer raises
    unless zero_force_ds_cpu_optimizer is false, which runs torch's AdamW slowly on the CPU):
    DeepSpeedCPUAdam in AdamW mode (decoupled weight decay, bias correction: torch AdamW's
    update), JIT-compiled by DeepSpeed on first use (a C++ compiler on the node), or
    prebuilt with DS_BUILD_CPU_ADAM=1. Otherwise plain AdamW where DeepSpeed wraps it (it
    then checks and clips); ours where it does not."""
    if cfg.offload_optimizer:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, adamw_mode=True, **adam)
    if cfg.deepspeed_wraps_optimizer:
        return torch.optim.AdamW(params, **adam)
    return _GuardedAdamW(params, clip=cfg.grad_clip, **adam)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
