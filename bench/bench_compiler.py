"""Compiler benchmark: simulated period and bubble against the paper's closed forms, and how long
compile, validate and simulate take up to pp = 32, M = 128.

Reproduce (from the repository root, after `make install` or `pip install -e .`):

    python bench/bench_compiler.py            # both tables
    python bench/bench_compiler.py --quick    # pp <= 8 only, one timing run

Table 1, for uniform stages with times F, B, W and no communication or optimizer cost
(Qi et al., Zero Bubble Pipeline Parallelism, ICLR 2024), the period is M(F+B+W) plus a
bubble of (p-1)(F+B+W) for GPipe and 1F1B, (p-1)(F+B-W) for ZB-H1 and
max(0, (p-1)(F+B-2W)) for ZB-H2, the latter reached with staggered optimizer steps. The
simulated period is over 6 iterations with staggered steps; `sync` is the period with a
global barrier after each step. `sim/closed` is the ratio of the two periods (1.000 = exact).

Table 2: time of `compile` (build the order, lower it and validate it), of `check` (the
validator alone, again), of `simulate` (4 iterations) and of a JSON round trip; the best of
`--repeat` runs, in seconds, with the target of under 1 s each. Everything here is
single-threaded, so the CPU time of this process is what an idle machine's wall clock
would show; it is the default because the machine may be shared (`--wall` for wall time).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

from schedcomp.check import check
from schedcomp.compiler import compile
from schedcomp.costs import CostModel
from schedcomp.ir import Plan
from schedcomp.simulator import simulate
from schedcomp.streamcolumns import instruction_count

FAMILIES = ("gpipe", "1f1b", "zb-h1", "zb-h2")
SHAPES = ((4, 8), (4, 16), (8, 16), (8, 32), (16, 64), (32, 128))
COSTS = ((1.0, 1.0, 1.0), (1.0, 2.0, 1.0), (1.0, 1.5, 0.5))
TIMED = ((8, 32), (16, 64), (32, 128))


def closed_bubble(family: str, pp: int, f: float, b: float, w: float) -> float:
    """Bubble time per iteration of one stage, from the paper (staggered steps for ZB-H2)."""
    return {
        "gpipe": (pp - 1) * (f + b + w),
        "1f1b": (pp - 1) * (f + b + w),
        "zb-h1": (pp - 1) * (f + b - w),
        "zb-h2": max(0.0, (pp - 1) * (f + b - 2 * w)),
    }[family]


def quality_table(shapes: tuple[tuple[int, int], ...]) -> list[str]:
    head = (f"{'F,B,W':<11} {'family':<6} {'pp':>3} {'M':>4} | {'period':>8} {'closed':>8} {'sim/closed':>10} | "
            f"{'bubble':>7} {'closed':>7} | {'sync':>8} | {'memory':>6}")
    rows = [head, "-" * len(head)]
    worst = 0.0
    for f, b, w in COSTS:
        for family in FAMILIES:
            for pp, m in shapes:
                plan = compile(pp, microbatches=m, schedule=family, costs=CostModel.uniform(pp, f, b, w))
                sim = simulate(plan, iterations=6)
                sync = simulate(plan, iterations=2, synchronous_optimizer=True)
                bubble = closed_bubble(family, pp, f, b, w)
                period = m * (f + b + w) + bubble
                worst = max(worst, abs(sim.period / period - 1))
                rows.append(
                    f"{f:g},{b:g},{w:g}{'':<{11 - len(f'{f:g},{b:g},{w:g}')}} {family:<6} {pp:>3} {m:>4} | "
                    f"{sim.period:>8.1f} {period:>8.1f} {sim.period / period:>10.3f} | "
                    f"{sim.bubble_ratio:>7.2%} {bubble / period:>7.2%} | {sync.period:>8.1f} | {sim.peak_memory:>6.1f}"
                )
    rows.append(f"largest |sim/closed - 1| = {worst:.3g}")
    return rows


CLOCK = time.process_time


def best_of(repeat: int, fn: Callable[[], object]) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeat):
        t = CLOCK()
        result = fn()
        best = min(best, CLOCK() - t)
    return best, result


def timing_table(shapes: tuple[tuple[int, int], ...], repeat: int) -> list[str]:
    head = (f"{'family':<6} {'pp':>3} {'M':>4} {'instrs':>7} | {'compile':>8} {'check':>8} {'simulate':>9} "
            f"{'json rt':>8} | {'under 1 s':>9}")
    rows = [head, "-" * len(head)]
    for family in FAMILIES:
        for pp, m in shapes:
            t_compile, plan = best_of(repeat, lambda pp=pp, m=m, family=family: compile(pp, microbatches=m,
                                                                                      schedule=family))
            assert isinstance(plan, Plan)
            t_check, _ = best_of(repeat, lambda plan=plan: check(plan))
            t_sim, _ = best_of(repeat, lambda plan=plan: simulate(plan, iterations=4))
            t_json, _ = best_of(repeat, lambda plan=plan: Plan.from_json(plan.to_json()))
            size = instruction_count(plan.streams)
            ok = "yes" if max(t_compile, t_check, t_sim) < 1.0 else "NO"
            rows.append(f"{family:<6} {pp:>3} {m:>4} {size:>7} | {t_compile:>8.3f} {t_check:>8.3f} {t_sim:>9.3f} "
                        f"{t_json:>8.3f} | {ok:>9}")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="pp <= 8 only and one timing run")
    parser.add_argument("--repeat", type=int, default=3, help="timing runs per cell; the best is shown (default 3)")
    parser.add_argument("--wall", action="store_true", help="time with the wall clock instead of CPU time")
    args = parser.parse_args(argv)
    global CLOCK
    CLOCK = time.perf_counter if args.wall else time.process_time
    shapes = tuple(s for s in SHAPES if not args.quick or s[0] <= 8)
    timed = tuple(s for s in TIMED if not args.quick or s[0] <= 8)
    print("Table 1: simulated period vs closed form (uniform stages, no communication, 6 iterations)\n")
    print("\n".join(quality_table(shapes)))
    clock = "wall-clock" if args.wall else "CPU"
    print(f"\nTable 2: {clock} seconds, best of {1 if args.quick else args.repeat} (unit costs)\n")
    print("\n".join(timing_table(timed, 1 if args.quick else args.repeat)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
