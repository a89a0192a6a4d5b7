"""`schedcomp goodput`: training delivered by each fault-tolerance strategy over a whole run with failures."""

from __future__ import annotations

import argparse
import math
from typing import Any

from schedcomp.cli.common import load_costs, positive_float, positive_int, print_json
from schedcomp.cli.progress import ProgressBar
from schedcomp.errors import SchedcompError

STRATEGIES = ("adaptive", "lossy", "logging", "checkpoint-restart", "checkpoint-restart-best", "drop-pipeline",
              "oobleck", "bamboo")
"""`schedcomp.goodput.STRATEGIES`, repeated so building the parser imports no solver (a test checks)."""
DEFAULTS = {"days": 30.0, "repair_hours": 4.0, "checkpoint_seconds": 60.0, "restart_seconds": 600.0}


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (0 <= value < math.inf):
        raise argparse.ArgumentTypeError(f"must be a finite number, at least 0, got {text}")
    return value


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "goodput",
        help="simulate a whole run under failures: goodput per fault-tolerance strategy",
        description="Simulate a training run under a failure process (per-GPU MTBF, or a trace) and report, "
        "per strategy, useful iterations per hour and the fraction of the fault-free job's. Example: schedcomp "
        "goodput --pp 32 --dp 256 --microbatches 64 --days 30 --gpu-mtbf-hours 50000 --iteration-seconds 10",
    )
    p.add_argument("--pp", type=positive_int, required=True, help="pipeline stages")
    p.add_argument("--dp", type=positive_int, default=1, help="data-parallel pipelines (default 1)")
    p.add_argument("--microbatches", "-m", type=positive_int, required=True,
                   help="micro-batches per pipeline and iteration")
    p.add_argument("--costs", metavar="FILE", help="cost model JSON (default: F = B = W = 1, no communication)")
    p.add_argument("--days", type=positive_float, default=DEFAULTS["days"], help="length of the run (default 30)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--gpu-mtbf-hours", type=positive_float, metavar="H",
                        help="per-GPU mean time between failures (exponential failures)")
    source.add_argument("--trace", metavar="FILE", help="failure trace CSV: time_s, node or d:s, down_s per row")
    p.add_argument("--gpus-per-node", type=positive_int, default=1, metavar="G",
                   help="GPUs per node: a failure takes the whole node (default 1)")
    p.add_argument("--repair-hours", type=non_negative_float, default=DEFAULTS["repair_hours"], metavar="R",
                   help="hours until a failed node is back (with --gpu-mtbf-hours; default 4)")
    p.add_argument("--checkpoint-seconds", type=non_negative_float, default=DEFAULTS["checkpoint_seconds"],
                   metavar="C", help="seconds training is blocked per checkpoint (default 60)")
    p.add_argument("--restart-seconds", type=non_negative_float, default=DEFAULTS["restart_seconds"],
                   metavar="S", help="seconds to restart the job from a checkpoint (default 600)")
    p.add_argument("--iteration-seconds", type=positive_float, metavar="T",
                   help="seconds per fault-free iteration (default: the plan's period, costs in seconds)")
    p.add_argument("--no-spares", action="store_true",
                   help="checkpoint-restart waits for the repair instead of restarting on a spare at once")
    p.add_argument("--detection-seconds", type=non_negative_float, metavar="X",
                   help="failure detection time of the recovering strategies (default: measured, 0.041)")
    p.add_argument("--agreement-seconds", type=non_negative_float, metavar="X",
                   help="failure agreement time (default: measured, 0.047)")
    p.add_argument("--switch-seconds", type=non_negative_float, metavar="X",
                   help="plan switch time, also paid when a repaired worker rejoins (default: measured, 0.008)")
    logged = p.add_mutually_exclusive_group()
    logged.add_argument("--logging-overhead", type=non_negative_float, metavar="F",
                        help="the logging strategy's step-time overhead, measured (a fraction: 0.01 is 1 %%; e.g. "
                        "bench/bench_logging.py --overhead's ms over the step's ms)")
    logged.add_argument("--boundary-bytes", type=non_negative_float, metavar="B",
                        help="bytes of one micro-batch's boundary tensor: the overhead is then modelled as the "
                        "host copy of an activation and a gradient per micro-batch (default: neither, 2 %% assumed)")
    p.add_argument("--copy-bytes-per-second", type=positive_float, metavar="W",
                   help="device-to-host copy bandwidth for --boundary-bytes (default 1e10, pageable over PCIe 4)")
    p.add_argument("--strategies", nargs="+", choices=STRATEGIES, metavar="NAME",
                   help=f"only these strategies (default all: {', '.join(STRATEGIES)})")
    p.add_argument("--fidelity", choices=("auto", "exact", "fast"), default="auto",
                   help="exact: compile every failure set; fast: the validated models; auto: exact on small jobs")
    p.add_argument("--seed", type=int, default=0, help="seed of the failure model (default 0)")
    p.add_argument("--json", action="store_true", help="print a list of rows (strategy, goodput, relative_goodput, "
                   "failures, lost_hours, checkpoint_interval_s, ...)")
    p.add_argument("--png", metavar="FILE", help="draw goodput over time, with the failure timeline")
    p.add_argument("--quiet", "-q", action="store_true",
                   help="no progress bar (there is none unless stderr is a terminal)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from schedcomp.goodput import (
        MEASURED,
        LoggingCosts,
        Recovery,
        goodput,
        load_trace,
        observed_mtbf,
        poisson_failures,
        system_mtbf,
    )
    from schedcomp.goodput.failures import HOUR

    duration = args.days * 24 * HOUR
    if args.trace is not None:
        failures = load_trace(args.trace, args.pp, args.dp, gpus_per_node=args.gpus_per_node, duration_s=duration)
        mtbf = observed_mtbf(failures, duration)
    else:
        failures = poisson_failures(args.pp, args.dp, duration, args.gpu_mtbf_hours, args.repair_hours * HOUR,
                                    gpus_per_node=args.gpus_per_node, seed=args.seed)
        mtbf = system_mtbf(args.pp, args.dp, args.gpu_mtbf_hours)
    def given(value: float | None, default: float) -> float:
        return default if value is None else value

    recovery = Recovery(given(args.detection_seconds, MEASURED.detection_s),
                        given(args.agreement_seconds, MEASURED.agreement_s),
                        given(args.switch_seconds, MEASURED.switch_s))
    copy = {} if args.copy_bytes_per_second is None else {"copy_bytes_per_s": args.copy_bytes_per_second}
    if copy and args.boundary_bytes is None:
        raise SchedcompError("--copy-bytes-per-second needs --boundary-bytes (it models the logging overhead)")
    logging = LoggingCosts(overhead=args.logging_overhead, boundary_bytes=args.boundary_bytes, **copy)
    with ProgressBar("goodput", "strategy", quiet=args.quiet) as bar:
        result = goodput(args.pp, args.dp, args.microbatches, failures, duration_s=duration,
                         checkpoint_s=args.checkpoint_seconds, restart_s=args.restart_seconds, system_mtbf_s=mtbf,
                         costs=load_costs(args.costs, args.pp), iteration_s=args.iteration_seconds,
                         recovery=recovery, spares=not args.no_spares,
                         strategies=tuple(args.strategies or STRATEGIES), fidelity=args.fidelity,
                         samples=400 if args.png else 0, progress=bar, logging=logging)
    if args.png:
        from schedcomp.goodput.draw import draw_goodput

        draw_goodput(result, args.png, title=f"pp={args.pp} dp={args.dp}, {args.days:g} days")
    if args.json:
        print_json([r.to_dict() for r in result.runs])
        return 0
    print(f"pp={args.pp} dp={args.dp} micro-batches={args.microbatches}: {args.days:g} days, "
          f"{len(result.failures)} failures (system MTBF {_hours(result.system_mtbf_s)}), fault-free "
          f"{result.fault_free_goodput:.4g} iterations/h, rates: {result.fidelity} ({result.scenarios} failure sets)")
    if "logging" in (args.strategies or STRATEGIES):
        how = "measured" if args.logging_overhead is not None else \
            "modelled" if args.boundary_bytes is not None else "assumed"
        print(f"  logging overhead {result.logging_overhead:.2%} per iteration ({how})")
    print(f"  {'strategy':<24} {'iter/h':>10} {'relative':>9} {'ceiling':>8} {'stops':>6} {'lost h':>8} "
          f"{'ckpt every':>11}")
    for r in result.runs:
        every = _hours(r.checkpoint_interval_s) if r.checkpoint_interval_s is not None else "never"
        print(f"  {r.strategy:<24} {r.goodput:10.4g} {r.relative_goodput:9.2%} {r.ceiling:8.1%} {r.stops:6d} "
              f"{r.lost_hours:8.1f} {every:>11}")
    return 0


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h" if math.isfinite(seconds) else "inf"
