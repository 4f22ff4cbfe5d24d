"""Serving the learner's LoRA adapter in a rollout worker's vLLM engine (`learner.lora`).

The engine is built with LoRA enabled (`engine_options`) on the base model, which it keeps.
Each weight update carries only the adapter (its tensors by shm or object_store, its
adapter_config.json in `WeightUpdate.adapter`); `AdapterSlot.load` writes it as a PEFT adapter
directory of its own (vLLM's LoRA loader reads adapter_config.json and
adapter_model.safetensors), registers it with the engine under a new LoRA id and drops the
previous one. Generation and evaluation then name it in every request (`request`); at version 0
there is none yet, and the base model is exactly the policy (the adapters' B starts at zero).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# The ranks vLLM can be built for (vllm.config.lora.MaxLoRARanks); an adapter may have any
# rank up to the engine's.
VLLM_MAX_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def engine_options(rank: int) -> dict[str, Any]:
    """vLLM engine options that serve one adapter of rank `rank`."""
    fits = [r for r in VLLM_MAX_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"LoRA rank {rank}: vLLM serves ranks up to {VLLM_MAX_RANKS[-1]}")
    return {"enable_lora": True, "max_lora_rank": fits[0], "max_loras": 1}


PREFIX = "klrl-lora-"  # then w<worker index>-p<pid>-<random>: whose directory it is
_OWNER = re.compile(rf"^{PREFIX}w\d+-p(\d+)-")


class AdapterSlot:
    """The adapter a worker serves: its request (None: the base model) and its directory.
    A worker that is killed (a hang, a crash, `ray.kill`) cannot remove its directory, so every
    new slot first removes those of worker processes on this node that are gone (`sweep`)."""

    def __init__(self, worker_index: int, parent: str | Path | None = None):
        sweep(Path(parent or tempfile.gettempdir()))
        self.root = Path(tempfile.mkdtemp(prefix=f"{PREFIX}w{worker_index}-p{os.getpid()}-",
                                          dir=parent))
        self.request = None

    def load(self, llm, version: int, source: str | bytes,
             config: Mapping[str, Any]) -> dict[str, float]:
        """Serve the adapter of policy `version` (source: the shm file or the safetensors
        bytes, as the transport's fetch gives them); returns the seconds spent writing it
        ("read") and loading it into the engine ("reload")."""
        from vllm.lora.request import LoRARequest

        t0 = time.perf_counter()
        directory = self.root / f"v{version}"
        directory.mkdir(exist_ok=True)
        target = directory / "adapter_model.safetensors"
        if isinstance(source, (bytes, bytearray, memoryview)):
            target.write_bytes(bytes(source))
        else:
            shutil.copyfile(source, target)  # the shm file is deleted two versions later
        (directory / "adapter_config.json").write_text(json.dumps(dict(config)))
        written = time.perf_counter()
        request = LoRARequest(f"klrl-v{version}", version + 1, str(directory))  # ids are >= 1
        previous, self.request = self.request, request
        if previous is not None and previous.lora_int_id == request.lora_int_id:
            llm.llm_engine.remove_lora(previous.lora_int_id)  # the same version again: reload
            previous = None
        llm.llm_engine.add_lora(request)
        if previous is not None:
            llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        return {"read": written - t0, "reload": time.perf_counter() - written}

    def engine(self, llm):
        """`llm` as generation and evaluation use it: every generate names the adapter."""
        return llm if self.request is None else _Serving(llm, self.request)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def serving(llm, adapter_dir: str | Path):
    """`llm` (built with `engine_options`) serving the PEFT adapter in `adapter_dir` in every
    generate call: how `klrl eval` evaluates a LoRA run's final/ or hf/step_N/."""
    from vllm.lora.request import LoRARequest

    return _Serving(llm, LoRARequest("klrl-eval", 1, str(adapter_dir)))


def sweep(parent: Path) -> list[Path]:
    """Remove the adapter directories under `parent` whose worker process is gone; returns
    them. Directories of live processes (this node's pids) stay."""
    gone = []
    for d in parent.glob(PREFIX + "*"):
        m = _OWNER.match(d.name)
        if m and d.is_dir() and not _alive(int(m.group(1))):
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d)
    return gone


def sweep_after_run(started: float, parent: Path | None = None, wait_s: float = 10.0) -> None:
    """At a LoRA run's end (the driver, cluster/train/run.py): its workers are killed
    (ray.kill), so none removed its directory, and the processes exit a moment after the kill
    returns; remove the directories made since `started` (time.time()) as their processes go,
    waiting at most `wait_s` (a directory of another live run on this node stays)."""
    parent = Path(parent or tempfile.gettempdir())
    deadline = time.monotonic() + wait_s
    while True:
        sweep(parent)
        left = [d for d in parent.glob(PREFIX + "*") if _made_since(d, started)]
        if not left or time.monotonic() > deadline:
            return
        time.sleep(0.2)


def _made_since(path: Path, started: float) -> bool:
    try:
        return path.stat().st_mtime >= started - 1.0
    except OSError:  # removed meanwhile
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


class _Serving:
    """An engine whose generate calls carry a LoRA request; everything else is the engine's."""

    def __init__(self, llm, request):
        self._llm, self._request = llm, request

    def generate(self, *args, **kwargs):
        return self._llm.generate(*args, lora_request=self._request, **kwargs)

    def __getattr__(self, name):
        return getattr(self._llm, name)
