"""Every seed klrl derives, in one place.

A run has one configured seed (`TrainConfig.seed`); evaluation has its own (`eval.seed`), so
that what is evaluated does not depend on the run. Everything random below them gets a seed
derived here, a pure function of (configured seed, position), which is what makes a resume
exact and a replayed generate call identical (docs/design.md):

    what                                                 its seed
    prompt chunk c of the training stream                stream_seed(run seed, c)
    the generate call of worker w for the batch whose
      prompts end at data position p                     generate_seed(run seed, p, w)
    prompt i of a generate call with seed s on worker w  request_seed(s, w, i, n)
      (n samples: vLLM seeds sample j with that + j)
    turn k > 0 of a multi-turn sample seeded s           turn_seed(s, k)
    evaluation problem i's samples                       stream_seed(eval seed, i)

Below these, `rewards.Task.problems(split, n, seed)` seeds its own random stream from (task,
split, seed), and the learner seeds torch with the run seed itself. The values are those klrl
has always produced (tests/test_seeds.py pins them): a checkpoint written by an earlier version
resumes with the same prompts and sampling seeds.
"""
from __future__ import annotations

import hashlib

# Stride between the streams of consecutive seeds: stream_seed(s, i) for i < STRIDE never
# equals one of seed s + 1.
STRIDE = 1_000_003
MAX_SEED = 2**31 - 1  # vLLM's (and numpy's) seeds are 32-bit


def stream_seed(seed: int, index: int) -> int:
    """The seed of item `index` of the stream that `seed` seeds (a prompt chunk, an
    evaluation problem)."""
    return seed * STRIDE + index


def generate_seed(seed: int, position: int, worker: int) -> int:
    """The seed of worker `worker`'s generate call for the batch whose prompts end at data
    position `position` (the prompts consumed so far). Each of a batch's workers gets its
    own; batches are at least as many prompts apart as there are workers, so no two calls
    of a run share one."""
    return stream_seed(seed, position) + worker


def request_seed(seed: int, worker_index: int, i: int, n: int) -> int:
    """The seed of prompt i of a generate call with seed `seed` on worker `worker_index`,
    sampled n times: distinct streams across calls, workers and prompts, hashed so that
    neighbouring call seeds do not give overlapping streams, and below MAX_SEED - n because
    vLLM seeds sample j of a request with seed + j."""
    digest = hashlib.blake2b(f"{seed}:{worker_index}:{i}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (MAX_SEED - n)


def turn_seed(sample_seed: int, turn: int) -> int:
    """The seed of turn `turn` of a multi-turn sample whose first turn is seeded `sample_seed`
    (actors/multi_turn.py): the sample's own seed for turn 0, as a single-turn sample is
    seeded; later turns hashed from (sample seed, turn), below MAX_SEED."""
    if turn == 0:
        return sample_seed
    digest = hashlib.blake2b(f"turn:{sample_seed}:{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % MAX_SEED
