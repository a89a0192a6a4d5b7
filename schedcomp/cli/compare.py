"""`schedcomp compare`: every fault-tolerance strategy on the same job, failures and costs."""

from __future__ import annotations

import argparse
import math
from typing import Any

from schedcomp.cli.common import add_chunk_arguments, add_layer_arguments, layer_options, load_costs, print_json

STRATEGIES = (
    "fault-free", "adaptive", "adaptive-no-split", "adaptive-no-stagger", "adaptive-reformed", "drop-pipeline",
    "oobleck", "bamboo",
)
"""`schedcomp.baselines.STRATEGIES`, repeated so building the parser imports no solver (a test checks)."""


def register(subparsers: Any) -> None:
    from schedcomp.cli.compile import add_job_arguments, add_solver_arguments

    p = subparsers.add_parser(
        "compare",
        help="simulate every fault-tolerance strategy side by side",
        description="Simulate fault-free, adaptive (ours), its ablations, drop-pipeline, oobleck and bamboo on "
        "the same job, failures and cost model; print each one's period, throughput relative to fault-free and "
        "peak memory. Example: schedcomp compare --pp 8 --dp 4 --microbatches 16 --fail 1:3 --fail 2:5",
    )
    add_job_arguments(p)
    add_chunk_arguments(p)
    add_layer_arguments(p)
    p.add_argument("--strategy", action="append", choices=STRATEGIES, metavar="NAME",
                   help=f"only these strategies (repeat; default all: {', '.join(STRATEGIES)}; adaptive-reformed only "
                   "with --layers or --layer-costs)")
    add_solver_arguments(p, default="greedy")
    p.add_argument("--recut", action="store_true",
                   help="adaptive may also split the failed workers' micro-batches into pieces sized for the peers "
                   "that take them (as compile --recut)")
    p.add_argument("--json", action="store_true",
                   help="print a list of {strategy, period, relative_throughput, peak_memory, memory_limit, "
                   "within_memory_limit} (and with --layers the adaptive partition and the pipelines it re-formed)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from schedcomp.baselines import compare
    from schedcomp.memory import FAULT_FREE

    chunks = args.chunks or (2 if args.placement == "v" else 1)
    costs = load_costs(args.costs, args.pp if chunks == 1 else None)  # (with chunks `compare` checks it)
    strategies = tuple(args.strategy) if args.strategy else None
    outcomes = compare(args.pp, args.dp, args.microbatches, args.failed, costs, strategies=strategies,
                       solver=args.solver, time_limit=args.time_limit, memory_limit=args.memory_limit or FAULT_FREE,
                       chunks=chunks, placement=args.placement or "loop", recut=args.recut, **layer_options(args))
    if args.json:
        print_json([o.to_dict() for o in outcomes])
        return 0
    failed = ", ".join(str(w) for w in sorted(set(args.failed))) or "none"
    print(f"pp={args.pp} dp={args.dp} micro-batches={args.microbatches} failed: {failed}")
    limit = outcomes[0].memory_limit if outcomes else None
    print(f"  memory limit: {limit if limit is not None else 'none'} (every strategy that schedules is held to it)")
    print(f"  {'strategy':<21} {'period':>10} {'throughput':>11} {'peak memory':>12}")
    for o in outcomes:
        period = f"{o.period:10.4g}" if math.isfinite(o.period) else f"{'stopped':>10}"
        memory = f"{o.peak_memory:12.4g}" if math.isfinite(o.period) else f"{'-':>12}"
        notes = [o.note] if o.note else []
        if o.strategy in ("adaptive", "adaptive-reformed") and o.partition is not None:
            kept = " in the others" if o.reformed else ""
            notes.append(f"layers per stage {','.join(map(str, o.partition))}{kept}")
        if o.within_memory_limit is False:
            notes.append("over the memory limit")
        note = f"  ({'; '.join(notes)})" if notes else ""
        print(f"  {o.strategy:<21} {period} {o.relative_throughput:10.1%} {memory}{note}")
    return 0
