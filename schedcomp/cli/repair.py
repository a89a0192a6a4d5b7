"""`schedcomp repair`: a saved plan and more failed workers in, a locally re-routed plan out at once."""

from __future__ import annotations

import argparse
import time
from typing import Any

from schedcomp.cli.common import add_failure_arguments, load_plan, memory_limit, save_and_report


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "repair",
        help="re-route a saved plan around more failed workers at once (a stop-gap until a full compile)",
        description="Re-route the micro-batches of each newly failed worker to live peers of its stage, keeping the "
        "rest of the plan: a valid plan in a fraction of a second at thousands of workers, slower than a full compile "
        "for the new failure set (which should replace it). Example: schedcomp repair plan.json --fail 3:5 -o "
        "repaired.json",
    )
    p.add_argument("plan", metavar="PLAN", help="a plan saved by `schedcomp compile -o` (JSON or text form)")
    add_failure_arguments(p, note=", repaired one after another")
    p.add_argument("-o", "--output", metavar="FILE", help="write the repaired plan as JSON")
    p.add_argument("--text", action="store_true", help="write the compact text form instead of JSON")
    p.add_argument("--no-check", action="store_true",
                   help="skip checking the repaired plan (seconds at thousands of workers; the runtime must not "
                   "run an unchecked plan)")
    p.add_argument("--memory-limit", type=memory_limit, metavar="X",
                   help="activation memory per worker (default: the plan's own limit, or a fault-free plan's own "
                   "per-stage peaks; none lifts it; else as in compile)")
    p.add_argument("--json", action="store_true", help="print the repaired plan's facts, period and repair_seconds")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from schedcomp.errors import TopologyError
    from schedcomp.memory import FAULT_FREE
    from schedcomp.repair import repair

    if not args.failed:
        raise TopologyError("name the newly failed worker: --fail D:S (repeat it for several)")
    plan = load_plan(args.plan)
    began = time.perf_counter()
    for worker in args.failed:
        plan = repair(plan, worker, validate=not args.no_check, memory_limit=args.memory_limit or FAULT_FREE)
    seconds = time.perf_counter() - began
    save_and_report(args, plan, "repaired", "repair_seconds", seconds, simulated=not args.no_check)
    return 0
