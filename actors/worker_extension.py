"""The class klrl mixes into vLLM's worker: `LLM(..., worker_extension_cls=EXTENSION)`.

vLLM adds these methods to its worker class (the object that owns `model_runner`, in
vLLM's worker process, or in the engine's own process when it runs in-process), and
`llm.collective_rpc("klrl_reload_weights", args=(source,))` calls them on every worker of
the engine (every tensor-parallel rank). Only picklable/msgpack-able control data crosses
that boundary: a path or bytes, never tensors (they do not survive the serialisation).
"""
from __future__ import annotations

import time

from actors.weight_sync.loads import recorded_loads, refuse_unloaded, unloaded

EXTENSION = "actors.worker_extension.KlrlWorkerExtension"


class KlrlWorkerExtension:
    """The rollout worker's hands inside vLLM's worker: reloading safetensors weights in place
    (the shm and object_store transports, actors/weight_sync/), checking that a load reached
    every parameter, naming its CUDA device, and saying whether its NCCL weight-transfer group
    can move anything (the nccl transport)."""

    def klrl_reload_weights(self, source: str | bytes) -> dict[str, float]:
        """Replace the model's weights in place with the HF-named tensors in `source` (a
        safetensors path, or safetensors bytes); return how many tensors were loaded
        ("tensors") and the seconds spent reading them ("read") and loading them into the
        model ("reload": vLLM's copy into its parameters and its own processing after it,
        on CPU the repacking of each linear layer for oneDNN).

        Uses vLLM's layerwise in-place reload (`model_runner.reload_weights`), which maps
        checkpoint names to vLLM's fused parameters (qkv, gate_up) and shards them for
        tensor parallelism, exactly like loading a checkpoint from disk.
        """
        from vllm.config import set_current_vllm_config

        from actors.weight_sync import load_tensors

        t0 = time.perf_counter()
        tensors = load_tensors(source)
        t1 = time.perf_counter()
        with set_current_vllm_config(self.vllm_config), recorded_loads(self.model_runner) as calls:
            self.model_runner.reload_weights(weights_iterator=iter(tensors.items()))
        refuse_unloaded(unloaded(self.model_runner, self.vllm_config, calls), "the weight load")
        return {"tensors": len(tensors), "read": t1 - t0, "reload": time.perf_counter() - t1}

    def klrl_track_loads(self, start: bool) -> list[str] | None:
        """Around a load through vLLM's weight-transfer engine (cuda_ipc, nccl: their
        `update_weights` calls the model's `load_weights`): start=True records the loads,
        start=False stops and returns the parameters left unloaded (`unloaded`)."""
        if start:
            self._klrl_loads = recorded_loads(self.model_runner)
            self._klrl_calls = self._klrl_loads.__enter__()
            return None
        loads, self._klrl_loads = getattr(self, "_klrl_loads", None), None
        if loads is None:
            return ["(the loads were not being recorded)"]
        loads.__exit__(None, None, None)
        return unloaded(self.model_runner, self.vllm_config, self._klrl_calls)

    def klrl_cuda_device_uuid(self) -> str:
        """The UUID of the CUDA device this engine rank runs on (GPU only): the nccl transport
        compares it with the learner's (NCCL refuses two ranks on one GPU), and cuda_ipc needs
        it equal to the learner's (an IPC handle opens on its own GPU only)."""
        import torch

        return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)

    def klrl_nccl_group_disabled(self) -> bool:
        """Whether this engine rank's NCCL weight-transfer communicator is missing or disabled
        (vLLM's `PyNcclCommunicator.disabled`: set without a word where libnccl does not load,
        and then every broadcast is a no-op). The nccl transport refuses it after joining the
        group (`NcclTransport.init_engine`)."""
        engine = getattr(self, "weight_transfer_engine", None)
        group = getattr(engine, "model_update_group", None)
        return group is None or bool(group.disabled)
