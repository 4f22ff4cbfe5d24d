"""The figures of a `klrl bench` JSON as the markdown blocks docs/bench.md quotes.

`klrl bench --json docs/figures/bench.json --docs docs/bench.md` writes both (the block
`bench:figures`; with `--peer trl`, docs/figures/peers.json and the block `bench:peers`; with
`--device cuda`, a page's `bench:gpu` block); a test checks that the page's blocks are these
renderings of those files, so the page quotes the figures of real runs and nothing typed by
hand. A result of some parts only (`--only`) renders the tables it has.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from cluster.config.options import replace_block

MARKERS = {"bench": "bench:figures", "peers": "bench:peers", "gpu": "bench:gpu"}
# docs/gpu.md's gpu block until a GPU run's JSON is committed as docs/figures/gpu.json.
NO_GPU_RUN = ("No `make gpu-check` JSON is committed yet (docs/figures/gpu.json): the figures "
              "of this block are still to be measured.")


def markdown(result: dict[str, Any]) -> str:
    """The machine line and the tables: engine overheads (and the rollout's cost outside the
    engine at 256 x 64), weight sync, learner memory, end to end; on CUDA the gpu-marked
    tests. Tables without rows (parts not run) are left out."""
    cuda = result.get("device") == "cuda"
    lines = [_gpu_machine_line(result) if cuda else _machine_line(result)]
    if cuda and result.get("gpu_check"):
        lines += ["", _gpu_check_line(result["gpu_check"])]
    overheads = [(name, o) for name, w in result["workloads"].items()
                 for o in (w.get("rollout"), w.get("learner")) if o]
    # JSONs written before the floor was measured render without its columns.
    floor = any(o.get("floor_ratio") for _, o in overheads)
    # ...and before the learner's peak memory was measured beside its throughput.
    peak = any(o.get("klrl_peak_bytes") for _, o in overheads)
    rows = []
    for name, o in overheads:
        row = (f"| {o['name']}, {name} | {o['tokens']} | {o['raw_tokens_per_s']:.0f} "
               f"| {o['klrl_tokens_per_s']:.0f} | **{o['overhead_ratio']:.2f}**{_range(o)} "
               f"| {o['engine_seconds'] / o['klrl_seconds']:.0%} "
               f"| {o['outside_engine_ms']:.0f} |")
        if floor:
            row += (f" {o['floor_tokens_per_s']:.0f} | **{o['floor_ratio']:.2f}** |"
                    if o.get("floor_ratio") else " - | - |")
        if peak:
            row += (f" {_mb(o.get('raw_peak_bytes'))} | **{_mb(o.get('klrl_peak_bytes'))}** |")
        rows.append(row)
    if rows:
        head = ("| engine overhead | tokens | raw tok/s | klrl tok/s | ratio | in engine "
                "| outside engine, ms per call |")
        rule = "|---|---|---|---|---|---|---|"
        title = ("**Engine overheads** (ratio = raw throughput / klrl throughput; 1 = no "
                 "overhead")
        if any(o.get("ratio_min") for _, o in overheads):
            title += "; [range]: the learner's interleaved pairs' ratios"
        if floor:
            head += " raw without log-probs tok/s | x floor |"
            rule += "---|---|"
            title += ("; x floor = raw vLLM asked for no log-probs / klrl: the floor the "
                      "rollout's log-probs are measured against")
        if peak:
            head += " raw peak MB | klrl peak MB |"
            rule += "---|---|"
            title += ("; peak MB: the learner process's peak resident set, on a GPU its peak "
                      "allocation, bare DeepSpeed and klrl's rank 0")
        lines += ["", title + ")", "", head, rule, *rows]
    if "generation_tokens_per_s" in result and "training_tokens_per_s" in result:
        lines += ["", (f"**Headline** ({result['headline_workload']}, through klrl): "
                       f"generation {result['generation_tokens_per_s']:.0f} tokens/s, training "
                       f"{result['training_tokens_per_s']:.0f} tokens/s (prompt + response), "
                       f"rollout x floor {_ratio(result.get('rollout_floor_ratio'))}.")]
    if result.get("outside_engine"):
        lines += _outside_table(result["outside_engine"])
    lines += _later_tables(result)
    if result.get("environment"):
        lines += _environment_table(result["environment"])
    if cuda and result.get("gpu_tests"):
        lines += _gpu_tests(result["gpu_tests"])
    return "\n".join(lines)


def _machine_line(result: dict[str, Any]) -> str:
    m = result["machine"]
    return (f"`klrl bench` on {m['cpu_model']}, {m['cpus']} CPUs, {m['memory_gib']} GiB, GPU: "
            f"{m['gpu'] or 'none'}; finished {result['finished_at']}; load average "
            f"{m['load_avg_before'][0]:.2f} before, {m['load_avg_after'][0]:.2f} after"
            + (f"; memcpy {result['memcpy_gb_per_s']:.1f} GB/s on one thread"
               if "memcpy_gb_per_s" in result else "") + ". Split: "
            f"{result['split']['rollout_worker']} (rollout worker), "
            f"{result['split']['learner_rank']} (learner rank).")


def _gpu_machine_line(result: dict[str, Any]) -> str:
    m, v = result["machine"], result.get("versions") or {}
    parts = ", ".join(f"{p} {d['finished_at']}" for p, d in (result.get("parts") or {}).items())
    copy = (f"; device-to-device copy {result['d2d_gb_per_s']:.0f} GB/s"
            if "d2d_gb_per_s" in result else "")
    return (f"`klrl bench --device cuda` on {m['gpu']} (driver {v.get('driver')}, CUDA "
            f"{v.get('cuda')}), {m['cpu_model']}, {m['cpus']} CPUs, {m['memory_gib']} GiB; torch "
            f"{v.get('torch')}, vLLM {v.get('vllm')}, DeepSpeed {v.get('deepspeed')}, Ray "
            f"{v.get('ray')}; {v.get('klrl')}; {result.get('dtype', 'float32')}{copy}; parts "
            f"finished: {parts or result['finished_at']}. Split: {result['split']['gpu']}; "
            f"{result['split']['rollout_worker']} (rollout worker), "
            f"{result['split']['learner_rank']} (learner rank); weight sync in the runs: "
            f"{result['split']['sync_transport']}.")


def _outside_table(o: dict[str, Any]) -> list[str]:
    parts = o["parts_ms"]
    return ["", (f"**The rollout's cost outside the engine** ({o['samples']} samples x "
                 f"{o['new_tokens']} new tokens per call, {o['workload']}; ms per call, medians "
                 f"of {o['reps']})"), "",
            ("| workload | tokens | klrl ms | in engine ms | outside engine ms | of which not "
             "scoring | requests | scoring | records | Ray trip |"),
            "|---|---|---|---|---|---|---|---|---|---|",
            (f"| {o['workload']} | {o['tokens']} | {o['klrl_ms']:.0f} | {o['engine_ms']:.0f} "
             f"| **{o['outside_engine_ms']:.1f}** | {_ms(o.get('outside_engine_unscored_ms'))} "
             f"| {parts['requests']:.1f} "
             f"| {parts['scoring']:.1f} | {parts['records']:.1f} | {parts['ray_trip']:.1f} |")]


def _range(o: dict[str, Any]) -> str:
    """The interleaved pairs' ratio range, where measured (the learner's)."""
    return f" [{o['ratio_min']:.2f}-{o['ratio_max']:.2f}]" if o.get("ratio_min") else ""


def _mb(x: int | None) -> str:
    return "-" if not x else f"{x / 1e6:.0f}"


def _environment_table(e: dict[str, Any]) -> list[str]:
    """`--only environment`: each setting's rollout samples/s and share outside the engine."""
    rows = [f"| {name} | {s['samples_per_s']:.2f} | {_share(s['environment_share'])} "
            f"| {_share(s['outside_engine_share'])} | {s['turns_mean']:.1f} |"
            for name, s in e["settings"].items()]
    return ["", (f"**A slow environment** ({e['delay_ms']:g} ms a step against an instant "
                 f"one, {e['samples']} episodes a call; samples/s slow / instant: threads "
                 f"**{e['ratio_threads']:.2f}**, pool **{e['ratio_pool']:.2f}**)"), "",
            "| environment | samples/s | in the environment | outside the engine | turns |",
            "|---|---|---|---|---|",
            *rows]


def _ratio(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"**{x:.1f}**"


def _gpu_check_line(record: dict[str, Any]) -> str:
    """What each part of `make gpu-check` did (cluster/bench/gpu_check.py), over its calls."""
    calls = record.get("calls") or []
    budgets = sorted({c["budget_s"] for c in calls})
    said = []
    for name, r in record["parts"].items():
        if r["status"] == "not started":
            said.append(f"{name} not started ({r['why']})")
        elif r["status"] == "running":
            said.append(f"{name} was running when the call ended")
        elif r["status"] == "stopped":
            said.append(f"{name} stopped at the end of the budget after {r['seconds']:.0f} s")
        else:
            said.append(f"{name} {r['status']} in {r['seconds']:.0f} s")
    return (f"**GPU check** (`make gpu-check`, {len(calls)} call(s) with a budget of "
            f"{' / '.join(f'{b:.0f}' for b in budgets)} s): {'; '.join(said)}.")


def _gpu_tests(t: dict[str, Any]) -> list[str]:
    if t.get("error") or (t.get("timed_out") and "passed" not in t):
        return ["", f"**GPU tests** (`{t['command']}`): {t.get('error') or 'timed out'}"]
    stopped = " (stopped at its time: the tests after these did not run)" if t.get(
        "timed_out") else ""
    lines = ["", (f"**GPU tests** (`{t['command']}`): {t['passed']} passed, {t['skipped']} "
                  f"skipped, {t['failed']} failed, {t['errors']} errors in "
                  f"{t['seconds']:.0f} s{stopped}"), ""]
    lines += [f"- skipped: {s['test']}: {s['reason']}" for s in t["skip_reasons"]]
    lines += [f"- failed: {f['test']}: {f['message']}" for f in t["failures"]]
    return lines if t["skip_reasons"] or t["failures"] else lines[:-1]


def _later_tables(result: dict[str, Any]) -> list[str]:
    """The weight-sync, learner-memory and end-to-end tables, and the reference line."""
    lines = []
    rows = []
    for name, w in result["workloads"].items():
        trained = w.get("trainable_parameters") or w["parameters"]
        if trained != w["parameters"]:  # LoRA: the optimizer holds the adapters only
            name = (f"{name} (trains {trained / 1e6:.2f}M of {w['parameters'] / 1e6:.0f}M "
                    "parameters)")
        for s in w.get("weight_sync") or []:
            parts = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in s["parts"].items())
            gb = s["num_bytes"] / 1e9
            rows.append(f"| {name} | {s['transport']} | {s['num_bytes'] / 1e6:.1f} "
                        f"| {s['publish_seconds']:.3f} | {s['load_seconds']:.3f} "
                        f"| {s['publish_seconds'] / gb:.3f} | {s['load_seconds'] / gb:.3f} "
                        f"| {s['total_seconds']:.3f} | {s['bound_seconds']:.4f} "
                        f"| **{s['ratio_to_bound']:.1f}** | {parts} |")
    if rows:
        copy = "device-to-device copy" if result.get("device") == "cuda" else "one-copy"
        lines += ["", ("**Weight sync** (learner export -> worker serving the new weights; "
                       "per GB: seconds per 10^9 bytes sent)"), "",
                  ("| weight sync (median) | transport | MB | publish s | load s | publish s/GB "
                   f"| load s/GB | total s | {copy} bound s | x bound | where it goes (ms) |"),
                  "|---|---|---|---|---|---|---|---|---|---|---|", *rows]
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
    packing = {name: w["packing"] for name, w in result["workloads"].items()
               if w.get("packing")}  # absent from JSONs written before it was measured
    if packing:
        lines += ["", ("**Packed against padded** (the learner's step on the same batch of "
                       "long-tailed lengths, interleaved; median [min-max] over the repetitions; "
                       "tokens/s: trained tokens, padding not counted)"), "",
                  ("| packing | sequences | tokens | padding share | token budget | padded tok/s "
                   "| packed tok/s | speed-up |"), "|---|---|---|---|---|---|---|---|"]
        for name, p in packing.items():
            lines.append(
                f"| {name} | {p['sequences']} | {p['tokens']} | {p['padding_share']:.0%} "
                f"| {p['token_budget']} | {p['padded']['tokens_per_s']:.0f} "
                f"| {p['packed']['tokens_per_s']:.0f} | **{p['speedup_median']:.2f}** "
                f"[{p['speedup_min']:.2f}-{p['speedup_max']:.2f}] |")
    pipelines = {name: w["pipeline"] for name, w in result["workloads"].items()
                 if w.get("pipeline")}
    if not pipelines:
        return lines
    gpu = any(p.get("reference") == "max_lag 0" for p in pipelines.values())
    bound = ("batch / T_gen + T_train of the max_lag 0 run, on one GPU" if gpu else
             "batch x cores / the one-core T_gen + T_train")
    lines += ["", f"**End to end** (efficiency = measured / ideal; bound = {bound})", "",
              ("| end to end | max_lag | samples/s | ideal | efficiency | bound | of bound "
              "| wait for rollouts s | train + publish s |"),
              "|---|---|---|---|---|---|---|---|---|"]
    for name, p in pipelines.items():
        for r in p["runs"]:
            lag = f"{r['max_lag']}, in flight" if r.get("in_flight") else r["max_lag"]
            lines.append(f"| {name} | {lag} | **{r['samples_per_s']:.1f}** "
                         f"| {_num(r['ideal_samples_per_s'], '.1f')} "
                         f"| {_num(r['overlap_efficiency'])} "
                         f"| {_num(p['bound_samples_per_s'], '.1f')} | {_num(r['of_bound'])} "
                         f"| {r['wait_for_rollouts_seconds']:.3f} "
                         f"| {r['train_plus_publish_seconds']:.3f} |")
    refs = [f"{name}: T_gen {p['t_gen_seconds']:.3f} s, T_train {p['t_train_seconds']:.3f} s "
            f"({p['one_core_samples_per_s']:.1f} samples/s)" if p.get("reference") != "none"
            else f"{name}: none run (--quick), so no ideal, efficiency or bound"
            for name, p in pipelines.items()]
    what = ("Reference (the max_lag 0 run, learner and worker sharing the GPU)" if gpu else
            "One-core reference (max_lag 0, one thread per part)")
    lines += ["", f"{what}: " + "; ".join(refs) + "."]
    return lines + _in_flight_table(pipelines)


def _in_flight_table(pipelines: dict[str, dict[str, Any]]) -> list[str]:
    """Each in-flight run beside the batch-level run of its workload and max_lag (none in
    JSONs from before in-flight runs): samples/s and the speed-up, the engines' idle share,
    the tokens' lag, the share of samples spanning several versions and the requests updates
    preempted per step (with "nothing was in flight" where both are 0), the response
    lengths."""
    rows = []
    for name, p in pipelines.items():
        batch = {r["max_lag"]: r for r in p["runs"] if not r.get("in_flight")}
        for fly in (r for r in p["runs"] if r.get("in_flight")):
            off = batch.get(fly["max_lag"])
            if off is None:
                continue
            rows.append(
                f"| {name} | {fly['max_lag']} | {off['samples_per_s']:.1f} "
                f"| **{fly['samples_per_s']:.1f}** "
                f"| **{fly['in_flight_speedup']:.2f}** "
                f"| {_share(off.get('engine_idle_share'))} "
                f"| {_share(fly.get('engine_idle_share'))} "
                f"| {_num(off.get('token_lag_mean'))} | {_num(fly.get('token_lag_mean'))} "
                f"| {_spanned(fly.get('multi_version_share'), fly.get('preempted'))} "
                f"| {_num(fly.get('preempted'), '.1f')} "
                f"| {_num(off.get('response_tokens_mean'), '.1f')} / "
                f"{_num(off.get('response_tokens_max'), '.0f')} |")
    if not rows:
        return []
    return ["", ("**In-flight weight updates** (`rollout.in_flight_updates`, each run beside the "
                 "batch-level run of its max_lag; speed-up = in flight / batch-level samples/s; "
                 "engine idle: share of the time between a worker's two batches in which its "
                 "engine sat idle; token lag: learner step - the version that sampled the "
                 "token; preempted: requests an update preempted, per step (stale_kv recompute; "
                 "0 with keep); responses: the batch-level run's mean length / longest per "
                 "batch, in tokens)"), "",
            ("| in flight | max_lag | batch-level samples/s | in flight samples/s | speed-up "
             "| engine idle, batch-level | engine idle, in flight | token lag, batch-level "
             "| token lag, in flight | samples over several versions | preempted per step "
             "| responses mean / longest |"),
            "|---|---|---|---|---|---|---|---|---|---|---|---|", *rows]


def _spanned(share: float | None, preempted: float | None) -> str:
    """The share of samples over several versions; none, with no request preempted either,
    means nothing was in flight at an update, whatever the speed-up says (a preempted request
    may still hold one version: preempted before its first token)."""
    return "0%: nothing was in flight" if share == 0 and not preempted else _share(share)


def _share(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0%}"


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "n/a" if x is None else format(x, fmt)


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
        for side in (s for s in ("klrl", "klrl_lag2", "trl") if s in sides):
            r = sides[side]
            gain = r["reward_gain_per_1k_samples"]
            threads = r["settings"]["threads"]
            threads = ("/".join(str(t) for t in threads.values()) if isinstance(threads, dict)
                       else str(threads))
            trainer = {"klrl": "klrl (max_lag 0)", "klrl_lag2": "klrl (max_lag 2)"}.get(side, side)
            lines.append(f"| {name} | {trainer} | **{r['samples_per_s']:.1f}** "
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
    kind = block_kind(result)
    body = peers_markdown(result) if kind == "peers" else markdown(result)
    page.write_text(replace_block(page.read_text(), MARKERS[kind], body))


def block_kind(result: dict[str, Any]) -> str:
    """Which block of `MARKERS` a result fills: peers, gpu (--device cuda) or bench."""
    if "peers" in result:
        return "peers"
    return "gpu" if result.get("device") == "cuda" else "bench"
