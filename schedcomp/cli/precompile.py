"""`schedcomp precompile`: a plan for every failure scenario up to k failures, into a plan cache."""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from schedcomp.cli.common import (
    ArgumentError,
    add_chunk_arguments,
    add_layer_arguments,
    layer_options,
    load_costs,
    positive_int,
)
from schedcomp.cli.progress import ProgressBar


def register(subparsers: Any) -> None:
    from schedcomp.cli.compile import add_job_arguments, add_solver_arguments

    p = subparsers.add_parser(
        "precompile",
        help="compile every failure scenario up to --max-failures into a plan cache",
        description="Compile one plan per distinct failure scenario (failure sets equal up to renumbering the "
        "pipelines share a plan) and write them with an index to DIR, for PlanCache.lookup at run time. Example: "
        "schedcomp precompile --pp 8 --dp 16 --microbatches 16 --max-failures 2 -o plans/",
    )
    add_job_arguments(p, failures=False)
    add_chunk_arguments(p)
    add_layer_arguments(p)
    p.add_argument("--max-failures", "-k", type=int, required=True, metavar="K", help="most failed workers at once")
    add_solver_arguments(p, default="greedy")
    p.add_argument("--recut", action="store_true",
                   help="failure plans may split the failed workers' micro-batches into pieces sized for the peers "
                   "that take them (as compile --recut); the index records it")
    p.add_argument("--reform", choices=("auto", "never"), default="auto",
                   help="with --layers or --layer-costs: auto (default, as compile's) lets a failure plan re-form "
                   "the pipelines that lost workers where that is faster (rollback and restart jobs run them); "
                   "never only re-routes, for lossy and logging-based recovery, which refuse re-formed plans")
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="directory for the cache")
    p.add_argument("--jobs", "-j", type=positive_int, default=min(4, os.cpu_count() or 1),
                   help="compile in this many processes (default: CPUs, at most 4)")
    p.add_argument("--quiet", "-q", action="store_true",
                   help="no progress bar (there is none unless stderr is a terminal)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from schedcomp.cache import precompile

    if args.max_failures < 0:
        raise ArgumentError(f"--max-failures must be at least 0, got {args.max_failures}")
    from schedcomp.memory import FAULT_FREE

    chunks = args.chunks or (2 if args.placement == "v" else 1)
    placement = args.placement or "loop"
    costs = load_costs(args.costs, args.pp if chunks == 1 else None)  # (with chunks `precompile` checks it)
    began = time.perf_counter()
    with ProgressBar("precompile", "plan", quiet=args.quiet) as bar:
        cache = precompile(args.pp, args.dp, args.microbatches, args.max_failures, costs=costs,
                           solver=args.solver, time_limit=args.time_limit,
                           memory_limit=args.memory_limit or FAULT_FREE, directory=args.output, progress=bar,
                           jobs=args.jobs, chunks=chunks, placement=placement, recut=args.recut,
                           reform=args.reform, **layer_options(args))
    print(f"{len(cache)} plans for pp={args.pp} dp={args.dp} M={args.microbatches} with up to {args.max_failures} "
          f"failures in {time.perf_counter() - began:.1f} s -> {args.output}")
    report = cache.memory_report()
    within = sum(r["within_memory_limit"] for r in report)
    headroom = [r["memory_headroom"] for r in report if "memory_headroom" in r]
    least = f", least headroom {min(headroom):.4g}" if headroom else ""
    print(f"peak memory within the limit in {within}/{len(report)} plans{least}")
    if cache.partitions:  # said now, not first when a lossy or logging job refuses the cache
        print(f"{len(cache.partitions)} plans re-form pipelines: rollback and restart run them; for lossy or "
              "logging-based recovery precompile with --reform never")
    return 0
