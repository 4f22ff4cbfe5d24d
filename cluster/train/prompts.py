"""A deterministic, resumable stream of training prompts: the task's train split read as the
`data:` section (DataConfig) says.

The stream is a sequence of blocks of one size B; the prompt at data position p is item
p mod B of block p // B:
- a finite split (a dataset, `Task.is_finite`): block e is epoch e, every row of the split
  once, in a permutation seeded by stream_seed(seed, e) (actors/seeds.py) when data.shuffle,
  else in file order. With data.epochs = E the stream ends at position E x B.
- a generated split (arithmetic, countdown's generator): block c is
  `task.problems(split, n=CHUNK, seed=stream_seed(seed, c))`, seeded draws, without end.
So the prompt at every position is a pure function of (seed, position): a resumed run
continues with exactly the prompts it would have seen.

data.max_prompt_length: a prompt whose token ids, rendered as the rollout workers render them
(actors/prompting.py), are longer is skipped (neither generated nor trained on) and counted.
Positions count every prompt of the stream, skipped ones included, so the count before a
position (`filtered_before`) is a pure function of it too, and an epoch serves every prompt
that fits exactly once. A batch may straddle two epochs; with data.epochs the stream ends when
fewer than a batch of fitting prompts remain (those few are not trained on).

Group ids are the positions of the prompts served: unique over the run (a group = the n
samples of one prompt).
"""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path

from actors.seeds import stream_seed
from cluster.config.loader import ConfigError
from cluster.config.sections import DataConfig
from cluster.config.train_config import TrainConfig

CHUNK = 4096           # problems per block of a generated split
_CACHED_BLOCKS = 3     # a batch in training, batches in flight and a peek span at most three

PromptLength = Callable[..., int]
"""Problem -> the length in tokens of its prompt as the rollout workers render it."""


class DataExhausted(RuntimeError):
    """data.epochs are used up: the stream has not one more batch."""


@dataclass
class _Block:
    problems: list             # in stream order
    too_long: list[bool]       # parallel to problems
    filtered_prefix: list[int]  # [i]: how many of the first i problems are too long


class PromptStream:
    def __init__(self, task_cfg, seed: int, position: int = 0, data: DataConfig | None = None,
                 prompt_length: PromptLength | None = None):
        from rewards import get_task

        self.task = get_task(task_cfg.name, **task_cfg.options)
        self.split, self.seed = task_cfg.train_split, seed
        self.task.check_split(self.split)
        self.position = position  # prompts consumed so far, skipped ones included
        self.data = data if data is not None else DataConfig()
        self.limit = self.data.max_prompt_length
        if self.limit is not None and prompt_length is None:
            raise ValueError("data.max_prompt_length needs prompt_length (the rendered length)")
        self._length = prompt_length
        self._blocks: dict[int, _Block] = {}
        self._filtered_in: dict[int, int] = {}  # block -> too-long prompts in it
        self._peeked: tuple[tuple[int, int], list[int] | None] | None = None
        self.finite = self.task.is_finite(self.split)
        if self.finite:
            self._rows = self.task.rows(self.split)
            self._row_too_long = self._too_long(self._rows)
            self.block_size = len(self._rows)
            self.fitting_per_epoch = self.block_size - sum(self._row_too_long)
            if self.fitting_per_epoch == 0:
                raise ConfigError(f"data.max_prompt_length={self.limit}: every one of the "
                                  f"{self.block_size} prompts of {self._where()} is longer; "
                                  "raise it (or null: no limit)")
        else:
            self.block_size = len(self._block(0).problems)
        if not self.block_size:
            raise ValueError(f"task split {self.split!r} yielded no problems")
        epochs = self.data.epochs if self.finite else None
        self.end = epochs * self.block_size if epochs is not None else None  # position limit

    @classmethod
    def for_run(cls, cfg: TrainConfig, model_dir: str | Path) -> PromptStream:
        """The stream of a run, with the policy's tokenizer when prompts are length-filtered;
        ConfigError when its epochs do not hold one batch."""
        length = (rendered_length(cfg, model_dir) if cfg.data.max_prompt_length is not None
                  else None)
        stream = cls(cfg.task, cfg.seed, data=cfg.data, prompt_length=length)
        k = cfg.rollout.prompts_per_step
        if stream.max_steps(k) == 0:
            raise ConfigError(
                f"data.epochs={cfg.data.epochs} x {stream.fitting_per_epoch} prompts of "
                f"{stream._where()} (those that fit) is less than one batch "
                f"(rollout.prompts_per_step={k}); raise data.epochs or lower prompts_per_step")
        return stream

    def next_batch(self, k: int) -> tuple[list, list[int]]:
        """The next k problems that fit, and their group ids (positions). DataExhausted when
        data.epochs end first (nothing is consumed then)."""
        found = self._scan(k)
        if found is None:
            raise DataExhausted(f"data.epochs={self.data.epochs} of {self._where()} are used up")
        problems = [self._block(p // self.block_size).problems[p % self.block_size] for p in found]
        self.position = found[-1] + 1
        return problems, found

    def has_batch(self, k: int) -> bool:
        """Whether next_batch(k) would give a batch (always, unless data.epochs end)."""
        return self._scan(k) is not None

    def max_steps(self, k: int) -> int | None:
        """Batches of k the whole stream holds: data.epochs x the prompts that fit, divided by
        k; None without an end."""
        if self.end is None:
            return None
        return self.data.epochs * self.fitting_per_epoch // k

    def filtered_before(self, position: int) -> int:
        """Prompts skipped as too long among the stream's first `position`."""
        if self.limit is None:
            return 0
        block, offset = divmod(position, self.block_size)
        if self.finite:  # every epoch is a permutation of the same rows
            earlier = block * (self.block_size - self.fitting_per_epoch)
        else:
            earlier = sum(self._filtered_count(c) for c in range(block))
        return earlier + self._block(block).filtered_prefix[offset]

    def metrics(self, position: int) -> dict:
        """The stream's metrics once every prompt before `position` is trained on:
        data/prompts_filtered (cumulative; with max_prompt_length) and data/epoch (epochs
        gone through, fractional; finite splits)."""
        out = {}
        if self.limit is not None:
            out["data/prompts_filtered"] = self.filtered_before(position)
        if self.finite:
            out["data/epoch"] = position / self.block_size
        return out

    # ---------------------------------------------------------------- blocks
    def _scan(self, k: int) -> list[int] | None:
        """Positions of the next k prompts that fit, from self.position; None when the
        stream ends first. Remembered, so has_batch then next_batch scan once."""
        key = (self.position, k)
        if self._peeked is not None and self._peeked[0] == key:
            return self._peeked[1]
        found: list[int] | None = []
        position = self.position
        while len(found) < k:
            if self.end is not None and position >= self.end:
                found = None
                break
            block, offset = divmod(position, self.block_size)
            if not self._block(block).too_long[offset]:
                found.append(position)
            position += 1
        self._peeked = (key, found)
        return found

    def _block(self, index: int) -> _Block:
        block = self._blocks.get(index)
        if block is None:
            problems, too_long = self._make_block(index)
            block = _Block(problems, too_long, [0, *accumulate(too_long)])
            if len(self._blocks) >= _CACHED_BLOCKS:
                del self._blocks[min(self._blocks)]
            self._blocks[index] = block
            self._filtered_in[index] = block.filtered_prefix[-1]
        return block

    def _make_block(self, index: int) -> tuple[list, list[bool]]:
        if self.finite:
            order = list(range(len(self._rows)))
            if self.data.shuffle:
                random.Random(stream_seed(self.seed, index)).shuffle(order)
            return [self._rows[i] for i in order], [self._row_too_long[i] for i in order]
        problems = self.task.problems(self.split, n=CHUNK, seed=stream_seed(self.seed, index))
        too_long = self._too_long(problems)
        if problems and all(too_long):  # a generated split never ends: fail, do not spin
            raise ConfigError(f"data.max_prompt_length={self.limit}: none of {len(problems)} "
                              f"prompts drawn from {self._where()} fits; raise it (or null: "
                              "no limit)")
        return problems, too_long

    def _filtered_count(self, index: int) -> int:
        if index not in self._filtered_in:
            self._block(index)
        return self._filtered_in[index]

    def _too_long(self, problems: list) -> list[bool]:
        if self.limit is None:
            return [False] * len(problems)
        return [self._length(p) > self.limit for p in problems]

    def _where(self) -> str:
        return f"task {self.task.name!r} split {self.split!r}"


def rendered_length(cfg: TrainConfig, model_dir: str | Path) -> PromptLength:
    """Problem -> the length in tokens of its prompt as a rollout worker renders it: the
    policy's tokenizer (loaded here, in the controller) with the task's chat template and
    system prompt (actors.prompting)."""
    from actors.prompting import PromptRenderer
    from cluster.train.batching import policy_tokenizer

    tokenizer = policy_tokenizer(model_dir, cfg.model)
    renderer = PromptRenderer.for_task(tokenizer, cfg.task)
    return lambda problem: len(renderer.token_ids(problem.prompt))
