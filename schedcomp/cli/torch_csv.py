"""`schedcomp export-torch` / `import-torch`: PyTorch pipelining's compute-only CSV schedules."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from schedcomp.cli.common import load_costs, load_plan, positive_int, read_text, write_text


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "export-torch",
        help="write a plan as a PyTorch compute-only CSV schedule",
        description="Write a fault-free plan as the compute-only CSV (each action names its stage, so ranks with "
        "several stages, interleaved or V, are written too) that "
        "torch.distributed.pipelining schedules load with _load_csv. Example: "
        "schedcomp export-torch plan.json -o schedule.csv",
    )
    p.add_argument("plan", help="a saved plan (JSON or text form)")
    p.add_argument("-o", "--output", metavar="FILE", help="the CSV file (default: standard output)")
    p.set_defaults(run=export_torch)

    p = subparsers.add_parser(
        "import-torch",
        help="read a PyTorch compute-only CSV schedule into a plan",
        description="Read a compute-only CSV schedule (one row per rank, actions like 0F1, 0I1, 0W1, 0B1), add "
        "communication, validate, and save the plan. A rank whose row names several stages (4F0) holds virtual "
        "stages: the chunks and their placement (interleaved or V) are read off the CSV, and --costs then gives "
        "one entry per virtual stage. Example: "
        "schedcomp import-torch schedule.csv --pp 4 --microbatches 8 -o plan.json",
    )
    p.add_argument("csv", help="the CSV schedule")
    p.add_argument("--pp", type=positive_int, help="ranks per pipeline (default: the number of rows)")
    p.add_argument("--microbatches", "-m", type=positive_int, help="micro-batches (default: 1 + the largest)")
    p.add_argument("--dp", type=positive_int, default=1, help="data-parallel pipelines running the schedule")
    p.add_argument("--costs", metavar="FILE", help="cost model JSON for the plan (default: the unit model)")
    p.add_argument("-o", "--output", metavar="FILE", help="the plan JSON (default: standard output)")
    p.set_defaults(run=import_torch)


def export_torch(args: argparse.Namespace) -> int:
    from schedcomp.serialize import plan_to_torch_csv

    return _emit(args.output, plan_to_torch_csv(load_plan(args.plan)), "CSV")


def import_torch(args: argparse.Namespace) -> int:
    from schedcomp.gcpause import paused_gc

    with paused_gc():  # a batch of millions of acyclic objects: see `schedcomp.gcpause`
        text = _import(args)
    return _emit(args.output, text, "plan")


def _emit(output: str | None, text: str, what: str) -> int:
    """Write `text` to the `-o` file (atomically), or to stdout when none is given."""
    if output:
        write_text(output, text, what)
    else:
        sys.stdout.write(text)
    return 0


def _import(args: argparse.Namespace) -> str:
    """The plan JSON of the CSV schedule `args.csv`: parsed, lowered and checked."""
    from schedcomp.check import check
    from schedcomp.compiler import unit_costs
    from schedcomp.errors import PlanFormatError
    from schedcomp.lower import lower
    from schedcomp.serialize import order_from_torch_csv, plan_to_json

    text = read_text(args.csv, "CSV schedule")
    try:
        order = order_from_torch_csv(text, pp=args.pp, microbatches=args.microbatches, dp=args.dp)
    except PlanFormatError as exc:
        raise PlanFormatError(f"{args.csv}: {exc}") from None
    costs = load_costs(args.costs, order.topology.stages) or unit_costs(order.topology)
    plan = lower(order, costs)
    check(plan)
    return plan_to_json(plan)
