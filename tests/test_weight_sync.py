"""Weight sync into a live vLLM engine in a Ray actor, for each transport that runs on CPU
(shm, object_store): after `publish` + `load_weights`, the engine's log-probs equal HF
transformers' log-probs of the learner's (perturbed) weights in fp32; versions are checked;
a sync that hangs raises within SyncConfig.timeout_s; lm_head.weight is required."""
from __future__ import annotations

import os
import time

import pytest
import torch
from installed import skip_without

ray = pytest.importorskip("ray")
skip_without("vllm")  # looked up, not imported (tests/installed.py)

# After the skips (actors.rollout_worker imports vLLM only when it starts an engine).
from actors.config import RolloutConfig, SyncConfig  # noqa: E402
from actors.rollout_worker import RolloutWorker, StaleWeightsError  # noqa: E402
from actors.weight_sync import (  # noqa: E402
    WeightPublisher,
    WeightUpdate,
    load_tensors,
    remove_published,
    run_dir,
)
from actors.weight_sync import transport as transport_named  # noqa: E402
from rewards.config import TaskConfig  # noqa: E402

TASK = TaskConfig(name="arithmetic", scorer_timeout_s=5.0, scorer_workers=1)
TIMEOUT_S = 5.0
TOL = 1e-4
# A GPU engine in fp32 against fp32 log-probs: 0.98-1.024 in pi/mu on an H100 (docs/gpu.md).
GPU_FP32_TOL = 0.05
RUN_ID = f"test-sync-{os.getpid()}"




@pytest.fixture(scope="module")
def shm_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("shm")  # the shm transport works on any local directory
    yield d
    remove_published(RUN_ID, d)


def _stop(w):
    try:
        ray.get(w.shutdown.remote(), timeout=60)
    finally:
        ray.kill(w)


@pytest.fixture(scope="module")
def worker(ray_cluster, tiny_model_dir, shm_dir):
    cfg = RolloutConfig(samples_per_prompt=3, max_new_tokens=8, max_model_len=128)
    sync = SyncConfig(transport="shm", timeout_s=TIMEOUT_S, shm_dir=str(shm_dir))
    w = ray.remote(RolloutWorker).options(num_cpus=1).remote(
        str(tiny_model_dir), cfg, sync, TASK, seed=0)
    yield w
    _stop(w)


@pytest.fixture(scope="module")
def problems():
    import rewards

    return rewards.get_task("arithmetic").problems("train", 4, seed=1)


def publisher(shm_dir, run_id: str = RUN_ID) -> WeightPublisher:
    """What a learner rank publishes through: the shm transport writes into shm_dir."""
    return WeightPublisher(run_id, SyncConfig(shm_dir=str(shm_dir)))


def load_hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def perturbed(model_dir, seed: int, scale: float = 0.05):
    """The model after a (fake) learner step: every parameter moved by seeded noise."""
    model = load_hf(model_dir)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * p.abs().mean() * torch.randn(p.shape, generator=g))
    return model


def max_logprob_error(model, batch) -> float:
    """Largest |behaviour log-prob - HF log-prob of `model`| over every response token."""
    worst = 0.0
    for r in batch.rollouts:
        ids = torch.tensor([r.prompt_ids + r.response_ids])
        with torch.no_grad():
            logits = model(ids).logits[0].float()
        p = len(r.prompt_ids)
        lp = logits[p - 1: p - 1 + len(r.response_ids)].log_softmax(-1)
        ref = lp.gather(1, torch.tensor(r.response_ids)[:, None])[:, 0]
        worst = max(worst, (ref - torch.tensor(r.behaviour_logprobs)).abs().max().item())
    return worst


def generate(worker, problems, seed=3):
    return ray.get(worker.generate.remote(problems, list(range(len(problems))), seed))


def test_publish_requires_lm_head(tiny_model_dir, shm_dir):
    state = load_hf(tiny_model_dir).state_dict()
    del state["lm_head.weight"]
    with pytest.raises(ValueError, match="lm_head.weight"):
        publisher(shm_dir).publish(state, 1, "shm")


@pytest.mark.parametrize("transport", ["shm", "object_store"])
def test_sync_makes_engine_logprobs_equal_learner_logprobs(
        transport, worker, problems, tiny_model_dir, shm_dir):
    version = {"shm": 1, "object_store": 2}[transport]
    held = ray.get(worker.version.remote())
    before = generate(worker, problems)
    assert before.policy_version == held

    learner = perturbed(tiny_model_dir, seed=version)
    update = publisher(shm_dir).publish(learner.state_dict(), version, transport)
    assert update.version == version and update.transport == transport
    fetched = transport_named(update.transport).fetch(update, time.monotonic() + 60)
    sent = load_tensors(fetched.source)
    assert sent.keys() == learner.state_dict().keys() and update.num_bytes > 0
    assert ray.get(worker.load_weights.remote(update)) == version
    assert ray.get(worker.version.remote()) == version

    after = generate(worker, problems)  # same prompts: a stale prefix cache would show here
    assert after.policy_version == version
    assert all(r.policy_version == version for r in after.rollouts)
    assert max_logprob_error(learner, after) < TOL
    # The engine really changed: its new log-probs are far from the old weights' ones.
    assert max_logprob_error(load_hf(tiny_model_dir), after) > 1e-2

    # An update older than what the worker holds is refused, and nothing changes.
    stale = publisher(shm_dir).publish(load_hf(tiny_model_dir).state_dict(), version - 1,
                                       transport)
    with pytest.raises(StaleWeightsError, match="refusing"):
        ray.get(worker.load_weights.remote(stale))
    assert ray.get(worker.version.remote()) == version
    assert max_logprob_error(learner, generate(worker, problems)) < TOL


def test_shm_keeps_only_the_newest_versions(tiny_model_dir, shm_dir):
    state = load_hf(tiny_model_dir).state_dict()
    for v in (10, 11, 12):
        publisher(shm_dir).publish(state, v, "shm")
    names = sorted(f.name for f in run_dir(RUN_ID, shm_dir).iterdir())
    assert names == ["v000000011.safetensors", "v000000012.safetensors"]


def test_a_load_that_leaves_lm_head_unloaded_is_refused_naming_it(
        worker, problems, tiny_model_dir, shm_dir):
    """Why publish insists on lm_head.weight: bypass it (write the file by hand) and vLLM
    keeps its old lm_head, saying so only in a warning below klrl's log level, so the
    log-probs would be silently wrong. The load raises instead, naming the parameter, and the
    engine generates nothing until a load reaches every parameter."""
    from safetensors.torch import save_file

    from actors.weight_sync.loads import WeightsNotLoaded

    v = ray.get(worker.version.remote()) + 1
    learner = perturbed(tiny_model_dir, seed=100 + v)
    state = {k: t.contiguous() for k, t in learner.state_dict().items() if k != "lm_head.weight"}
    path = shm_dir / "no_lm_head.safetensors"
    save_file(state, str(path))
    partial = WeightUpdate(v, "shm", path.stat().st_size, path=str(path))
    with pytest.raises(WeightsNotLoaded, match="1 parameters .* unloaded .*lm_head.weight"):
        ray.get(worker.load_weights.remote(partial))
    with pytest.raises(RuntimeError, match="WeightsNotLoaded"):
        generate(worker, problems)

    full = publisher(shm_dir).publish(learner.state_dict(), v, "shm")
    assert ray.get(worker.load_weights.remote(full)) == v
    assert max_logprob_error(learner, generate(worker, problems)) < TOL


def _timed_load(worker, update):
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        ray.get(worker.load_weights.remote(update))
    return time.monotonic() - t0


def test_sync_whose_file_never_appears_times_out(worker, problems, shm_dir):
    held = ray.get(worker.version.remote())
    never = WeightUpdate(held + 1, "shm", 0, path=str(shm_dir / "never.safetensors"))
    elapsed = _timed_load(worker, never)
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 10
    assert ray.get(worker.version.remote()) == held  # still usable, nothing changed
    generate(worker, problems)


def test_sync_whose_object_never_arrives_times_out(worker, problems):
    @ray.remote(num_cpus=0)
    def never_ready():
        time.sleep(3600)

    ref = never_ready.remote()
    held = ray.get(worker.version.remote())
    try:
        elapsed = _timed_load(worker, WeightUpdate(held + 1, "object_store", 0, ref=ref))
    finally:
        ray.cancel(ref, force=True)
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 10
    assert ray.get(worker.version.remote()) == held
    generate(worker, problems)


def test_reload_that_hangs_times_out_and_blocks_the_engine_until_a_good_load(
        worker, problems, tiny_model_dir, shm_dir):
    """The file exists but reading it blocks (a FIFO with no writer): the reload inside the
    engine hangs. load_weights raises within the timeout; the engine refuses to generate
    (its weights may be half-replaced) until a later load succeeds."""
    held = ray.get(worker.version.remote())
    fifo = shm_dir / "hangs.safetensors"
    os.mkfifo(fifo)
    elapsed = _timed_load(worker, WeightUpdate(held + 1, "shm", 0, path=str(fifo)))
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 10
    with pytest.raises(RuntimeError, match="did not finish"):
        generate(worker, problems)
    # Unblock the stuck reader (open for writing, close: it reads EOF and fails).
    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    learner = perturbed(tiny_model_dir, seed=999)
    good = publisher(shm_dir).publish(learner.state_dict(), held + 1, "shm")
    deadline = time.monotonic() + 30
    while True:  # the failed reload thread finishes shortly after the unblock
        try:
            assert ray.get(worker.load_weights.remote(good)) == held + 1
            break
        except RuntimeError as e:
            if "still running" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    assert max_logprob_error(learner, generate(worker, problems)) < TOL


def test_nccl_records_match_vllm_types():
    """CPU-checkable part of the nccl transport: what the sender hands the workers parses as
    the installed vLLM's own init/update info types, and the packing settings sit on whichever
    of the two carries them (the broadcast itself needs GPUs, below; both field layouts, the
    rendezvous and the refusals: tests/test_weight_sync_nccl.py)."""
    import dataclasses

    from vllm.distributed.weight_transfer.nccl_engine import (
        NCCLWeightTransferInitInfo,
        NCCLWeightTransferUpdateInfo,
    )

    from actors.weight_sync.nccl import NCCL_PACKING_FIELDS, NcclWeightSender

    sender = NcclWeightSender("10.0.0.1", 29555, num_workers=3, packed=True)
    info = NCCLWeightTransferInitInfo(**sender.worker_init_info(2))
    assert (info.rank_offset, info.world_size) == (3, 4)
    items = [("a.weight", torch.zeros(2, 3)),
             ("lm_head.weight", torch.ones(4, dtype=torch.bfloat16))]
    update = NCCLWeightTransferUpdateInfo(**sender.update_info(items))
    assert [getattr(torch, d) for d in update.dtype_names] == [torch.float32, torch.bfloat16]
    assert update.shapes == [[2, 3], [4]]
    init_fields = {f.name for f in dataclasses.fields(NCCLWeightTransferInitInfo)}
    on_init = init_fields >= set(NCCL_PACKING_FIELDS)
    carrier = info if on_init else update
    assert (carrier.packed, carrier.packed_buffer_size_bytes, carrier.packed_num_buffers) == (
        True, sender.buffer_size_bytes, sender.num_buffers)


def test_weight_publisher_is_what_the_learner_is_given(monkeypatch, tmp_path):
    """The transport cluster/ injects into the learner (learner/ may not import actors/): it
    pickles (Ray sends a copy to every rank), refuses nccl before the group is opened, and
    routes open / connect / publish to the nccl transport (a fake sender: no GPU here)."""
    import pickle

    from actors import weight_sync
    from actors.weight_sync import nccl

    calls = []

    class FakeSender:
        def __init__(self, host, port, num_workers, ranks_per_worker):
            calls.append(("init", host, port, num_workers, ranks_per_worker))

        def worker_init_info(self, i):
            return {"rank_offset": 1 + i}

        def connect(self):
            calls.append(("connect",))

        def send_async(self, items):
            calls.append(("send", [n for n, _ in items]))
            return nccl.nccl_update_info(items)

    monkeypatch.setattr(nccl, "NcclWeightSender", FakeSender)
    pub = pickle.loads(pickle.dumps(weight_sync.WeightPublisher(RUN_ID, SyncConfig(
        shm_dir=str(tmp_path)))))
    state = {"a.weight": torch.zeros(2), "lm_head.weight": torch.ones(3)}
    with pytest.raises(RuntimeError, match="NcclTransport.connect"):
        pub.publish(state, 1, "nccl")
    assert pub.open("nccl", 2, host="10.0.0.1", port=29555) == [{"rank_offset": 1},
                                                                {"rank_offset": 2}]
    pub.connect("nccl")
    update = pub.publish(state, 1, "nccl")
    assert update.transport == "nccl" and update.update_info["names"] == list(state)
    assert calls == [("init", "10.0.0.1", 29555, 2, 1), ("connect",), ("send", list(state))]
    shm = pub.publish(state, 2, "shm")
    assert shm.transport == "shm" and shm.path.startswith(str(run_dir(RUN_ID, tmp_path)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="nccl weight sync needs two CUDA GPUs (learner + worker)")
def test_nccl_sync_gpu(tiny_model_dir):
    """GPU only, not run on CPU machines: the learner end (an actor on one GPU) broadcasts
    through vLLM's NCCL weight-transfer group to a worker's engine on another GPU; neither
    end's communicator is disabled (both refuse one). The learner's weights are written on a
    stream kept busy for about half a second, and published at once: the broadcast must wait
    for them (without that it would send the weights from before the write)."""
    from actors.weight_sync.nccl import NcclWeightSender

    @ray.remote(num_gpus=1)
    class Learner:  # only names importable in the actor: it is pickled by value
        def __init__(self, model_dir, target):
            from transformers import AutoModelForCausalLM

            self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            self.model.cuda()
            self.target = {k: v.cuda() for k, v in target.items()}
            self.sender = NcclWeightSender("127.0.0.1", None, num_workers=1)  # port held
            self.publisher = WeightPublisher("gpu-test", SyncConfig(transport="nccl"))
            self.publisher.senders["nccl"] = self.sender

        def worker_init_info(self):
            return self.sender.worker_init_info(0)

        def connect(self):
            self.sender.connect()

        def write_then_publish(self, version):
            torch.cuda._sleep(1 << 30)  # the stream stays busy for a while
            with torch.no_grad():  # queued behind it, as an optimizer step's writes are
                for name, t in self.model.state_dict().items():
                    t.copy_(self.target[name], non_blocking=True)
            return self.publisher.publish(self.model.state_dict(), version, "nccl")

        def wait(self):
            self.sender.wait(timeout=60)

    started = ray.is_initialized()
    if not started:
        ray.init(include_dashboard=False, log_to_driver=False)
    target = perturbed(tiny_model_dir, seed=7, scale=0.3)  # far from the starting weights
    learner = Learner.remote(str(tiny_model_dir), target.state_dict())
    # float32 like the learner: vLLM's 'auto' would load this fp32 checkpoint as bf16.
    cfg = RolloutConfig(samples_per_prompt=3, max_new_tokens=8, max_model_len=128,
                        num_gpus_per_worker=1, gpu_memory_utilization=0.3, dtype="float32")
    w = ray.remote(RolloutWorker).options(num_gpus=1).remote(
        str(tiny_model_dir), cfg, SyncConfig(transport="nccl", timeout_s=120), TASK)
    try:
        joined = w.init_weight_transfer.remote(ray.get(learner.worker_init_info.remote()))
        ray.get([learner.connect.remote(), joined])
        update = ray.get(learner.write_then_publish.remote(1))
        assert ray.get(w.load_weights.remote(update)) == 1
        ray.get(learner.wait.remote())
        import rewards

        problems = rewards.get_task("arithmetic").problems("train", 4, seed=1)
        batch = generate(w, problems)
        # An fp32 engine on a GPU is within about 0.02 of fp32 log-probs (docs/gpu.md); the
        # starting weights are far from them (else the check could not fail).
        assert max_logprob_error(target, batch) < GPU_FP32_TOL
        assert max_logprob_error(load_hf(tiny_model_dir), batch) > GPU_FP32_TOL
    finally:
        ray.kill(w)
        ray.kill(learner)
        if not started:
            ray.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nccl_start_up_refuses_a_gpu_shared_with_the_learner_gpu(tiny_model_dir):
    """GPU only, not run on CPU machines: on a one-GPU machine a rollout worker's engine
    reports the UUID of the only GPU, which is the learner's too, and the start-up check of
    the nccl transport refuses the pair before NCCL would ("Duplicate GPU detected")."""
    from actors.weight_sync.nccl import check_nccl_devices

    if torch.cuda.device_count() != 1:
        pytest.skip("checks the one-GPU case")
    started = ray.is_initialized()
    if not started:
        ray.init(include_dashboard=False, log_to_driver=False)
    cfg = RolloutConfig(samples_per_prompt=2, max_new_tokens=4, max_model_len=128,
                        num_gpus_per_worker=0.5, gpu_memory_utilization=0.3)
    w = ray.remote(RolloutWorker).options(num_gpus=0.5).remote(
        str(tiny_model_dir), cfg, SyncConfig(transport="shm"), TASK)
    try:
        worker_uuids = ray.get(w.cuda_device_uuids.remote())
        learner_uuid = str(torch.cuda.get_device_properties(0).uuid)
        assert worker_uuids == [learner_uuid]
        with pytest.raises(RuntimeError, match="learner rank 0 and rollout worker 0"):
            check_nccl_devices(learner_uuid, [worker_uuids])
    finally:
        ray.kill(w)
        if not started:
            ray.shutdown()
