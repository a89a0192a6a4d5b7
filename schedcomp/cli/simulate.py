"""`schedcomp simulate`: the metrics of a saved plan over its cost model."""

from __future__ import annotations

import argparse
from typing import Any

from schedcomp.cli.common import load_plan, plan_facts, positive_int, print_json


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="simulate a saved plan and print its metrics",
        description="Validate a saved plan, simulate it for K iterations and print makespan, period, bubble ratio "
        "and peak memory. Example: schedcomp simulate plan.json --iterations 8 --json",
    )
    p.add_argument("plan", help="a saved plan (JSON or text form)")
    p.add_argument("--iterations", "-k", type=positive_int, default=4, help="iterations to simulate (default 4)")
    p.add_argument("--sync-optimizer", action="store_true",
                   help="a global barrier after every optimizer step (default: staggered per stage)")
    p.add_argument("--json", action="store_true", help="print the metrics as JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from schedcomp.simulator import simulate

    plan = load_plan(args.plan)
    sim = simulate(plan, iterations=args.iterations, synchronous_optimizer=args.sync_optimizer)
    summary = {**plan_facts(plan, sim.memory), **sim.summary()}
    if args.json:
        print_json(summary)
    else:
        from schedcomp.draw.terminal import render_summary

        print(render_summary(summary, f"simulated {args.plan}"), end="")
    return 0
