"""The seed derivations' one home (actors/seeds.py): their values are pinned, because a run
resumed from a checkpoint written by another klrl version must get the same prompts and the
same sampling seeds; and the seeds a run uses are distinct where they must be."""
from actors.seeds import MAX_SEED, generate_seed, request_seed, stream_seed


def test_values_are_pinned():
    assert stream_seed(0, 5) == 5 and stream_seed(3, 7) == 3 * 1_000_003 + 7
    assert generate_seed(2, 64, 1) == 2 * 1_000_003 + 64 + 1
    assert [request_seed(0, 0, 0, 8), request_seed(1_000_035, 1, 3, 8),
            request_seed(7, 3, 0, 4)] == [1472471986, 1264844124, 890673322]


def test_the_seeds_of_a_run_are_distinct_and_fit_vllm():
    """Four workers, 8 prompts per step (2 per worker), 50 steps, 4 samples per prompt."""
    workers, per_step, n = 4, 8, 4
    calls = [(generate_seed(11, end, w), w) for end in range(per_step, 51 * per_step, per_step)
             for w in range(workers)]
    assert len({seed for seed, _ in calls}) == len(calls)
    requests = [request_seed(seed, w, i, n)
                for seed, w in calls for i in range(per_step // workers)]
    assert len(set(requests)) == len(requests)
    assert all(0 <= s and s + n - 1 < MAX_SEED for s in requests)  # vLLM adds j < n
    assert len({stream_seed(s, i) for s in range(3) for i in range(1000)}) == 3000
