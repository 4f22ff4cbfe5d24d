"""The figures of a `klrl bench` JSON as the markdown blocks docs/bench.md quotes.

`klrl bench --json docs/figures/bench.json --docs docs/bench.md` writes both (the block
`bench:figures`; with `--peer trl`, docs/figures/peers.json and the block `bench:peers`); a
test checks that the page's blocks are these renderings of those files, so the page quotes
the figures of real runs and nothing typed by hand.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from cluster.config.options import replace_block

MARKERS = {"bench": "bench:figures", "peers": "bench:peers"}


def markdown(result: dict[str, Any]) -> str:
    """The machine line and three tables: engine overheads, weight sync, end to end."""
    m = result["machine"]
    lines = [(f"`klrl bench` on {m['cpu_model']}, {m['cpus']} CPUs, {m['memory_gib']} GiB, GPU: "
             f"{m['gpu'] or 'none'}; finished {result['finished_at']}; load average "
             f"{m['load_avg_before'][0]:.2f} before, {m['load_avg_after'][0]:.2f} after; memcpy "
             f"{result['memcpy_gb_per_s']:.1f} GB/s on one thread. Split: "
             f"{result['split']['rollout_worker']} (rollout worker), "
             f"{result['split']['learner_rank']} (learner rank)."), "",
             "**Engine overheads** (ratio = raw throughput / klrl throughput; 1 = no overhead)", "",
             ("| engine overhead | tokens | raw tok/s | klrl tok/s | ratio | in engine "
             "| outside engine, ms per call |"), "|---|---|---|---|---|---|---|"]
    for name, w in result["workloads"].items():
        for o in (w["rollout"], w["learner"]):
            if o:
                lines.append(f"| {o['name']}, {name} | {o['tokens']} | {o['raw_tokens_per_s']:.0f} "
                             f"| {o['klrl_tokens_per_s']:.0f} | **{o['overhead_ratio']:.2f}** "
                             f"| {o['engine_seconds'] / o['klrl_seconds']:.0%} "
                             f"| {o['outside_engine_ms']:.0f} |")
    lines += ["", "**Weight sync** (learner export -> worker serving the new weights)", "",
              ("| weight sync (median) | transport | MB | publish s | load s | total s "
              "| one-copy bound s | x bound | where it goes (ms) |"),
              "|---|---|---|---|---|---|---|---|---|"]
    for name, w in result["workloads"].items():
        trained = w.get("trainable_parameters") or w["parameters"]
        if trained != w["parameters"]:  # LoRA: the optimizer holds the adapters only
            name = f"{name} (trains {trained / 1e6:.2f}M of {w['parameters'] / 1e6:.0f}M parameters)"
        for s in w["weight_sync"]:
            parts = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in s["parts"].items())
            lines.append(f"| {name} | {s['transport']} | {s['num_bytes'] / 1e6:.1f} "
                         f"| {s['publish_seconds']:.3f} | {s['load_seconds']:.3f} "
                         f"| {s['total_seconds']:.3f} | {s['bound_seconds']:.4f} "
                         f"| **{s['ratio_to_bound']:.1f}** | {parts} |")
    memory = {name: w["learner_memory"] for name, w in result["workloads"].items()
              if w.get("learner_memory")}  # absent from JSONs written before it was measured
    if memory:
        lines += ["", ("**Learner memory** (rank 0 after an optimizer step, MB; peak RSS: the "
                  "rank process's peak resident set, libraries and activations included)"), "",
                  ("| learner memory | trained weights | all weights | separate reference "
                   "| optimizer state | peak RSS |"), "|---|---|---|---|---|---|"]
        for name, mem in memory.items():
            lines.append(f"| {name} | {mem['trainable'] / 1e6:.1f} | {mem['weights'] / 1e6:.1f} "
                         f"| {mem['reference'] / 1e6:.1f} | {mem['optimizer_state'] / 1e6:.1f} "
                         f"| **{mem['peak_rss'] / 1e6:.0f}** |")
    lines += ["", ("**End to end** (efficiency = measured / ideal; bound = batch x cores / the "
              "one-core T_gen + T_train)"), "",
              ("| end to end | max_lag | samples/s | ideal | efficiency | bound | of bound "
              "| wait for rollouts s | train + publish s |"), "|---|---|---|---|---|---|---|---|---|"]
    for name, w in result["workloads"].items():
        p = w["pipeline"]
        for r in p["runs"] if p else []:
            lines.append(f"| {name} | {r['max_lag']} | **{r['samples_per_s']:.1f}** "
                         f"| {r['ideal_samples_per_s']:.1f} | {r['overlap_efficiency']:.2f} "
                         f"| {p['bound_samples_per_s']:.1f} | {r['of_bound']:.2f} "
                         f"| {r['wait_for_rollouts_seconds']:.3f} "
                         f"| {r['train_plus_publish_seconds']:.3f} |")
    refs = [f"{name}: T_gen {w['pipeline']['t_gen_seconds']:.3f} s, T_train "
            f"{w['pipeline']['t_train_seconds']:.3f} s ({w['pipeline']['one_core_samples_per_s']:.1f} "
            f"samples/s)" for name, w in result["workloads"].items() if w["pipeline"]]
    lines += ["", "One-core reference (max_lag 0, one thread per part): " + "; ".join(refs) + "."]
    return "\n".join(lines)


def peers_markdown(result: dict[str, Any]) -> str:
    """The side-by-side table of a `klrl bench --peer trl` JSON, its versions and differences."""
    peers, m = result["peers"]["trl"], result["machine"]
    lines = [(f"**klrl against TRL GRPOTrainer** (same model, prompts, batch, tokens, lr, beta; "
             f"objective: {peers['objective']}) on {m['cpu_model']}, {m['cpus']} CPUs, "
             f"{m['memory_gib']} GiB, GPU: {m['gpu'] or 'none'}; load average "
             f"{m['load_avg_before'][0]:.2f} before, {m['load_avg_after'][0]:.2f} after."), "",
             ("| workload | trainer | samples/s | vs TRL | step s | measured steps "
             "| reward before -> after | reward gain per 1k samples | threads |"),
             "|---|---|---|---|---|---|---|---|---|"]
    notes: set[str] = set()
    for name, sides in peers["workloads"].items():
        for side in ("klrl", "trl"):
            r = sides[side]
            gain = r["reward_gain_per_1k_samples"]
            threads = r["settings"]["threads"]
            threads = ("/".join(str(t) for t in threads.values()) if isinstance(threads, dict)
                       else str(threads))
            lines.append(f"| {name} | {side} | **{r['samples_per_s']:.1f}** "
                         f"| {r['samples_per_s'] / sides['trl']['samples_per_s']:.2f}x "
                         f"| {r['step_seconds_mean']:.3f} | {r['measured_steps']} of {r['steps']} "
                         f"| {r['reward_before']:.3f} -> {r['reward_after']:.3f} "
                         f"| {'n/a (random weights)' if gain is None else f'{gain:+.4f}'} "
                         f"| {threads} |")
        notes.update(sides["trl"]["settings"]["differences"])
        versions = sides["trl"]["versions"] | {"klrl": sides["klrl"]["versions"]["klrl"]}
    lines += ["", (f"TRL {versions['trl']}, transformers {versions['transformers']}, torch "
              f"{versions['torch']}, use_vllm=False; {versions['klrl']}. Threads: TRL's "
              "process, klrl's rollout worker/learner rank. What still differs:"), ""]
    lines += [f"- differs: {note}" for note in sorted(notes)]
    return "\n".join(lines)


def print_markdown(text: str) -> None:
    """`text` (one of the renderings above) on the terminal, or plain in a log."""
    from rich.console import Console
    from rich.markdown import Markdown

    console = Console(width=None if Console().is_terminal else 130)
    console.print(Markdown(text))


def write_docs(result: dict[str, Any], page: str | Path) -> None:
    """Replace the block of `page` that `result` fills (`MARKERS`) with its rendering."""
    page = Path(page)
    kind = "peers" if "peers" in result else "bench"
    body = peers_markdown(result) if kind == "peers" else markdown(result)
    page.write_text(replace_block(page.read_text(), MARKERS[kind], body))
