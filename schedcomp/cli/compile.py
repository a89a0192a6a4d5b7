"""`schedcomp compile`: compile a (failure-aware) plan, validate it and save it."""

from __future__ import annotations

import argparse
import time
from typing import Any

from schedcomp.cli.common import (
    MEMORY_LIMIT_HELP,
    add_chunk_arguments,
    add_failure_arguments,
    add_layer_arguments,
    layer_options,
    load_costs,
    memory_limit,
    positive_float,
    positive_int,
    reform_text,
    save_and_report,
)


def add_job_arguments(p: argparse.ArgumentParser, *, failures: bool = True) -> None:
    """--pp --dp --microbatches [--fail D:S ...] --costs --memory-limit, shared with `compare`."""
    p.add_argument("--pp", type=positive_int, required=True, help="pipeline stages")
    p.add_argument("--dp", type=positive_int, default=1, help="data-parallel pipelines (default 1)")
    p.add_argument("--microbatches", "-m", type=positive_int, required=True,
                   help="micro-batches per pipeline and iteration")
    if failures:
        add_failure_arguments(p)
    p.add_argument("--costs", metavar="FILE", help="cost model JSON (default: F = B = W = 1, no communication)")
    p.add_argument("--memory-limit", type=memory_limit, metavar="X", help=MEMORY_LIMIT_HELP)


SOLVERS = ("auto", "greedy", "cpsat")
"""`schedcomp.adaptive.SOLVERS`, repeated so building the parser imports no solver (a test checks)."""


def add_solver_arguments(p: argparse.ArgumentParser, default: str = "auto") -> None:
    p.add_argument("--solver", choices=SOLVERS, default=default,
                   help=f"auto: CP-SAT where it can finish in --time-limit, else greedy (default {default})")
    p.add_argument("--time-limit", type=positive_float, default=10.0, metavar="SECONDS",
                   help="solver time limit (default 10)")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "compile",
        help="compile a plan, with failed workers re-routed, and save it",
        description="Compile and validate a plan for PP stages x DP pipelines. With failed workers (or "
        "--schedule adaptive) their micro-batches are re-routed to live peers of the same stage, the backward is "
        "split and the optimizer staggered. Example: schedcomp compile --pp 4 --dp 2 --microbatches 8 --fail 1:2 "
        "-o plan.json",
    )
    add_job_arguments(p)
    p.add_argument("--schedule", default="adaptive", metavar="NAME",
                   help="adaptive (default), or a fault-free family: gpipe, 1f1b, zb-h1, zb-h2, interleaved-1f1b, zb-v")
    add_chunk_arguments(p)
    add_layer_arguments(p)
    add_solver_arguments(p)
    p.add_argument("--recut", action="store_true",
                   help="with failures, split the failed workers' micro-batches into pieces sized for the peers "
                   "that take them (samples are interchangeable within a global batch)")
    p.add_argument("--reform", type=reform_text, default="auto", metavar="auto|never|D,D,...",
                   help="with --layers or --layer-costs and failures: auto (default) also compiles the pipelines that "
                   "lost workers re-formed over their live workers, the batch re-balanced by throughput, and keeps the "
                   "faster plan; never only re-routes; D,D,... re-forms these pipelines (every one that lost workers)")
    p.add_argument("-o", "--output", metavar="FILE", help="write the plan as JSON")
    p.add_argument("--text", action="store_true", help="write the compact text form instead of JSON")
    p.add_argument("--json", action="store_true",
                   help="print makespan, period, bubble_ratio, peak_memory (per worker and stage, against "
                   "memory_limit), lower_bound, solver, compile_seconds")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from schedcomp.compiler import compile
    from schedcomp.gcpause import paused_gc
    from schedcomp.heap import keep_freed_memory
    from schedcomp.memory import FAULT_FREE

    keep_freed_memory()  # (a process of its own: freed blocks reused, not faulted in afresh each phase)

    costs = load_costs(args.costs, None)  # `compile` checks its stages (pp, or pp x chunks)
    # The collector stays paused to the end (see `schedcomp.gcpause`): resumed between the library's paused
    # stages, it walked their millions of new objects to free nothing (1 s of 69 collections at pp = 32, dp = 256).
    with paused_gc():
        began = time.perf_counter()
        plan = compile(args.pp, dp=args.dp, microbatches=args.microbatches, failed=args.failed,
                       schedule=args.schedule, costs=costs, memory_limit=args.memory_limit or FAULT_FREE,
                       solver=args.solver, time_limit=args.time_limit, chunks=args.chunks, placement=args.placement,
                       recut=args.recut, reform=args.reform, **layer_options(args))
        seconds = time.perf_counter() - began
        save_and_report(args, plan, "compiled", "compile_seconds", seconds)
        del plan  # (freed while paused: resumed first, the collector would walk it once more)
    return 0

