"""`klrl figures` (`make figures`): regenerate, on this machine, every figure the documentation
quotes about the embedded model and the CPU demo, and write them into its pages.

Three blocks, each between `<!-- figures:NAME -->` and `<!-- /figures:NAME -->` in the docs page
PAGES names (and, with every number, in docs/figures/NAME.json):
- model:    the embedded model's build (`klrl init-model`: steps, validation accuracy, in-domain
            greedy, build seconds), read from the metadata cached beside it;
- demo:     `klrl demo` at max_lag 0 and 2 for each seed: in-domain sampled and greedy accuracy
            before and after, out-of-domain greedy, wall time (start-up included), s/step;
- learning: the demo configuration against plain GRPO in klrl (group mean/std advantages, K3 in
            the loss, everything else equal) at max_lag 0 for the same seeds: training reward
            and in-domain accuracy gained per 1,000 samples;
- lora:     the demo with rank-8 LoRA adapters (LORA_DEMO) against the demo's full fine-tuning
            at max_lag 0, same seeds and budget: the same gains, KL and time per step;
- spread:   the default model built under each of SPREAD_KERNELS (other CPU kernels, which
            change the arithmetic as another processor does): how far the stop rule lets the
            build depend on the machine (steps, validation and in-domain greedy accuracy; no
            timing, so it may run on a busy machine).

Each run is a `klrl demo` subprocess, exactly what a user runs, timed from launch to exit.
Nothing is typed by hand: a block is replaced only by what this module computed.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from cluster.config.loader import PLAIN_GRPO, REPO_ROOT
from cluster.config.options import replace_block as replace_marked_block
from cluster.tiny.model import init_default_model, read_metadata
from cluster.train.gains import TAIL, per_1k, reward_before_after
from cluster.train.progress import format_duration
from cluster.train.provenance import machine
from cluster.train.run_log import read_config, read_metrics

BLOCKS = ("model", "demo", "learning", "lora", "spread")
# The docs page each block lives in (relative to the repository root).
PAGES = {"model": "docs/model.md", "demo": "docs/demo.md", "learning": "docs/demo.md",
         "lora": "docs/lora.md", "spread": "docs/model.md"}
# The LoRA demo: rank-8 adapters on every linear layer, at 10x the demo's full fine-tuning lr
# (adapters start at zero and move the policy through a rank-8 product: the usual LoRA lr).
LORA_DEMO = ("learner.lora.rank=8", "learner.lr=1e-3")
# Each configuration's label in the tables and the name of its runs.
FORMS = {"klrl demo": "demo", "plain GRPO": "grpo", "LoRA rank 8": "lora"}


@dataclass(frozen=True)
class DemoRun:
    """One `klrl demo` run: a label for the tables, its lag, seed and extra overrides."""

    label: str
    max_lag: int
    seed: int
    overrides: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"figures-{FORMS[self.label]}-lag{self.max_lag}-seed{self.seed}"


@dataclass(frozen=True)
class RunFigures:
    """What one finished run measured. Accuracies are in-domain unless named otherwise."""

    label: str
    max_lag: int
    seed: int
    steps: int
    samples: int
    wall_seconds: float
    seconds_per_step: float
    sampled_before: float
    sampled_after: float
    greedy_before: float
    greedy_after: float
    ood_greedy_after: float
    reward_before: float
    reward_after: float
    kl_pi_ref_after: float
    # Steps on which a token-mean loss (the sequence-sum/N gradient divided by the mean response
    # length) would have been clipped too, i.e. taken exactly klrl's step: grad/norm above
    # grad_clip x response/length_mean.
    same_step_as_token_mean: float

    def per_1k(self, gain: float) -> float:
        return per_1k(gain, self.samples)


def plan(seeds: Sequence[int], blocks: Sequence[str]) -> list[DemoRun]:
    runs = []
    if {"demo", "learning", "lora"} & set(blocks):
        runs += [DemoRun("klrl demo", 0, s) for s in seeds]
    if "demo" in blocks:
        runs += [DemoRun("klrl demo", 2, s) for s in seeds]
    if "learning" in blocks:
        runs += [DemoRun("plain GRPO", 0, s, PLAIN_GRPO) for s in seeds]
    if "lora" in blocks:
        runs += [DemoRun("LoRA rank 8", 0, s, LORA_DEMO) for s in seeds]
    return runs


def run_demo(run: DemoRun, output_dir: Path, log_dir: Path) -> RunFigures:
    """Run `klrl demo` for `run` (its output in LOG_DIR/<name>.log) and read its figures."""
    args = [f"output_dir={output_dir}", f"run_name={run.name}", f"seed={run.seed}",
            f"max_lag={run.max_lag}", *run.overrides]
    log = log_dir / f"{run.name}.log"
    t0 = time.monotonic()
    with open(log, "w") as out:
        code = subprocess.call([sys.executable, "-m", "cluster.cli", "demo", *args],
                               stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    wall = time.monotonic() - t0
    if code != 0:
        raise RuntimeError(f"klrl demo {' '.join(args)} exited with {code}; see {log}")
    return run_figures(run, output_dir / run.name, wall)


def run_figures(run: DemoRun, run_dir: Path, wall_seconds: float) -> RunFigures:
    rows = read_metrics(run_dir)
    train = [r for r in rows if "reward/mean" in r]
    evals = [r for r in rows if "eval/in_domain/accuracy" in r]
    if not train or len(evals) < 2:
        raise RuntimeError(f"{run_dir}: needs training steps and two evaluations")
    cfg = read_config(run_dir)
    per_step = cfg["rollout"]["prompts_per_step"] * cfg["rollout"]["samples_per_prompt"]
    k = max(1, round(TAIL * len(train)))
    first, last = evals[0], evals[-1]
    reward_before, reward_after = reward_before_after([r["reward/mean"] for r in train])
    return RunFigures(
        label=run.label, max_lag=run.max_lag, seed=run.seed, steps=len(train),
        samples=len(train) * per_step, wall_seconds=round(wall_seconds, 1),
        seconds_per_step=statistics.fmean(r["time/step"] for r in train[1:] or train),
        sampled_before=first["eval/in_domain/sampled_accuracy"],
        sampled_after=last["eval/in_domain/sampled_accuracy"],
        greedy_before=first["eval/in_domain/accuracy"],
        greedy_after=last["eval/in_domain/accuracy"],
        ood_greedy_after=last["eval/out_of_domain/accuracy"],
        reward_before=reward_before, reward_after=reward_after,
        kl_pi_ref_after=statistics.fmean(r["kl/pi_ref"] for r in train[-k:]),
        same_step_as_token_mean=statistics.fmean(
            float(r["grad/norm"] > clip * max(1.0, r["response/length_mean"])) for r in train)
        if (clip := cfg["learner"]["grad_clip"]) > 0 else 0.0,
    )


# ----------------------------------------------------------------------------- tables


def _range(values: Sequence[float], fmt: str = "{:.3f}") -> str:
    """mean (min-max) over seeds, or the value alone when the seeds agree."""
    if len({fmt.format(v) for v in values}) == 1:
        return fmt.format(values[0])
    lo, hi = min(values), max(values)
    return f"{fmt.format(statistics.fmean(values))} ({fmt.format(lo)}-{fmt.format(hi)})"



def model_block(meta: dict, where: str) -> str:
    return (f"Built by `klrl init-model` on {where}: {meta['parameters']:,} parameters, "
            f"{meta['sft_steps']} supervised steps of {meta['sft_batch_size']} problems, stopped "
            f"at {100 * meta['validation_accuracy']:.1f}% greedy validation accuracy (target "
            f"{100 * meta['target_accuracy']:.0f}%, {meta['validation_problems']} problems); "
            f"greedy in-domain {100 * meta['greedy_accuracy_hf']['in_domain']:.1f}% and "
            f"out-of-domain {100 * meta['greedy_accuracy_hf']['out_of_domain']:.1f}% "
            f"({meta['eval_problems_per_split']} problems each, transformers); "
            f"{meta['build_seconds']:.0f} s with {meta['torch_threads']} torch threads.")


def demo_block(figures: list[RunFigures], where: str) -> str:
    seeds = sorted({f.seed for f in figures})
    lines = [
        (f"`klrl demo` on {where}; seeds {', '.join(map(str, seeds))} (mean, and min-max "
         "over seeds); 200 in-domain problems, sampled accuracy from 4 samples each at "
         "temperature 1; wall time from launch to exit, start-up and evaluations included."),
        "",
        "| | in-domain sampled | in-domain greedy | out-of-domain greedy | wall time | s/step |",
        "|---|---|---|---|---|---|",
    ]
    demo = [f for f in figures if f.label == "klrl demo"]
    lag0 = [f for f in demo if f.max_lag == 0] or demo
    lines.append(f"| before training | {_range([f.sampled_before for f in lag0])} | "
                 f"{_range([f.greedy_before for f in lag0])} | | | |")
    for lag, how in ((0, "`make demo`"), (2, '`make demo ARGS="max_lag=2"`')):
        rows = [f for f in demo if f.max_lag == lag]
        if rows:
            lines.append(
                f"| `max_lag: {lag}` ({how}) | **{_range([f.sampled_after for f in rows])}** | "
                f"**{_range([f.greedy_after for f in rows])}** | "
                f"{_range([f.ood_greedy_after for f in rows])} | "
                f"{format_duration(statistics.fmean(f.wall_seconds for f in rows))} "
                f"(max {format_duration(max(f.wall_seconds for f in rows))}) | "
                f"{_range([f.seconds_per_step for f in rows], '{:.2f}')} |")
    return "\n".join(lines)


def learning_block(figures: list[RunFigures], where: str) -> str:
    lines = [
        (f"max_lag 0, {figures[0].steps} steps x {figures[0].samples // figures[0].steps} "
         f"samples, seeds {', '.join(str(s) for s in sorted({f.seed for f in figures}))}, on "
         f"{where} (mean, and min-max over seeds). Gains per 1,000 training samples; the reward "
         f"is the mean over the first and last {round(100 * TAIL)}% of steps."),
        "",
        ("| configuration | reward before -> after | reward gain / 1k samples | in-domain sampled "
         "gain / 1k | in-domain greedy gain / 1k | KL(pi, ref) at the end |"),
        "|---|---|---|---|---|---|",
    ]
    for label, how in (("klrl demo", "klrl demo (K1 in reward, RLOO + group std)"),
                       ("plain GRPO", "plain GRPO (group mean/std, K3 in loss)")):
        rows = [f for f in figures if f.label == label and f.max_lag == 0]
        if not rows:
            continue
        lines.append(
            f"| {how} | {_range([f.reward_before for f in rows])} -> "
            f"{_range([f.reward_after for f in rows])} | "
            f"{_range([f.per_1k(f.reward_after - f.reward_before) for f in rows], '{:.4f}')} | "
            f"{_range([f.per_1k(f.sampled_after - f.sampled_before) for f in rows], '{:.4f}')} | "
            f"{_range([f.per_1k(f.greedy_after - f.greedy_before) for f in rows], '{:.4f}')} | "
            f"{_range([f.kl_pi_ref_after for f in rows])} |")
    same = [f.same_step_as_token_mean for f in figures if f.label == "klrl demo"]
    if same:
        share = "every step" if min(same) == 1 else f"at least {100 * min(same):.0f}% of the steps"
        lines += ["", (f"A token-mean loss would have taken exactly the demo's step on {share} of "
                       "each demo run: its gradient is the demo's divided by the mean response "
                       "length, and would have been clipped as well.")]
    return "\n".join(lines)


def lora_block(figures: list[RunFigures], where: str) -> str:
    lines = [
        (f"`klrl figures --only lora` on {where}: max_lag 0, {figures[0].steps} steps x "
         f"{figures[0].samples // figures[0].steps} samples, seeds "
         f"{', '.join(str(s) for s in sorted({f.seed for f in figures}))} (mean, and min-max "
         f"over seeds); gains per 1,000 training samples; the reward is the mean over the "
         f"first and last {round(100 * TAIL)}% of steps."),
        "",
        ("| training | reward before -> after | in-domain sampled gain / 1k | in-domain greedy "
         "gain / 1k | KL(pi, ref) at the end | s/step |"),
        "|---|---|---|---|---|---|",
    ]
    lora_how = f"LoRA rank 8 (`make demo ARGS=\"{' '.join(LORA_DEMO)}\"`)"
    for label, how in (("klrl demo", "every weight (`make demo`, lr 1e-4)"),
                       ("LoRA rank 8", lora_how)):
        rows = [f for f in figures if f.label == label and f.max_lag == 0]
        if rows:
            sampled_gain = [f.per_1k(f.sampled_after - f.sampled_before) for f in rows]
            lines.append(
                f"| {how} | {_range([f.reward_before for f in rows])} -> "
                f"{_range([f.reward_after for f in rows])} | "
                f"{_range(sampled_gain, '{:.4f}')} | "
                f"{_range([f.per_1k(f.greedy_after - f.greedy_before) for f in rows], '{:.4f}')} | "
                f"{_range([f.kl_pi_ref_after for f in rows])} | "
                f"{_range([f.seconds_per_step for f in rows], '{:.2f}')} |")
    return "\n".join(lines)


# The spread block's builds: the same recipe and seed under other CPU kernels, as another
# processor would run it. On this project's AMD EPYC, 1 and 2 torch threads built bit-identical
# weights (the kernels split work, not sums), while PyTorch's AVX2 kernels (those of a
# processor without AVX-512) and MKL's compatible code path each change the arithmetic of the
# model's forward and backward pass: they stand in for another processor. (PyTorch's scalar
# kernels would too, but a build with them takes hours.)
SPREAD_KERNELS: dict[str, dict[str, str]] = {
    "this machine's": {},
    "PyTorch's AVX2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "MKL's compatible path": {"MKL_CBWR": "COMPATIBLE"},
    "both": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE"},
}


def spread_block(builds: list[dict], where: str) -> str:
    """The spread of the default model's build over CPU kernels (`build_spread`'s rows)."""
    def band(key: str, fmt: str) -> str:
        values = [b[key] for b in builds]
        return fmt.format(min(values)) + ("" if min(values) == max(values)
                                          else "-" + fmt.format(max(values)))
    lines = [
        (f"The default model built on {where}, {len(builds)} times with other CPU kernels: "
         f"{band('sft_steps', '{}')} supervised steps, stopped at "
         f"{band('validation_accuracy', '{:.1%}')} greedy validation accuracy (target "
         f"{builds[0]['target_accuracy']:.0%}); greedy in-domain {band('in_domain', '{:.1%}')} "
         f"(transformers, {builds[0]['eval_problems']} problems)."),
        "",
        "| kernels | environment | supervised steps | validation | in-domain greedy |",
        "|---|---|---:|---:|---:|",
    ]
    lines += [f"| {b['kernels']} | {' '.join(f'`{k}={v}`' for k, v in b['env'].items()) or '-'} "
              f"| {b['sft_steps']} | {b['validation_accuracy']:.1%} | {b['in_domain']:.1%} |"
              for b in builds]
    return "\n".join(lines)


def build_spread(work_dir: Path, say: Callable[[str], None] = print) -> list[dict]:
    """Build the default model once per SPREAD_KERNELS entry (`klrl init-model` in a process
    whose environment picks the kernels before torch loads; a build already under WORK_DIR is
    reused) and return where each build stopped, from its metadata."""
    rows = []
    for i, (label, env) in enumerate(SPREAD_KERNELS.items()):
        out = work_dir / "spread" / f"kernels{i}"
        say(f"building the default model, kernels: {label}, into {out} ...")
        subprocess.run([sys.executable, "-m", "cluster.cli", "init-model", "--out", str(out)],
                       env={**os.environ, **env}, cwd=REPO_ROOT, check=True)
        meta = read_metadata(out)
        rows.append({"kernels": label, "env": env, "sft_steps": meta["sft_steps"],
                     "validation_accuracy": meta["validation_accuracy"],
                     "target_accuracy": meta["target_accuracy"],
                     "in_domain": meta["greedy_accuracy_hf"]["in_domain"],
                     "eval_problems": meta["eval_problems_per_split"]})
        say(f"    {rows[-1]['sft_steps']} steps, validation {rows[-1]['validation_accuracy']:.1%}"
            f", in-domain greedy {rows[-1]['in_domain']:.1%}")
    return rows


RENDER = {"demo": demo_block, "learning": learning_block, "lora": lora_block}


def replace_block(text: str, name: str, body: str) -> str:
    """`text` with the `<!-- figures:name -->` block replaced by `body`."""
    return replace_marked_block(text, f"figures:{name}", body)


def blocks_from_json(out_dir: Path) -> dict[str, str]:
    """Every block's text from the JSON files in OUT_DIR (what `regenerate` wrote): the docs
    blocks must equal these, which tests check."""
    texts = {}
    for name in BLOCKS:
        path = out_dir / f"{name}.json"
        if not path.is_file():
            continue
        data = json.loads(path.read_text())
        if name == "model":
            texts[name] = model_block(data["metadata"], data["machine"])
        elif name == "spread":
            texts[name] = spread_block(data["builds"], data["machine"])
        else:
            figures = [RunFigures(**row) for row in data["runs"]]
            texts[name] = RENDER[name](figures, data["machine"])
    return texts


def _keeps(name: str, fig: RunFigures) -> bool:
    """Which runs a block shows: demo, the demo's runs; learning, the demo and plain GRPO at
    max_lag 0; lora, the demo and LoRA at max_lag 0."""
    if name == "demo":
        return fig.label == "klrl demo"
    return fig.max_lag == 0 and fig.label in ({"klrl demo", "plain GRPO"} if name == "learning"
                                               else {"klrl demo", "LoRA rank 8"})


def regenerate(seeds: Sequence[int], blocks: Sequence[str], work_dir: Path,
               root: Path = REPO_ROOT, out_dir: Path = REPO_ROOT / "docs" / "figures",
               say: Callable[[str], None] = print) -> dict[str, str]:
    """Run what `blocks` need, write their figures to OUT_DIR/<block>.json, and rewrite the
    blocks of the docs pages (PAGES, under ROOT) from those files."""
    work_dir.mkdir(parents=True, exist_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    where = machine()
    if "model" in blocks:
        say("building (or reusing) the embedded model ...")
        meta = read_metadata(init_default_model())
        _write_json(out_dir / "model.json", {"machine": where, "metadata": meta})
    if "spread" in blocks:
        _write_json(out_dir / "spread.json",
                    {"machine": where, "builds": build_spread(work_dir, say=say)})
    runs = plan(seeds, blocks)
    figures: list[RunFigures] = []
    for i, run in enumerate(runs, 1):
        say(f"[{i}/{len(runs)}] klrl demo {run.name} (log: {work_dir / (run.name + '.log')})")
        fig = run_demo(run, work_dir / "runs", work_dir)
        say(f"    sampled {fig.sampled_before:.3f} -> {fig.sampled_after:.3f}, greedy "
            f"{fig.greedy_before:.3f} -> {fig.greedy_after:.3f}, "
            f"{format_duration(fig.wall_seconds)}")
        figures.append(fig)
    for name in ("demo", "learning", "lora"):
        if name in blocks:
            runs_json = [asdict(f) for f in figures if _keeps(name, f)]
            _write_json(out_dir / f"{name}.json", {"machine": where, "runs": runs_json})
    texts = {k: v for k, v in blocks_from_json(out_dir).items() if k in blocks}
    for name, body in texts.items():
        page = root / PAGES[name]
        page.write_text(replace_block(page.read_text(), name, body))
    return texts


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
