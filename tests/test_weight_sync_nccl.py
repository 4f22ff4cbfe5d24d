"""The parts of the nccl transport that need neither vLLM nor a GPU: where the packing
settings go for each of the two field layouts of vLLM's NCCL weight-transfer types (0.26: on
the update info; 0.32: on the init info), the call to vLLM's trainer_init for each of its two
signatures, and the refusal of a group with two members on one GPU (at start-up, from the
devices' UUIDs; the config-time check is in tests/test_configs.py).
tests/test_weight_sync.py checks the records against the installed vLLM's types."""
import pytest
import torch

from actors.weight_sync.nccl import (
    NCCL_PACKING_FIELDS,
    check_nccl_devices,
    nccl_packing_split,
    nccl_update_info,
    trainer_init_kwargs,
)

PACKING = {"packed": True, "packed_buffer_size_bytes": 1 << 20, "packed_num_buffers": 2}
RECORD = ("names", "dtype_names", "shapes")
RENDEZVOUS = ("master_address", "master_port", "rank_offset", "world_size")
# Field names of NCCLWeightTransferInitInfo / NCCLWeightTransferUpdateInfo in each version.
VLLM_026 = (RENDEZVOUS, RECORD + NCCL_PACKING_FIELDS)
VLLM_032 = (RENDEZVOUS + ("nccl_unique_id_b64",) + NCCL_PACKING_FIELDS, RECORD)


def test_packing_settings_go_on_the_update_info_for_vllm_026():
    init_extra, update_extra = nccl_packing_split(PACKING, *VLLM_026)
    assert init_extra == {} and update_extra == PACKING
    items = [("a.weight", torch.zeros(2, 3)),
             ("lm_head.weight", torch.ones(4, dtype=torch.bfloat16))]
    info = nccl_update_info(items, update_extra)
    assert set(info) == set(VLLM_026[1])  # exactly the 0.26 dataclass's fields
    assert info["dtype_names"] == ["float32", "bfloat16"] and info["shapes"] == [[2, 3], [4]]


def test_packing_settings_go_on_the_init_info_for_vllm_032():
    init_extra, update_extra = nccl_packing_split(PACKING, *VLLM_032)
    assert init_extra == PACKING and update_extra == {}
    assert set(nccl_update_info([("w", torch.zeros(1))], update_extra)) == set(RECORD)


def test_a_vllm_with_no_packing_fields_is_refused_naming_the_alternatives():
    with pytest.raises(RuntimeError, match="object_store"):
        nccl_packing_split(PACKING, RENDEZVOUS, RECORD)
    with pytest.raises(ValueError, match="exactly"):
        nccl_packing_split({"packed": True}, *VLLM_032)


def test_trainer_init_gets_rank_0_only_where_it_takes_a_rank():
    def trainer_init_026(init_info):  # the trainer is always rank 0
        return init_info

    def trainer_init_032(init_info, rank: int = 0):
        return init_info, rank

    assert trainer_init_kwargs(trainer_init_026) == {}
    assert trainer_init_kwargs(trainer_init_032) == {"rank": 0}
    trainer_init_026({}, **trainer_init_kwargs(trainer_init_026))  # accepted as called


def test_distinct_gpus_pass():
    check_nccl_devices("GPU-a", [["GPU-b"], ["GPU-c", "GPU-d"]])


@pytest.mark.parametrize("learner, workers, who", [
    ("GPU-a", [["GPU-b"], ["GPU-a"]], "learner rank 0 and rollout worker 1"),
    ("GPU-a", [["GPU-b"], ["GPU-b"]], "rollout worker 0 and rollout worker 1"),
])
def test_a_shared_gpu_is_refused_naming_the_alternatives(learner, workers, who):
    with pytest.raises(RuntimeError, match=who) as e:
        check_nccl_devices(learner, workers)
    assert "sync.transport: shm" in str(e.value) and "object_store" in str(e.value)
