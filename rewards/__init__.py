"""Tasks (a prompt source plus a verifiable scorer) and fault-tolerant scoring.

Pure: imports the stdlib, pydantic, math-verify and (for hub/parquet datasets) `datasets`;
never Ray, vLLM or DeepSpeed.

Tasks
-----
    task = rewards.get_task("arithmetic")  # or "countdown", "counting", "math", "mmlu" (TASKS),
                                                    # or a plug-in "package.module:TaskClass"
    task = rewards.get_task("math", path="fixture")  # task-specific options: see each class
    problems = task.problems("in_domain", n=200, seed=0)   # list[Problem], deterministic
    reward = task.scorer(completion, problems[0])           # float

- arithmetic (`rewards.arithmetic`): "37-54=" -> "-17". Splits train / in_domain (two-digit,
  held out from train) / out_of_domain (three-digit).
- countdown (`rewards.countdown`): reach a target with + - * / over given numbers, each at
  most once; answers parsed by a safe evaluator (`rewards.expression`), never eval.
  Splits train / in_domain / out_of_domain (five numbers, targets 101-999), generated, or
  each from a dataset (options train/in_domain/out_of_domain).
- counting (`rewards.counting`): "7..11:" -> "7 8 9 10 11", long-tailed answer lengths (one
  number to 60 of them): the long-response task for packing and overlong shaping on CPU.
  Splits train / test, generated.
- math (`rewards.boxed_math`): MATH-style problems, the completion's last \\boxed{} checked
  with math-verify. Hub datasets by name (MATH train, MATH500) or local jsonl/json/parquet.
- mmlu (`rewards.mmlu`): multiple-choice evaluation (split out_of_domain), hub subjects or
  local files.

Datasets by name: every task with a dataset takes a hub name (loaded with `datasets`), a
local .jsonl/.json/.parquet file in its schema, or a mapping {name, config, split, columns};
`columns` renames another schema's columns to the task's. Defaults:
- math: train DigitalLearningGmbH/MATH-lighteval (split train), in_domain
  HuggingFaceH4/MATH-500 (split test); `path="fixture"`: the small set shipped in rewards/data.
- mmlu: cais/mmlu, split test, subjects high_school/college physics, chemistry and biology.
- countdown: generated unless a split is given a source; `true` names
  Jiayi-Pan/Countdown-Tasks-3to4 (split train; the TinyZero / TBA set: `target`, `nums`).
- arithmetic: generated only, no dataset.

Finite and generated splits: a dataset split is finite (`task.is_finite(split)`, known
without loading) and `task.rows(split)` lists its problems in file order; a generated split
is drawn at random without end. The training stream reads a finite split epoch by epoch
(cluster/train/prompts.py). Malformed dataset rows are skipped with one logged warning (count
and first error); the count is kept in `task.skipped_rows[split]`.

Plug-in scorers
---------------
A run's config may replace the task's scorer with `reward: "package.module:function"`:

    def my_scorer(completion: str, problem: rewards.Problem) -> float: ...

- `completion` is the generated text only (not the prompt); `problem` is the Problem it
  answers: `problem.prompt`, `problem.answer` (a string) and `problem.metadata` (the task's
  extra fields, e.g. countdown's numbers and target).
- Return a finite number (bool, int, float, numpy scalar); the reward of the rollout.
- It must be a module-level function importable in a fresh interpreter (scoring runs in
  worker processes, started with "spawn"), and should be deterministic and side-effect free.
- It runs under the scoring pool's per-item timeout (default 5 s) and address-space limit
  (default 1 GiB beyond the worker's own). If it raises, hangs, exceeds the memory limit,
  kills its process or returns None/NaN/inf/a non-number, the rollout gets reward 0.0 and the
  failure is counted (`ScoringPool.failure_counts`); training goes on.
`rewards.load_scorer(spec)` imports and checks one (a ValueError names the spec otherwise).

Scoring
-------
    with rewards.ScoringPool(workers=2, timeout_s=5.0, max_memory_mb=1024) as pool:
        results = pool.score(task.scorer, problems, completions)   # list[ScoreResult]
    results[0].reward, results[0].failure   # failure: None, "timeout", "exception",
                                            # "invalid_value", "memory" or "crash"
    pool.failure_counts                     # {"timeout": 3, ...} since the pool was made
`score` raises `ScoringPoolError` only when the pool's own processes or pipes fail.
"""
from rewards.plugin import load_scorer
from rewards.pool import ScoringPool, ScoringPoolError
from rewards.records import Problem, Scorer, ScoreResult, Task
from rewards.registry import TASKS, get_task

__all__ = [
    "TASKS",
    "Problem",
    "ScoreResult",
    "Scorer",
    "ScoringPool",
    "ScoringPoolError",
    "Task",
    "get_task",
    "load_scorer",
]
