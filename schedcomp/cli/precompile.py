"""`schedcomp precompile`: a plan for every failure scenario up to k failures, into a plan cache."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from schedcomp.cli.common import ArgumentError, load_costs, positive_int


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
    p.add_argument("--max-failures", "-k", type=int, required=True, metavar="K", help="most failed workers at once")
    add_solver_arguments(p, default="greedy")
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="directory for the cache")
    p.add_argument("--jobs", "-j", type=positive_int, default=min(4, os.cpu_count() or 1),
                   help="compile in this many processes (default: CPUs, at most 4)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from schedcomp.cache import precompile

    if args.max_failures < 0:
        raise ArgumentError(f"--max-failures must be at least 0, got {args.max_failures}")
    from schedcomp.memory import FAULT_FREE

    costs = load_costs(args.costs, args.pp)
    began = time.perf_counter()
    bar = None if args.quiet else ProgressBar()
    cache = precompile(args.pp, args.dp, args.microbatches, args.max_failures, costs=costs, solver=args.solver,
                       time_limit=args.time_limit, memory_limit=args.memory_limit or FAULT_FREE,
                       directory=args.output, progress=bar, jobs=args.jobs)
    if bar:
        bar.close()
    print(f"{len(cache)} plans for pp={args.pp} dp={args.dp} M={args.microbatches} with up to {args.max_failures} "
          f"failures in {time.perf_counter() - began:.1f} s -> {args.output}")
    report = cache.memory_report()
    within = sum(r["within_memory_limit"] for r in report)
    headroom = [r["memory_headroom"] for r in report if "memory_headroom" in r]
    least = f", least headroom {min(headroom):.4g}" if headroom else ""
    print(f"peak memory within the limit in {within}/{len(report)} plans{least}")
    return 0


class ProgressBar:
    """`[#####.....] 12/73  f0.3-1.5  4.2 s` on stderr, redrawn in place on a terminal, every 10% otherwise."""

    def __init__(self, width: int = 30) -> None:
        self.width = width
        self.began = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self.shown = -1

    def __call__(self, done: int, total: int, name: str) -> None:
        tenth = done * 10 // max(1, total)
        if not self.tty and tenth == self.shown and done != total:
            return
        self.shown = tenth
        filled = self.width * done // max(1, total)
        line = (f"[{'#' * filled}{'.' * (self.width - filled)}] {done}/{total}  {name}  "
                f"{time.perf_counter() - self.began:.1f} s")
        sys.stderr.write(("\r" + line.ljust(79)) if self.tty else line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")
