"""Pieces the subcommands share: argument types, reading plans, building them from arguments."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Iterable, Mapping
from typing import Any, NoReturn

from schedcomp import fileio
from schedcomp.costs import CostModel
from schedcomp.errors import PlanFormatError, SchedcompError
from schedcomp.ir import Plan
from schedcomp.topology import Worker


class ArgumentError(SchedcompError):
    """A bad command-line argument (argparse's complaint, as one of ours)."""


class Parser(argparse.ArgumentParser):
    """An ArgumentParser that raises instead of printing usage and exiting, so errors stay one line."""

    def error(self, message: str) -> NoReturn:
        # main() prefixes "schedcomp: error: ", so name only the subcommand (the program name once).
        command = self.prog.partition(" ")[2]
        raise ArgumentError(f"{command + ': ' if command else ''}{message} (see {self.prog} --help)")


def one_line(text: str) -> str:
    return " ".join(text.split())


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def memory_limit(text: str) -> str:
    """--memory-limit: fault-free, none, a family name, a number or a size such as 60GiB (checked here,
    resolved by `compile` against the cost model)."""
    from schedcomp.errors import MemoryLimitError
    from schedcomp.memory import FAULT_FREE, NO_LIMIT, parse_memory
    from schedcomp.schedules import FAMILIES

    name = text.strip().lower()
    if name in (FAULT_FREE, NO_LIMIT) or name in FAMILIES:
        return name
    try:
        parse_memory(text)
    except MemoryLimitError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text.strip()


MEMORY_LIMIT_HELP = ("activation memory per worker: fault-free (default: with failures, at most what fault-free "
                     "ZB-H1 holds on each stage), a family name (its per-stage peak), none (no limit), a number "
                     "in the cost model's unit, or bytes such as 60GiB with a measured cost model")


def worker(text: str) -> Worker:
    try:
        return Worker.parse(text)
    except SchedcompError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_failure_arguments(parser: Any, note: str = "") -> None:
    """`--fail D:S` (repeat it) and `--failed D:S [D:S ...]`, one list: every command spells failures alike."""
    parser.add_argument("--fail", dest="failed", type=worker, action="append", default=[], metavar="D:S",
                        help=f"a failed worker (pipeline:stage); repeat for several{note}")
    parser.add_argument("--failed", dest="failed", type=worker, action="extend", nargs="+", metavar="D:S",
                        help="the same, several at once (--failed 1:2 3:0)")


def read_text(path: str, what: str) -> str:
    """A UTF-8 regular file within the size limit (`/dev/zero` and 40 GB files are refused unread)."""
    return fileio.read_text(path, what, PlanFormatError)


def write_text(path: str, text: str | Iterable[str], what: str) -> None:
    """Write atomically: a full disk or a crash leaves the old file whole; the error names the path."""
    fileio.write_atomic(path, text, SchedcompError)


def load_plan(path: str, validate: bool = True) -> Plan:
    """Read a saved plan (JSON or text form) and, by default, validate it."""
    from schedcomp.check import check
    from schedcomp.serialize import read_plan

    text = read_text(path, "plan")
    try:
        plan = read_plan(text)
    except PlanFormatError as exc:
        raise PlanFormatError(f"{path}: {exc}") from None
    if validate:
        check(plan)
    return plan


def load_costs(path: str | None, pp: int | None) -> CostModel | None:
    """The cost model at `path` (None without one), with one entry per stage of `pp` (None: `compile`
    checks it, against the virtual stages when the schedule has chunks)."""
    if path is None:
        return None
    costs = CostModel.load(path)
    if pp is not None and costs.pp != pp:
        raise SchedcompError(f"{path} has costs for {costs.pp} stages but --pp is {pp}: give one entry per stage")
    return costs


def partition_text(text: str) -> tuple[int, ...]:
    """--partition 4,4,3,5: layers per stage (checked against the stages by `compile`)."""
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layers per stage such as 4,4,3,5, got {text!r}") from None
    if any(n < 1 for n in counts):
        raise argparse.ArgumentTypeError(f"every stage needs at least one layer, got {text!r}")
    return counts


def reform_text(text: str) -> str | tuple[int, ...]:
    """--reform auto, never, or 3 or 1,3: pipeline numbers (checked against the job by `compile`)."""
    if text in ("auto", "never"):
        return text
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto, never or pipeline numbers such as 3 or 1,3, got {text!r}"
                                         ) from None


def add_layer_arguments(parser: Any) -> None:
    """--layers K | --layer-costs FILE, and --partition: re-partition layers as well as re-route."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--layers", type=positive_int, metavar="K",
                       help="K layers per stage, each stage's costs split evenly: with failures the adaptive "
                       "schedule may move layer boundaries off stages that lost workers")
    group.add_argument("--layer-costs", metavar="FILE",
                       help="per-layer costs JSON (format schedcomp-layer-costs), instead of --costs and --layers")
    parser.add_argument("--partition", type=partition_text, metavar="N,N,...",
                        help="the job's layers per stage (default: even), with --layers or --layer-costs")


def layer_options(args: argparse.Namespace) -> dict[str, Any]:
    """`compile`'s and `compare`'s layers= and partition= from `add_layer_arguments`' flags."""
    layers: Any = args.layers
    if args.layer_costs is not None:
        from schedcomp.layers import LayerCosts

        layers = LayerCosts.load(args.layer_costs)
    if layers is None and args.partition is None:
        return {}
    return {"layers": layers, "partition": args.partition}


CHUNKS_HELP = ("virtual stages (model chunks) per worker, for interleaved-1f1b, zb-v and adaptive (default 2 for the "
               "families); the model then has pp x chunks stages and --costs gives one entry per virtual stage")
PLACEMENT_HELP = ("where the adaptive schedule puts the chunks: loop (virtual stage s on worker s mod pp, as "
                  "interleaved-1f1b; the default) or v (as zb-v, 2 chunks); a family places its own")


def add_chunk_arguments(parser: Any) -> None:
    """--chunks and --placement (an argument parser or group)."""
    parser.add_argument("--chunks", type=positive_int, help=CHUNKS_HELP)
    parser.add_argument("--placement", choices=("loop", "v"), help=PLACEMENT_HELP)


def add_plan_source(parser: argparse.ArgumentParser) -> None:
    """The arguments that name a plan: a saved file, or a schedule family to compile."""
    from schedcomp.schedules import FAMILIES

    parser.add_argument("plan", nargs="?", help="a saved plan (JSON or text form) instead of --schedule ...")
    group = parser.add_argument_group("compile a schedule")
    group.add_argument("--schedule", metavar="NAME",
                       help=f"schedule family: {', '.join(FAMILIES)} (or adaptive)")
    group.add_argument("--pp", type=positive_int, help="pipeline stages")
    group.add_argument("--microbatches", "-m", type=positive_int, help="micro-batches per pipeline and iteration")
    group.add_argument("--dp", type=positive_int, default=1, help="data-parallel pipelines (default 1)")
    add_chunk_arguments(group)
    add_failure_arguments(group, "; they use the adaptive schedules")
    group.add_argument("--costs", metavar="FILE", help="cost model JSON (default: F = B = W = 1, no communication)")
    group.add_argument("--memory-limit", type=memory_limit, metavar="X", help=MEMORY_LIMIT_HELP)
    group.add_argument("--solver", default="auto", help="solver for adaptive schedules (default auto)")
    group.add_argument("--time-limit", type=positive_float, default=10.0, help="solver time limit, seconds")


def plan_from_args(args: argparse.Namespace) -> Plan:
    """The plan named by `add_plan_source`'s arguments: loaded and validated, or compiled."""
    compile_flags = [f for f in ("schedule", "pp", "microbatches", "costs", "memory_limit", "chunks", "placement")
                     if getattr(args, f)]
    if args.plan is not None:
        if args.failed:
            compile_flags.append("failed")
        if compile_flags:
            flags = ", ".join("--" + f.replace("_", "-") for f in compile_flags).replace("--failed", "--fail")
            raise ArgumentError(f"give either a plan file or {flags}, not both")
        return load_plan(args.plan)
    if args.schedule is None and args.failed:  # failed workers run the adaptive schedules anyway
        args.schedule = "adaptive"
    missing = [f"--{f}" for f in ("schedule", "pp", "microbatches") if getattr(args, f) is None]
    if missing:
        raise ArgumentError(f"give a plan file, or --schedule, --pp and --microbatches (missing {', '.join(missing)})")
    from schedcomp.compiler import compile
    from schedcomp.memory import FAULT_FREE

    return compile(args.pp, dp=args.dp, microbatches=args.microbatches, failed=args.failed, schedule=args.schedule,
                   costs=load_costs(args.costs, None), memory_limit=args.memory_limit or FAULT_FREE,
                   solver=args.solver, time_limit=args.time_limit, chunks=args.chunks, placement=args.placement)


def plan_facts(plan: Plan, peaks: Mapping[Worker, float] | None = None) -> dict[str, Any]:
    """The plan's shape and its memory against the limit (`peaks`: each worker's, if known already)."""
    from schedcomp.memory import limit_facts

    topo = plan.topology
    failed = ",".join(str(w) for w in sorted(topo.failed))
    chunks = {"chunks": topo.chunks, "placement": topo.placement} if topo.chunks > 1 else {}
    return {
        **chunks,
        "family": plan.family,
        "solver": plan.solver,
        "topology": f"pp={topo.pp} dp={topo.dp}" + (f" failed={failed}" if failed else ""),
        "pp": topo.pp,
        "dp": topo.dp,
        "failed": [str(w) for w in sorted(topo.failed)],
        "microbatches": plan.microbatches,
        "lower_bound": plan.lower_bound,
        **limit_facts(plan, peaks),
    }


def print_json(data: Any) -> None:
    print(fileio.dumps_json(data, indent=2))  # never NaN/Infinity: those are refused, not printed


def save_and_report(args: argparse.Namespace, plan: Plan, done: str, seconds_key: str, seconds: float, *,
                    simulated: bool = True) -> None:
    """Write the plan to `--output` (JSON, or `--text`), then print its facts, simulated metrics and the
    seconds it took (`--json`, under `seconds_key`; or a summary saying it was `done` in that time): what
    `compile` and `repair` end with. `simulated=False` leaves the metrics out (the simulator would check
    the plan first)."""
    from schedcomp.serialize import plan_json_pieces
    from schedcomp.simulator import simulate

    if args.output:  # (JSON in pieces: a large plan's text is never held whole)
        write_text(args.output, plan.to_text() if args.text else plan_json_pieces(plan), "plan")
    sim = simulate(plan) if simulated else None
    summary = {**plan_facts(plan, sim.memory if sim else None), **(sim.summary() if sim else {}),
               "lower_bound": plan.lower_bound, "solver": plan.solver, seconds_key: round(seconds, 4),
               **({"cut": plan.cut.to_json()} if plan.cut else {}),
               **({"partition": list(plan.partition)} if plan.partition is not None else {}),
               **({"repartition": plan.meta["repartition"]} if "repartition" in plan.meta else {}),
               **({"reform": plan.meta["reform"]} if "reform" in plan.meta else {}),
               **({"choice": plan.meta["choice"]} if "choice" in plan.meta else {})}
    if args.json:
        print_json(summary)
    else:
        from schedcomp.draw.terminal import render_summary

        where = f" -> {args.output}" if args.output else ""
        print(render_summary(summary, f"{done} in {seconds:.2f} s{where}"), end="")


def use_color(choice: str) -> bool:
    if choice != "auto":
        return choice == "always"
    return sys.stdout.isatty() and "NO_COLOR" not in os.environ and os.environ.get("TERM") != "dumb"


def terminal_width() -> int:
    return max(40, min(240, shutil.get_terminal_size((100, 24)).columns))
