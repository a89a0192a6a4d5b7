"""Timing-core speed: the three callers of `schedcomp.timecore`, each on its own kind of input.

Reproduce (from the repository root):

    python bench/bench_timecore.py              # best of 3 runs per case
    python bench/bench_timecore.py --repeat 5

- `FastTimer.score`: one score of a greedy adaptive schedule (the local search calls it once per move;
  it runs on schedules of at most `adaptive.LOCAL_SEARCH_MAX_OPS` ops), in ms;
- `time_sequences`: the same schedules, and the 98k-op one of bench_compile_speed's largest case, in ms;
- `simulate(plan, 4)`: fault-free families up to pp = 32, dp = 4, M = 128 (checked plans), in s.
Times are CPU seconds of this process (`time.process_time`), the best of `--repeat` runs. It uses
public names only, so the same file times an older checkout (`PYTHONPATH=<checkout> python ...`).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from schedcomp.adaptive import portfolio
from schedcomp.compiler import compile
from schedcomp.costs import CostModel
from schedcomp.route import assign_orphans, balanced_quota
from schedcomp.simulator import simulate
from schedcomp.solvers.greedy import list_schedule
from schedcomp.solvers.improve import FastTimer
from schedcomp.solvers.problem import Problem
from schedcomp.solvers.timing import time_sequences
from schedcomp.topology import Topology

SOLVER_CASES = [(4, 2, 8, [(0, 1)]), (4, 4, 16, [(0, 1), (2, 3)]), (8, 4, 32, [(0, 3), (1, 5)]),
                (16, 64, 32, [((i * 7) % 64, (i * 5) % 16) for i in range(8)])]
PLAN_CASES = [("1f1b", 32, 1, 128), ("zb-h2", 32, 1, 128), ("1f1b", 32, 4, 128), ("zb-h2", 8, 4, 32)]


def best_of(repeat: int, calls: int, fn: Callable[[], object]) -> float:
    """The least CPU time of one call, over `repeat` runs of `calls` calls."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.process_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.process_time() - t0) / calls)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    repeat = parser.parse_args().repeat
    for pp, dp, m, failed in SOLVER_CASES:
        problem = Problem(Topology.of(pp, dp, failed), m, CostModel.uniform(pp))
        quota = balanced_quota(problem)
        seqs = list_schedule(problem, portfolio(problem)[0], assign_orphans(problem, quota), quota)
        n_ops = problem.n_slots * len(problem.kinds)
        line = f"adaptive pp{pp} dp{dp} M{m} ({n_ops} ops):"
        if n_ops <= 5000:
            timer = FastTimer(problem, 4)
            line += f" FastTimer.score {best_of(repeat, 20, lambda t=timer, s=seqs: t.score(s)) * 1e3:.2f} ms,"
        timing = time_sequences(problem, seqs, 4)
        ms = best_of(repeat, 5, lambda p=problem, s=seqs: time_sequences(p, s, 4)) * 1e3
        print(f"{line} time_sequences {ms:.2f} ms (period {timing.period:g})")
    for family, pp, dp, m in PLAN_CASES:
        plan = compile(pp, dp, m, schedule=family)
        sim = simulate(plan, 4)
        s = best_of(repeat, 1, lambda p=plan: simulate(p, 4))
        print(f"{family} pp{pp} dp{dp} M{m}: simulate {s:.3f} s (period {sim.period:g})")


if __name__ == "__main__":
    main()
