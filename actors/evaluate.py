"""Evaluation through vLLM: greedy pass@1 and sampled accuracy per split.

Used by the trainer (`evaluate_sets`, on the rollout engine it already has) and by
`klrl eval MODEL_DIR` (`evaluate`). For each split, the same `n` problems (fixed by `seed`,
so successive evaluations of a run, and runs with different training seeds, are comparable)
are answered

- greedily (temperature 0): `greedy_accuracy` is the mean reward, i.e. pass@1 for 0/1 tasks;
- by sampling `samples` completions, by default at temperature 1 without top-k/top-p (the
  policy itself, as RL samples it): `sampled_accuracy` is the mean reward over all
  n * samples completions.

Prompts are rendered by an `actors.prompting.PromptRenderer` (chat template, system prompt,
stop strings) and sent as token ids, exactly as training sends them. Every completion has
the same budget, `max_tokens`; `truncated` counts those it cut (finish_reason "length").

Rewards come from the task's scorer, run through `rewards.ScoringPool` (process pool with
timeouts) when that exists. A scorer failure counts as reward 0 and is reported in
`failures`, never raised. With a plug-in scorer (`reward`, a run's `task.reward`) every
completion is scored by it as well: `greedy_reward` and `sampled_reward` are its means, beside
the task scorer's accuracies, which stay accuracy (a shaped or partial-credit reward is not
one), so both what the run optimises and what it solves are measured on the same completions.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, Field, computed_field

from actors.engine import greedy_params, make_llm, sample_params, shutdown_llm
from actors.prompting import PromptRenderer
from actors.seeds import stream_seed
from rewards.config import EvalConfig, TaskConfig
from rewards.pass_at_k import default_ks, mean_pass_at_k

DEFAULT_SPLITS = ("in_domain", "out_of_domain")  # `klrl eval`'s splits when none are named
CHUNK = 128  # prompts per vLLM call: the granularity of the progress bar


class Completion(BaseModel):
    """One completion of an evaluation, as scored."""

    text: str
    reward: float = Field(description="the task scorer's reward (0 when scoring failed)")
    plugin_reward: float | None = Field(None, description="the plug-in scorer's, if any")
    finish_reason: str = Field(description="stop (EOS or a stop string) or length (the budget)")


class ProblemRecord(BaseModel):
    """One problem of an evaluation and its completions (`evaluate(keep_completions=True)`)."""

    uid: str
    prompt: str = Field(description="the problem's prompt text, before the chat template")
    answer: str
    greedy: Completion
    samples: list[Completion] = Field(default_factory=list)


class SplitResult(BaseModel):
    """Accuracy of one split."""

    split: str
    problems: int = Field(description="number of problems evaluated")
    greedy_accuracy: float = Field(description="mean reward of greedy completions (pass@1)")
    samples: int = Field(description="completions sampled per problem")
    sampled_accuracy: float | None = Field(
        description="mean reward over all sampled completions (None when samples == 0)"
    )
    pass_at_k: float | None = Field(
        default=None, description="share of problems with at least one sample scoring > 0"
    )
    pass_at: dict[int, float] = Field(default_factory=dict, description="k -> unbiased "
                                      "pass@k over the problems (eval.pass_k; "
                                      "rewards/pass_at_k.py)")
    failures: int = Field(0, description="completions whose scoring failed (scored 0)")
    greedy_reward: float | None = Field(None, description="mean plug-in reward (`reward`) of "
                                        "the greedy completions (None without one)")
    sampled_reward: float | None = Field(None, description="mean plug-in reward of the sampled "
                                         "completions (None without one, or samples == 0)")
    reward_failures: int = Field(0, description="completions whose plug-in scoring failed")
    completions: int = Field(0, description="completions generated: problems x (1 + samples)")
    truncated: int = Field(0, description="completions that hit max_tokens before EOS")
    mean_response_tokens: float = Field(0.0, description="mean completion length, all completions")
    mean_prompt_tokens: float = Field(0.0, description="mean rendered prompt length in tokens")
    problem_ids: list[str] = Field(default_factory=list, description="uids of the problems "
                                   "evaluated, in order")
    records: list[ProblemRecord] | None = Field(None, description="each problem with its "
                                                "completions (keep_completions=True)")

    @computed_field
    @property
    def truncated_fraction(self) -> float:
        """truncated / completions: the share of completions the budget cut."""
        return self.truncated / self.completions if self.completions else 0.0


class EvalResult(BaseModel):
    """Result of `evaluate`: one `SplitResult` per split, in the order asked."""

    task: str
    model: str | None = None
    reward: str | None = Field(None, description="the plug-in scorer of greedy_reward and "
                               "sampled_reward ('package.module:function'), if any")
    seed: int
    max_tokens: int = Field(description="completion budget of every completion")
    splits: dict[str, SplitResult]
    seconds: float


def evaluate(
    llm_or_model: Any,
    task: Any = "arithmetic",
    splits: Sequence[str] = DEFAULT_SPLITS,
    *,
    n: int = 200,
    samples: int = 4,
    seed: int = 0,
    max_tokens: int | None = None,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    renderer: PromptRenderer | None = None,
    progress: bool = True,
    scoring_pool: Any = None,
    reward: str | None = None,
    keep_completions: bool = False,
    pass_k: Sequence[int] | None = None,
    dtype: str | None = None,
) -> EvalResult:
    """Evaluate a policy on `splits` of `task`.

    llm_or_model: a `vllm.LLM`, or a model directory (an engine is built with
        `actors.engine.make_llm`, of `dtype` (None: its default), and shut down afterwards).
    task: a task name for `rewards.get_task` or a task object (`.problems(split, n, seed)`,
        `.scorer(completion, problem)`).
    n: problems per split; samples: sampled completions per problem (0: greedy only).
    seed: fixes the problems and the sampling.
    max_tokens: completion budget; default `task.max_new_tokens` if the task has it, else 32.
    temperature, top_p, top_k: the sampler of the sampled completions (top_k <= 0: off).
    renderer: prompts to token ids, and stop strings; default the engine's tokenizer with
        its chat template if it has one (`PromptRenderer(chat_template="auto")`).
    scoring_pool: a `rewards.ScoringPool` to reuse; by default one is made for this call.
    reward: a plug-in scorer 'package.module:function' (as task.reward) that scores every
        completion too (greedy_reward, sampled_reward); accuracy stays the task scorer's.
    keep_completions: each split's `records` hold every problem with its completions.
    pass_k: the k of each split's unbiased pass@k (`pass_at`), each at most `samples`; None:
        1, 2, 4, ... up to `samples`, and `samples` (rewards.pass_at_k.default_ks).
    """
    ks = list(pass_k) if pass_k is not None else default_ks(samples)
    if any(not 1 <= k <= samples for k in ks):
        raise ValueError(f"pass_k {ks}: each k is between 1 and samples ({samples})")
    task_obj = _get_task(task)
    task_name = getattr(task_obj, "name", task if isinstance(task, str) else type(task).__name__)
    max_tokens = max_tokens or int(getattr(task_obj, "max_new_tokens", 32))
    owns_llm = not hasattr(llm_or_model, "generate")
    model_name = str(llm_or_model) if owns_llm else _llm_model_name(llm_or_model)
    t0 = time.perf_counter()
    llm = make_llm(llm_or_model, seed=seed, dtype=dtype) if owns_llm else llm_or_model
    try:
        if renderer is None:
            renderer = PromptRenderer(llm.get_tokenizer())
        sampler = {"temperature": temperature, "top_p": top_p, "top_k": top_k}
        plugin = _load_plugin(reward)
        with _Scorer(task_obj, scoring_pool, plugin) as scorer, _progress(progress) as bar:
            results = {
                split: _evaluate_split(
                    llm, task_obj, split, n=n, samples=samples, seed=seed, sampler=sampler,
                    max_tokens=max_tokens, renderer=renderer, scorer=scorer, bar=bar,
                    keep=keep_completions, ks=ks,
                )
                for split in splits
            }
    finally:
        if owns_llm:
            shutdown_llm(llm)
    return EvalResult(
        task=str(task_name),
        model=model_name,
        reward=reward,
        seed=seed,
        max_tokens=max_tokens,
        splits=results,
        seconds=round(time.perf_counter() - t0, 2),
    )


class EvalReport(BaseModel):
    """What the trainer's evaluation (`evaluate_sets`, `RolloutWorker.evaluate`) returns:
    one `SplitResult` per configured evaluation set, by set name."""

    sets: dict[str, SplitResult]
    seed: int = Field(description="eval.seed: fixed the problems and the sampling seeds")
    max_tokens: int = Field(description="completion budget of every completion")
    seconds: float

    def metrics(self) -> dict[str, float]:
        """The trainer's logged metrics: eval/<set>/accuracy (greedy pass@1),
        eval/<set>/sampled_accuracy (when sampling), eval/<set>/truncated (fraction of
        completions cut by the budget) and eval/<set>/mean_response_tokens; with a plug-in
        scorer eval/<set>/reward and eval/<set>/sampled_reward (its mean rewards)."""
        out: dict[str, float] = {}
        for name, r in self.sets.items():
            out[f"eval/{name}/accuracy"] = r.greedy_accuracy
            if r.sampled_accuracy is not None:
                out[f"eval/{name}/sampled_accuracy"] = r.sampled_accuracy
            for k, value in r.pass_at.items():
                out[f"eval/{name}/pass@{k}"] = value
            if r.greedy_reward is not None:
                out[f"eval/{name}/reward"] = r.greedy_reward
            if r.sampled_reward is not None:
                out[f"eval/{name}/sampled_reward"] = r.sampled_reward
            out[f"eval/{name}/truncated"] = r.truncated_fraction
            out[f"eval/{name}/mean_response_tokens"] = r.mean_response_tokens
        return out


def evaluate_sets(llm: Any, cfg: EvalConfig, training: TaskConfig, *, default_max_tokens: int,
                  renderer: PromptRenderer, scoring_pool: Any = None,
                  whole_when_smaller: bool = False) -> EvalReport:
    """The trainer's evaluation: every set of `cfg` (sets without a task are the training
    task's), `cfg.num_problems` problems each, chosen by `cfg.seed` alone.

    default_max_tokens: the budget when cfg.max_new_tokens is null (the rollout budget).
    renderer: the training prompts' renderer, so that evaluation prompts are rendered alike.
    A set of the training task (same task and options) is scored by `training.reward` too,
    when the run has one: a plug-in written for the training task's problems.
    whole_when_smaller: a set whose split holds fewer distinct problems than cfg.num_problems
    (`Task.distinct_problems`) is evaluated whole instead of refused (the final evaluation's
    rule: the same complete set in every run); each set's `problems` says how many it had.
    """
    import rewards

    t0 = time.perf_counter()
    budget = cfg.max_new_tokens or default_max_tokens
    sets = {}
    for name, s in cfg.sets(training).items():
        own_task = (s.task, s.options) == (training.name, dict(training.options))
        task = rewards.get_task(s.task, **s.options)
        result = evaluate(llm, task, [s.split],
                          n=problems_of(task, s.split, cfg.num_problems, whole_when_smaller),
                          samples=cfg.samples, seed=cfg.seed,
                          max_tokens=budget, temperature=cfg.temperature, top_p=cfg.top_p,
                          top_k=cfg.top_k, renderer=renderer, progress=False,
                          scoring_pool=scoring_pool, reward=training.reward if own_task else None,
                          pass_k=cfg.ks())
        sets[name] = result.splits[s.split]
    return EvalReport(sets=sets, seed=cfg.seed, max_tokens=budget,
                      seconds=round(time.perf_counter() - t0, 2))


def problems_of(task, split: str, asked: int, whole_when_smaller: bool) -> int:
    """How many problems of `split` an evaluation asking `asked` takes: `asked`, or with
    `whole_when_smaller` all of a split known to hold fewer (`Task.distinct_problems`)."""
    size = task.distinct_problems(split) if whole_when_smaller else None
    return asked if size is None else min(asked, size)


def _evaluate_split(llm, task, split, *, n, samples, seed, sampler, max_tokens, renderer,
                    scorer, bar, keep=False, ks: Sequence[int] = ()) -> SplitResult:
    problems = list(task.problems(split, n, seed))
    prompts = renderer.prompts(problems)  # rendered once, for the greedy and sampled passes
    stop = renderer.stop
    greedy = _generate(llm, prompts, [greedy_params(max_tokens, stop=stop)] * len(prompts), bar,
                       f"{split}: greedy")
    greedy_texts = [c[0].text for c in greedy]
    greedy_rewards, greedy_fail = scorer(greedy_texts, problems)
    all_outputs = [c[0] for c in greedy]
    failures = greedy_fail
    plugin = scorer.plugin(greedy_texts, problems)  # (rewards, failures) or None
    greedy_reward, reward_fail = (_mean(plugin[0]), plugin[1]) if plugin else (None, 0)

    sampled_acc = pass_k = sampled_reward = None
    pass_at: dict[int, float] = {}
    sampled, rewards, sampled_plugin = [[] for _ in problems], [], None
    if samples > 0:
        # One seed per problem: reproducible, and independent streams across problems.
        params = [
            sample_params(max_tokens, n=samples, seed=stream_seed(seed, i), logprobs=None,
                          stop=stop, **sampler)
            for i in range(len(prompts))
        ]
        sampled = _generate(llm, prompts, params, bar, f"{split}: {samples} samples")
        texts = [c.text for comps in sampled for c in comps]
        owners = [p for p, comps in zip(problems, sampled) for _ in comps]
        rewards, fail = scorer(texts, owners)
        failures += fail
        all_outputs += [c for comps in sampled for c in comps]
        sampled_acc = _mean(rewards)
        per_problem = [rewards[i * samples : (i + 1) * samples] for i in range(len(problems))]
        pass_k = _mean([float(any(r > 0 for r in rs)) for rs in per_problem])
        pass_at = {k: mean_pass_at_k(per_problem, k) for k in ks}
        if sampled_plugin := scorer.plugin(texts, owners):
            sampled_reward, reward_fail = _mean(sampled_plugin[0]), reward_fail + sampled_plugin[1]

    truncated = sum(c.finish_reason == "length" for c in all_outputs)
    return SplitResult(
        split=split,
        problems=len(problems),
        greedy_accuracy=_mean(greedy_rewards),
        samples=samples,
        sampled_accuracy=sampled_acc,
        pass_at_k=pass_k,
        pass_at=pass_at,
        failures=failures,
        greedy_reward=greedy_reward,
        sampled_reward=sampled_reward,
        reward_failures=reward_fail,
        completions=len(all_outputs),
        truncated=truncated,
        mean_response_tokens=_mean([len(c.token_ids) for c in all_outputs]),
        mean_prompt_tokens=_mean([len(p["prompt_token_ids"]) for p in prompts]),
        problem_ids=[p.uid for p in problems],
        records=_records(problems, greedy, greedy_rewards, plugin, sampled, rewards,
                         sampled_plugin) if keep else None,
    )


def _records(problems, greedy, greedy_rewards, greedy_plugin, sampled, rewards,
             sampled_plugin) -> list[ProblemRecord]:
    """Each problem with its completions and their rewards (the lists as `_evaluate_split`
    has them: the samples flat, problem by problem)."""
    def completion(output, reward, plugin) -> Completion:
        return Completion(text=output.text, reward=reward, plugin_reward=plugin,
                          finish_reason=str(output.finish_reason))

    def plugin_of(scored, i: int) -> float | None:
        return scored[0][i] if scored else None

    flat = [c for comps in sampled for c in comps]
    records, k = [], 0
    for i, problem in enumerate(problems):
        samples = []
        for output in sampled[i]:
            samples.append(completion(output, rewards[k], plugin_of(sampled_plugin, k)))
            k += 1
        records.append(ProblemRecord(
            uid=problem.uid, prompt=problem.prompt, answer=str(problem.answer),
            greedy=completion(greedy[i][0], greedy_rewards[i], plugin_of(greedy_plugin, i)),
            samples=samples))
    assert k == len(flat)  # every sample placed with its problem
    return records


def _generate(llm, prompts, params, bar, label):
    """llm.generate in chunks of CHUNK prompts; returns each prompt's list of completions."""
    job = bar.add_task(label, total=len(prompts)) if bar is not None else None
    completions = []
    for start in range(0, len(prompts), CHUNK):
        outs = llm.generate(
            prompts[start : start + CHUNK], list(params[start : start + CHUNK]), use_tqdm=False
        )
        completions += [o.outputs for o in outs]
        if bar is not None:
            bar.update(job, advance=len(outs))
    return completions


class _Scorer:
    """Scores completions through a `rewards.ScoringPool` (the caller's, or one owned for this
    evaluation): by the task's scorer (call), and by the plug-in scorer if there is one
    (`plugin`, None without). Returns (rewards, failures); a failed score is 0.0 and counted."""

    def __init__(self, task, pool, plugin=None):
        self.task, self.pool, self.owns_pool, self._plugin = task, pool, False, plugin

    def __enter__(self):
        if self.pool is None:
            from rewards import ScoringPool

            self.pool, self.owns_pool = ScoringPool(workers=1), True
        return self

    def __exit__(self, *exc):
        if self.owns_pool:
            _close(self.pool)

    def __call__(self, completions, problems) -> tuple[list[float], int]:
        return self._score(self.task.scorer, completions, problems)

    def plugin(self, completions, problems) -> tuple[list[float], int] | None:
        return None if self._plugin is None else self._score(self._plugin, completions, problems)

    def _score(self, function, completions, problems) -> tuple[list[float], int]:
        results = self.pool.score(function, problems, completions)
        return [r.reward for r in results], sum(r.failure is not None for r in results)


def _load_plugin(spec: str | None):
    """The plug-in scorer `spec` names, imported and checked as the pre-flight does."""
    if spec is None:
        return None
    import rewards

    return rewards.load_scorer(spec)


def _close(pool) -> None:
    for name in ("close", "shutdown"):
        if hasattr(pool, name):
            getattr(pool, name)()
            return


def _get_task(task):
    if isinstance(task, str):
        import rewards

        return rewards.get_task(task)
    return task


def _llm_model_name(llm) -> str | None:
    try:
        return str(llm.llm_engine.model_config.model)
    except AttributeError:
        return None


def _mean(xs) -> float:
    xs = list(xs)
    return float(sum(xs) / len(xs)) if xs else 0.0


class _NoBar:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _progress(enabled: bool):
    if not enabled:
        return _NoBar()
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("eval {task.description}"), BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
