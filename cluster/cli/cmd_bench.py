"""`klrl bench`: throughput against the raw engines and the ideal (see cluster/bench/run.py);
with `--peer trl`, klrl against TRL's GRPOTrainer on the same workloads (cluster/bench/peers.py)."""
from __future__ import annotations

import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

PEER_EXTRA_HINT = "pip install -e '.[peers]'"


def run(args) -> int:
    if args.peer:
        return run_peer(args)
    # Ray, torch, vLLM and DeepSpeed: loaded when the benchmark runs, not at `klrl --help`.
    from cluster.bench.run import FULL, QUICK, check_result, print_tables, run_bench

    plan = QUICK if args.quick else FULL
    with _work_dir(args.work_dir) as work_dir:
        result = run_bench(plan, work_dir)
    return _finish(result, args, print_tables, check_result, "figures")


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
    from cluster.bench.run import write_json

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
    p.add_argument("--json", default=None, metavar="PATH", help="also write every figure as JSON here")
    p.add_argument("--docs", default=None, metavar="PAGE", help="also rewrite the figures block "
                   "of this docs page (docs/bench.md) from this run: <!-- bench:figures --> or, "
                   "with --peer, <!-- bench:peers -->")
    p.add_argument("--quick", action="store_true", help="tiny model and batch, one repetition each "
                   "(about a minute; checks the machinery, the figures are noisy)")
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
