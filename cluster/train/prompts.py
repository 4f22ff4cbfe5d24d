"""A deterministic, resumable stream of training prompts.

Problems are drawn in chunks: chunk c is `task.problems(split, n=CHUNK, seed=stream_seed(seed,
c))` (actors/seeds.py), so the stream is a pure function of (seed, position) and a resumed run continues with exactly the
prompts it would have seen. Group ids count prompts from the start of the run, so they are
unique across batches (a group = the n samples of one prompt).
"""
from __future__ import annotations

from actors.seeds import stream_seed

CHUNK = 4096


class PromptStream:
    def __init__(self, task_cfg, seed: int, position: int = 0):
        from rewards import get_task

        self.task = get_task(task_cfg.name, **task_cfg.options)
        self.split, self.seed = task_cfg.train_split, seed
        self.task.check_split(self.split)
        self.position = position  # prompts consumed so far (the data position of a checkpoint)
        self._chunk_index, self._chunk = -1, []

    def _chunk_for(self, index: int) -> list:
        if index != self._chunk_index:
            self._chunk = self.task.problems(self.split, n=CHUNK, seed=stream_seed(self.seed, index))
            if not self._chunk:
                raise ValueError(f"task split {self.split!r} yielded no problems")
            self._chunk_index = index
        return self._chunk

    def next_batch(self, k: int):
        """The next k problems and their group ids."""
        problems, group_ids = [], []
        # Every chunk has the size of chunk 0 (CHUNK, or the whole split if it is smaller).
        chunk_size = len(self._chunk_for(0)) if self._chunk_index < 0 else len(self._chunk)
        while len(problems) < k:
            index, offset = divmod(self.position, chunk_size)
            problems.append(self._chunk_for(index)[offset])
            group_ids.append(self.position)
            self.position += 1
        return problems, group_ids
