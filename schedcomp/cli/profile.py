"""`schedcomp profile`: measured traces in, a cost model (milliseconds) out."""

from __future__ import annotations

import argparse
from typing import Any

from schedcomp.cli.common import positive_int


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "profile",
        help="turn measured runtime traces into a cost model",
        description="Read Chrome traces written by the runtime (PipelineTrainer(profile=True).save_trace) and "
        "write a cost model in milliseconds: median F, B, W per stage, p2p, all-reduce and optimizer times, and "
        "(when the trace carries memory) activation bytes per micro-batch and the share B frees. "
        "Example: schedcomp profile trace.json -o costs.json, then schedcomp show --costs costs.json ...",
    )
    p.add_argument("traces", nargs="+", metavar="TRACE", help="measured trace JSON files (one run each)")
    p.add_argument("-o", "--output", metavar="FILE", help="write the cost model here (default: print it)")
    p.add_argument("--base", metavar="FILE",
                   help="cost model to take activation memory, b_frees and memory limit from (default: units)")
    p.add_argument("--b-share", type=float, default=0.5,
                   help="share of a fused backward (BW) given to B where B and W were not measured apart (0.5)")
    p.add_argument("--skip", type=positive_int, default=1, help="warm-up iterations left out of each trace (1)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from schedcomp.costs import CostModel
    from schedcomp.profile import profile_costs, read_trace

    base = CostModel.load(args.base) if args.base else None
    costs = profile_costs([read_trace(t) for t in args.traces], base=base, b_share=args.b_share,
                          skip=args.skip)
    text = costs.to_json()
    if args.output:
        costs.save(args.output)
        print(f"wrote {args.output}: {_summary(costs)}")
    else:
        print(text, end="")
    return 0


def _summary(costs: Any) -> str:
    def ms(values: tuple[float, ...]) -> str:
        return "/".join(f"{v:.3g}" for v in values)

    memory = ""
    if costs.memory_unit == "bytes":
        from schedcomp.memory import show_memory

        frees = costs.b_frees if isinstance(costs.b_frees, tuple) else (costs.b_frees,) * costs.pp
        memory = (f"; activations {' / '.join(show_memory(a, costs) for a in costs.activation)} per micro-batch, "
                  f"B frees {' / '.join(f'{f:.0%}' for f in frees)}")
    return (f"F {ms(costs.forward)} B {ms(costs.backward_input)} W {ms(costs.backward_weight)} ms per stage, "
            f"p2p {costs.p2p:.3g} ms{memory}")
