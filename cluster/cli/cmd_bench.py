"""`klrl bench`: throughput against the raw engines and the ideal (see cluster/bench/run.py),
on CPU or one CUDA GPU, whole or part by part; with `--peer trl`, klrl against TRL's
GRPOTrainer on the same workloads (cluster/bench/peers.py)."""
from __future__ import annotations

import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

# Light (no torch, Ray or vLLM), so `klrl --help` stays fast.
from cluster.bench.results import PARTS, check_result, merge, read_json

PEER_EXTRA_HINT = "pip install -e '.[peers]'"


def run(args) -> int:
    if args.from_json:
        return run_from_json(args)
    if args.peer:
        if args.device != "cpu" or args.only:
            return _refuse("--peer compares klrl with TRL on CPU; --device and --only apply "
                           "to the measurements without --peer")
        refusal = _paths_refusal(args) or _peer_docs_refusal(args)
        return _refuse(refusal) if refusal else run_peer(args)
    refusal = _paths_refusal(args) or _refusal(args)
    if refusal:
        return _refuse(refusal)
    # Ray, torch, vLLM and DeepSpeed: loaded when the benchmark runs, not at `klrl --help`.
    from cluster.bench.run import FULL, QUICK, gpu_plan, print_tables, run_bench

    plan = QUICK if args.quick else FULL
    if args.device == "cuda":
        plan = gpu_plan(plan, args.dtype, args.sync_transport)
    parts = tuple(dict.fromkeys(args.only)) if args.only else None
    with _work_dir(args.work_dir) as work_dir:
        result = run_bench(plan, work_dir, parts)
    if args.only and args.json and Path(args.json).is_file():
        result = merge(read_json(args.json), result)  # the parts measured before, same device
    return _finish(result, args, print_tables, check_result, "figures")


def _paths_refusal(args) -> str | None:
    """Where the run writes, checked before it starts (every measuring run, --peer too):
    --json a file that can be written (not a directory; its directory exists or can be
    made), --work-dir a directory or one that can be made (not a file)."""
    from cluster.config.loader import ConfigError
    from cluster.train.door.paths import check_creatable, check_writable_file

    try:
        if args.json:
            check_writable_file(Path(args.json), "--json")
        if args.work_dir:
            check_creatable(Path(args.work_dir), "--work-dir")
    except ConfigError as e:
        return str(e)
    return None


def _peer_docs_refusal(args) -> str | None:
    """--docs with --peer: the page holds the block the comparison is written into (what
    cluster/bench/report.py's write_docs replaces), found before TRL and klrl run."""
    if not args.docs:
        return None
    from cluster.bench.report import MARKERS
    from cluster.config.options import replace_block

    marker, page = MARKERS["peers"], Path(args.docs)
    try:
        replace_block(page.read_text(), marker, "")
    except (OSError, UnicodeDecodeError, ValueError):
        return (f"--docs {args.docs}: no <!-- {marker} --> ... <!-- /{marker} --> block there "
                "for the --peer figures")
    return None


def _refusal(args) -> str | None:
    """Why these options cannot run, found before anything starts (None: they can)."""
    if args.dtype == "bfloat16" and args.device != "cuda":
        return "--dtype bfloat16 is for GPUs (--device cuda): the CPU learner trains in float32"
    if args.sync_transport and args.device != "cuda":
        return ("--sync-transport is for --device cuda: on CPU the workloads sync with shm, "
                "and shm and object_store are both measured")
    if args.only and args.json and Path(args.json).is_file():
        try:
            device = read_json(args.json).get("device", "cpu")
        except (ValueError, AttributeError) as e:
            return f"--only writes its part into {args.json}, which is not a bench JSON ({e})"
        if device != args.device:
            return (f"--only writes its part into {args.json}, which holds a {device} bench; "
                    f"this one is {args.device}: give another --json PATH")
    if args.docs:
        kind, marker = ("gpu", "bench:gpu") if args.device == "cuda" else ("bench", "bench:figures")
        page = Path(args.docs)
        if not page.is_file() or f"<!-- {marker} -->" not in page.read_text():
            return (f"--docs {args.docs}: no <!-- {marker} --> ... <!-- /{marker} --> block "
                    f"there for the {kind} figures")
    if args.device == "cuda":
        from cluster.bench.gpu import cuda_missing, sync_transports  # imports torch

        missing = cuda_missing()
        if missing:
            return f"klrl bench --device cuda needs a CUDA GPU: {missing}"
        if args.sync_transport and args.sync_transport not in sync_transports():
            return (f"--sync-transport {args.sync_transport}: not a transport of this checkout "
                    f"that works on one shared GPU ({', '.join(sync_transports())})")
    return None


def run_from_json(args) -> int:
    """`klrl bench --from-json PATH`: measure nothing; print the tables of a bench JSON
    written before (on this machine or another: `make gpu-check`'s on a GPU machine) and, with
    --docs, write them into the page's block for that JSON's device. Exits 1 as the run that
    wrote it would have, where a required figure is missing."""
    measuring = [flag for flag, given in (("--only", args.only), ("--quick", args.quick),
                                          ("--peer", args.peer), ("--json", args.json),
                                          ("--work-dir", args.work_dir),
                                          ("--sync-transport", args.sync_transport))
                 if given]
    if measuring:
        return _refuse(f"--from-json measures nothing: {', '.join(measuring)} do not apply")
    from cluster.bench.report import MARKERS, block_kind, markdown, print_markdown

    try:
        result = read_json(args.from_json)
        kind = block_kind(result)
    except (OSError, ValueError, AttributeError) as e:
        return _refuse(f"--from-json {args.from_json}: not a bench JSON ({e})")
    if kind == "peers" or "workloads" not in result:
        return _refuse(f"--from-json {args.from_json}: not a JSON of the measurements "
                       "(klrl bench --json; a --peer JSON is rendered by its own run)")
    if args.docs:
        marker = MARKERS[kind]
        page = Path(args.docs)
        if not page.is_file() or f"<!-- {marker} -->" not in page.read_text():
            return _refuse(f"--docs {args.docs}: no <!-- {marker} --> ... <!-- /{marker} --> "
                           f"block there for the {result.get('device', 'cpu')} figures")
    return _finish(result, args, lambda r: print_markdown(markdown(r)), check_result, "figures")


def _refuse(reason: str) -> int:
    print(f"error: {reason}", file=sys.stderr)
    return 2


def run_peer(args) -> int:
    """`klrl bench --peer trl`: refused in one line, before anything starts, without the
    `peers` extra (TRL is never a core dependency)."""
    from cluster.bench.peer_trl import missing_extra

    missing = missing_extra()
    if missing:
        print(f"error: klrl bench --peer {args.peer} needs {missing} (the optional peers extra): "
              f"{PEER_EXTRA_HINT}", file=sys.stderr)
        return 2
    # Ray, torch, vLLM and DeepSpeed: loaded when the comparison runs.
    from cluster.bench.peers import (
        PEERS_FULL,
        PEERS_QUICK,
        check_peers,
        print_peer_table,
        run_peers,
    )

    with _work_dir(args.work_dir) as work_dir:
        result = run_peers(PEERS_QUICK if args.quick else PEERS_FULL, args.peer_objective, work_dir)
    return _finish(result, args, print_peer_table, check_peers, "samples/s")


def _finish(result, args, show, check, what: str) -> int:
    """Print the tables, write --json and --docs (the docs page's block rendered from the
    figures), and exit 1 naming any `what` that is missing or not positive."""
    from cluster.bench.report import write_docs
    from cluster.bench.results import write_json

    show(result)
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}")
    if args.docs:
        write_docs(result, args.docs)
        print(f"rewrote the figures block of {args.docs}")
    bad = check(result)
    if bad:
        print(f"error: {what} missing or not positive: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


@contextmanager
def _work_dir(path: str | None):
    if path:
        yield Path(path)
    else:
        with tempfile.TemporaryDirectory(prefix="klrl-bench-") as tmp:
            yield Path(tmp)


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="measure overheads against raw vLLM/DeepSpeed, "
                              "weight-sync latency and async overlap efficiency; --peer trl: "
                              "against TRL's GRPOTrainer",
                              description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--json", default=None, metavar="PATH",
                   help="also write every figure as JSON here")
    p.add_argument("--docs", default=None, metavar="PAGE", help="also rewrite the figures block "
                   "of this docs page (docs/bench.md) from this run: <!-- bench:figures -->; "
                   "with --peer, <!-- bench:peers -->; with --device cuda, <!-- bench:gpu -->")
    p.add_argument("--quick", action="store_true", help="tiny model and batch, one repetition each "
                   "and no warm-up "
                   "(about two minutes; checks the machinery, the figures are noisy)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: the learner "
                   "rank and one rollout worker share one GPU, weight sync against a "
                   "device-to-device copy, end to end at max_lag 0 and 2 (and 2 in flight), "
                   "and the gpu-marked tests (refused without CUDA; docs/bench.md)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="with --device cuda: the learner's dtype (the engine follows it)")
    p.add_argument("--sync-transport", choices=["shm", "object_store", "cuda_ipc"], default=None,
                   help="with --device cuda: the transport the workloads are built for and the "
                   "end-to-end runs sync with (default: cuda_ipc where it exists, else shm); "
                   "the sync part measures shm, object_store and, if chosen, cuda_ipc")
    p.add_argument("--only", action="append", choices=PARTS, default=None, metavar="PART",
                   help=f"run only this part ({', '.join(PARTS)}; repeatable); with --json, "
                   "writes it into that file beside the parts already there (same device)")
    p.add_argument("--from-json", default=None, metavar="PATH", help="measure nothing: print "
                   "the tables of a bench JSON written before (e.g. `make gpu-check`'s, brought "
                   "from a GPU machine) and, with --docs, write them into that page's block for "
                   "the JSON's device (<!-- bench:figures --> or <!-- bench:gpu -->)")
    p.add_argument("--work-dir", default=None, metavar="DIR", help="keep the models and run "
                   "directories here (default: a temporary directory, deleted afterwards)")
    p.add_argument("--peer", choices=["trl"], default=None, help="instead of the measurements "
                   "above, run TRL's GRPOTrainer and klrl on the same model, prompts, batch, "
                   "tokens, learning rate and beta, and compare samples/s and reward gain per "
                   f"1k samples (needs the peers extra: {PEER_EXTRA_HINT}; docs/bench.md)")
    p.add_argument("--peer-objective", choices=["same", "klrl"], default="same",
                   help="with --peer: 'same' trains klrl with TRL's objective (group mean/std "
                   "advantages, K3 in the loss); 'klrl' keeps the demo config's (K1 in the "
                   "reward, RLOO), and the output names the difference")
    p.set_defaults(func=run)
