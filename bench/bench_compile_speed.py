"""Compile speed, phase by phase: building the order (`adaptive_order` or the family), `lower`,
`check`, and `compile(...)` end to end, against the targets of issues 2 and 3.

Reproduce (from the repository root):

    python bench/bench_compile_speed.py              # best of 3 runs per case
    python bench/bench_compile_speed.py --repeat 1   # one run per case

Times are CPU seconds of this process (`time.process_time`: everything here is single-threaded, so
that is what an idle machine's wall clock would show, and it does not depend on how busy the shared
machine is; `--wall` for wall time), the best of `--repeat` runs. `total` is one call of
`schedcomp.compile(...)`, timed separately (it includes building the topology and cost model).
Targets: issue 3, greedy compile of pp = 16, dp = 64, M = 32 with 8 failures under 2 s; issue 2,
compile + validate up to pp = 32, M = 128 under 1 s (dp = 1 and dp = 4).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from schedcomp.adaptive import adaptive_order
from schedcomp.check import check
from schedcomp.compiler import compile
from schedcomp.costs import CostModel
from schedcomp.lower import lower
from schedcomp.schedules import fault_free_order
from schedcomp.topology import Topology


def spread_failures(pp: int, dp: int, k: int) -> list[tuple[int, int]]:
    """`k` failed workers in distinct pipelines, spread over the stages."""
    return [((i * 7) % dp, (i * 5) % pp) for i in range(k)]


CASES: list[tuple[str, dict[str, Any], float]] = [
    ("adaptive pp16 dp64 M32 8 fail", {"pp": 16, "dp": 64, "microbatches": 32,
                                       "failed": spread_failures(16, 64, 8), "solver": "greedy"}, 2.0),
    ("adaptive pp8 dp4 M32 2 fail", {"pp": 8, "dp": 4, "microbatches": 32,
                                     "failed": [(0, 3), (1, 5)], "solver": "greedy"}, 2.0),
    ("1f1b pp32 dp1 M128", {"pp": 32, "dp": 1, "microbatches": 128, "schedule": "1f1b"}, 1.0),
    ("zb-h2 pp32 dp1 M128", {"pp": 32, "dp": 1, "microbatches": 128, "schedule": "zb-h2"}, 1.0),
    ("1f1b pp32 dp4 M128", {"pp": 32, "dp": 4, "microbatches": 128, "schedule": "1f1b"}, 1.0),
    ("zb-h2 pp32 dp4 M128", {"pp": 32, "dp": 4, "microbatches": 128, "schedule": "zb-h2"}, 1.0),
]


def phases(kw: dict[str, Any], clock: Callable[[], float]) -> tuple[float, float, float, float]:
    """(order, lower, check, compile) seconds for one case."""
    topo = Topology.of(kw["pp"], kw["dp"], kw.get("failed", ()))
    costs = CostModel.uniform(kw["pp"])
    t0 = clock()
    if topo.failed:
        order, bound, solver = adaptive_order(topo, kw["microbatches"], costs, solver=kw["solver"])
    else:
        order, bound, solver = fault_free_order(kw["schedule"], topo, kw["microbatches"]), None, ""
    t1 = clock()
    plan = lower(order, costs, solver=solver, lower_bound=bound)
    t2 = clock()
    check(plan)
    t3 = clock()
    compile(**kw)
    t4 = clock()
    return t1 - t0, t2 - t1, t3 - t2, t4 - t3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--wall", action="store_true", help="wall-clock time instead of CPU time")
    args = parser.parse_args()
    clock = time.perf_counter if args.wall else time.process_time
    header = ("case", "adaptive_order s", "lower s", "check s", "total s", "target s", "ok")
    rows = []
    for name, kw, target in CASES:
        runs = [phases(kw, clock) for _ in range(max(1, args.repeat))]
        best = [min(r[i] for r in runs) for i in range(4)]
        rows.append((name, *(f"{x:.3f}" for x in best), f"< {target:g}", "yes" if best[3] < target else "NO"))
    widths = [max(len(str(r[c])) for r in (header, *rows)) for c in range(len(header))]
    for r in (header, tuple("-" * w for w in widths), *rows):
        print(" | ".join(str(x).ljust(w) for x, w in zip(r, widths, strict=True)).rstrip())


if __name__ == "__main__":
    main()
