"""`schedcomp show`: compile (or load) a plan, simulate it, draw it and summarise it."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from schedcomp.cli.common import (
    ArgumentError,
    add_plan_source,
    plan_facts,
    plan_from_args,
    positive_int,
    print_json,
    terminal_width,
    use_color,
)
from schedcomp.errors import SchedcompError
from schedcomp.timeline import Span, timeline_metrics

if TYPE_CHECKING:
    from schedcomp.ir import Plan
    from schedcomp.simulator import Simulation
    from schedcomp.topology import Worker


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "show",
        help="draw a schedule's timeline and summarise it",
        description="Compile a schedule (or load a saved plan), simulate it over its cost model, and print a "
        "timeline per worker and a summary. Examples: schedcomp show --schedule zb-h1 --pp 4 --microbatches 8; "
        "schedcomp show plan.json --png plan.png --html plan.html",
    )
    add_plan_source(p)
    out = p.add_argument_group("simulation and output")
    out.add_argument("--iterations", type=positive_int, default=4, help="iterations to simulate (default 4)")
    out.add_argument("--sync-optimizer", action="store_true",
                     help="a global barrier after every optimizer step (default: staggered per stage)")
    out.add_argument("--draw-iterations", type=positive_int, default=1, metavar="N",
                     help="iterations to draw (default 1)")
    out.add_argument("--png", metavar="FILE", help="write a Gantt chart (PNG)")
    out.add_argument("--svg", metavar="FILE", help="write a Gantt chart (SVG)")
    out.add_argument("--html", metavar="FILE",
                     help="write an interactive timeline (one self-contained file: hover, zoom, pan)")
    out.add_argument("--workers", metavar="D:S,...", type=worker_filter,
                     help="draw only these workers: D:S patterns with * or ranges a-b, e.g. "
                     "'*:0-1' (stages 0 and 1 of every pipeline) or '0:*,3:*'")
    out.add_argument("--trace", metavar="FILE", help="write a Chrome/Perfetto trace of every simulated iteration")
    out.add_argument("--measured", metavar="TRACE",
                     help="a measured Chrome trace to draw beside the plan, with planned against measured peak "
                     "memory per worker when it carries memory (profile=True)")
    out.add_argument("--json", action="store_true", help="print the summary as JSON instead of drawing")
    out.add_argument("--width", type=positive_int, help="terminal columns (default: the terminal's)")
    out.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                     help="colour the timeline (default: only on a terminal)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from schedcomp.simulator import simulate

    if args.draw_iterations > args.iterations:
        raise ArgumentError(f"--draw-iterations {args.draw_iterations} is more than --iterations {args.iterations}")
    plan = plan_from_args(args)
    sim = simulate(plan, iterations=args.iterations, synchronous_optimizer=args.sync_optimizer)
    summary = {**plan_facts(plan, sim.memory), **sim.summary()}
    drawn = sim.spans_in(range(args.draw_iterations))
    measured = _measured(args.measured, args.draw_iterations, plan) if args.measured else None
    if measured is not None:
        summary["measured"] = measured["summary"]
        for line in measured["warnings"]:
            print(line, file=sys.stderr)
    _write_files(args, plan.family or "plan", summary, drawn, sim, measured, frozenset(plan.topology.failed))
    if args.json:
        print_json(summary)
        return 0
    from schedcomp.draw.terminal import (
        has_rerouted,
        legend_categories,
        render_legend,
        render_summary,
        render_timeline,
    )

    color = use_color(args.color)
    width = args.width or terminal_width()
    what = "iteration 0" if args.draw_iterations == 1 else f"iterations 0-{args.draw_iterations - 1}"
    title = f"{plan.family or 'plan'}: {summary['topology']}, {plan.microbatches} micro-batches ({what}, simulated)"
    keep = args.workers or (lambda w: True)
    rows = [w for w in sim.workers if keep(w)]
    out = [render_timeline([s for s in drawn if keep(s.worker)], width=width, color=color, iterations=None,
                           workers=rows, title=title, failed=[w for w in plan.topology.failed if keep(w)])]
    if measured is not None:
        out.append(render_timeline([s for s in measured["spans"] if keep(s.worker)], width=width, color=color,
                                   iterations=None, title=f"measured: {args.measured}", unit=measured["unit"]))
    shown = [*drawn, *(measured["spans"] if measured is not None else [])]
    out.append(render_legend(color, legend_categories(shown), rerouted=has_rerouted(shown)))
    out.append(render_summary(summary, "summary"))
    if measured is not None:
        out.append(render_summary({**measured["summary"], "iterations": measured["iterations"]},
                                  f"measured ({measured['unit']})"))
        if measured["summary"].get("memory"):
            from schedcomp.draw.terminal import render_memory

            out.append(render_memory(measured["summary"]["memory"], width=width))
    print("\n".join(out), end="")
    return 0


def _measured(path: str, draw_iterations: int, plan: Plan) -> dict[str, Any]:
    """A measured trace: its metrics (seconds), its first iterations, shifted to start at 0, in ms or s,
    and, where it carries memory, each worker's planned against measured peak (with warnings)."""
    from schedcomp.draw.trace import read_chrome_trace
    from schedcomp.memory import over_plan_warnings, planned_vs_measured
    from schedcomp.profile import measured_peaks

    spans = read_chrome_trace(path)
    iterations = sorted({s.iteration for s in spans})
    timing = timeline_metrics(spans)
    keep = set(iterations[:draw_iterations])
    shown = [s for s in spans if s.iteration in keep]
    t0 = min(s.start for s in shown)
    scale, unit = (1e3, "ms") if timing.period < 1.0 else (1.0, "s")
    shown = [dataclasses.replace(s, start=(s.start - t0) * scale, end=(s.end - t0) * scale) for s in shown]
    summary = {"makespan": timing.makespan * scale, "period": timing.period * scale,
               "bubble_ratio": timing.bubble_ratio, "unit": unit}
    warnings: list[str] = []
    if measured_peaks(spans):
        rows = planned_vs_measured(plan, spans)
        summary["memory"] = rows
        warnings = over_plan_warnings(rows)
    return {"spans": shown, "summary": summary, "unit": unit, "iterations": len(iterations), "warnings": warnings}


def _write_files(
    args: argparse.Namespace,
    name: str,
    summary: dict[str, Any],
    drawn: Sequence[Span],
    sim: Simulation,
    measured: dict | None,
    failed: frozenset[Worker],
) -> None:
    """The files asked for: a trace of every simulated iteration, charts of the drawn ones."""
    if args.trace:
        from schedcomp.draw.trace import write_chrome_trace

        write_chrome_trace(sim.spans, args.trace)
    if not (args.png or args.svg or args.html):
        return
    from schedcomp.draw.gantt import Panel, draw_gantt

    panels = [Panel(f"{name}: {summary['topology']}, {summary['microbatches']} micro-batches (simulated)", drawn,
                    failed=failed)]
    if measured is not None:
        panels.append(Panel(f"measured: {args.measured}", measured["spans"], measured["unit"], failed=failed))
    title = (f"period {summary['period']:.4g}, bubble {summary['bubble_ratio']:.1%}, "
             f"peak memory {summary['peak_memory']:.4g} (over {summary['iterations']} iterations, "
             f"{'synchronous' if summary['synchronous_optimizer'] else 'staggered'} optimizer)")
    workers = len({s.worker for s in drawn} | failed)
    if workers > _MANY_WORKERS and args.workers is None:
        print(f"schedcomp: drawing {workers} workers; --workers '*:0-1' draws a few stages", file=sys.stderr)
    for path in (args.png, args.svg):
        if path:
            draw_gantt(panels, path, title=title, keep=args.workers)
    if args.html:
        from schedcomp.draw.html import write_html

        write_html(panels, args.html, title=f"{name}: {title}", keep=args.workers)


_MANY_WORKERS = 64
"""Past this many rows a chart is long; `show` says how to draw fewer."""


def worker_filter(text: str):  # type: ignore[no-untyped-def]
    from schedcomp.draw.layout import parse_worker_filter

    try:
        return parse_worker_filter(text)
    except SchedcompError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
