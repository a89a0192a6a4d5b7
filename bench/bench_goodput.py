"""Whole-run goodput per fault-tolerance strategy (issue 12), the fast rates' fidelity, and the 8,192-GPU month.

Reproduce (about 4 minutes on a loaded 2-core machine):

    python bench/bench_goodput.py            # all three tables
    python bench/bench_goodput.py --quick    # fewer failure sets and seeds, no pp16/pp32 rows

Table 1. Fidelity of the "fast" rates (`schedcomp.goodput.rates`) against the full compiler ("exact":
`schedcomp.baselines.compare` on each failure set): relative throughput under random failure sets of 1-3
workers, per strategy, mean and largest |fast - exact| and how often fast is higher.

Table 2. Relative goodput (useful iterations over the fault-free job's) over 30 days at pp4 dp8 (m=8),
pp16 dp64 (m=32), pp32 dp256 (m=64), per-GPU MTBF 10,000 h and 50,000 h, repair 4 h, checkpoint 60 s
(blocking), restart 600 s, 10 s per iteration, adaptive's measured recovery (`goodput.MEASURED`). Mean over
seeds of the failure model (10 for pp4 dp8, which sees ~2 failures a month, 2 for pp16 dp64, 1 for pp32 dp256).
`ceiling`: the strategy's throughput without failures (oobleck's and bamboo's own 1F1B schedules).

Table 3. Wall time of `goodput(...)` for pp=32 dp=256 (8,192 GPUs), 30 days, per-GPU MTBF 50,000 h, all
strategies, from a cold start (no memo), in this process.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from schedcomp.costs import CostModel
from schedcomp.goodput import STRATEGIES, goodput, poisson_failures, system_mtbf
from schedcomp.goodput.rates import SOURCES, Rates
from schedcomp.topology import Worker

DAY = 86400.0
SHAPES = ((4, 8, 8, 10), (16, 64, 32, 2), (32, 256, 64, 1))  # pp, dp, micro-batches, seeds
MTBFS = (10_000.0, 50_000.0)
SETTINGS = dict(checkpoint_s=60.0, restart_s=600.0, iteration_s=10.0)
REPAIR_S = 4 * 3600.0


def fidelity(sets: int) -> None:
    print("Table 1: fast rates against the full compiler, random failure sets of 1-3 workers")
    print(f"{'shape':>14} {'strategy':>14} {'sets':>5} {'mean |gap|':>10} {'max |gap|':>10} {'fast higher':>11}")
    rng = random.Random(0)
    costs_of = {"unit": lambda pp: CostModel.uniform(pp),
                "uneven": lambda pp: CostModel.uniform(pp, backward_input=1.5, allreduce=0.5, optimizer=0.25)}
    for pp, dp, m in ((4, 8, 8), (8, 4, 16), (8, 8, 16)):
        for label, make in costs_of.items():
            costs = make(pp)
            exact, fast = Rates(pp, dp, m, costs, "exact"), Rates(pp, dp, m, costs, "fast")
            gaps: dict[str, list[float]] = {s: [] for s in SOURCES}
            for _ in range(sets):
                failed = frozenset(Worker(rng.randrange(dp), rng.randrange(pp)) for _ in range(rng.randint(1, 3)))
                for s in SOURCES:
                    gaps[s].append(fast.relative(s, failed) - exact.relative(s, failed))
            for s in SOURCES:
                g = gaps[s]
                print(f"{f'pp{pp} dp{dp} {label}':>14} {s:>14} {len(g):>5} {statistics.mean(map(abs, g)):>10.4f} "
                      f"{max(map(abs, g)):>10.4f} {sum(x > 1e-12 for x in g):>11}", flush=True)


def table(shapes: tuple[tuple[int, int, int, int], ...]) -> None:
    print("\nTable 2: relative goodput over 30 days (mean over seeds; ceiling = without failures)")
    print(f"{'shape':>14} {'MTBF h':>7} {'fails':>6} " + " ".join(f"{s[:12]:>12}" for s in STRATEGIES))
    for pp, dp, m, seeds in shapes:
        for mtbf in MTBFS:
            rows: dict[str, list[float]] = {s: [] for s in STRATEGIES}
            fails, ceiling = [], {}
            for seed in range(seeds):
                f = poisson_failures(pp, dp, 30 * DAY, mtbf, REPAIR_S, seed=seed)
                r = goodput(pp, dp, m, f, duration_s=30 * DAY, system_mtbf_s=system_mtbf(pp, dp, mtbf), **SETTINGS)
                fails.append(len(f))
                for run in r.runs:
                    rows[run.strategy].append(run.relative_goodput)
                    ceiling[run.strategy] = run.ceiling
            print(f"{f'pp{pp} dp{dp} m{m}':>14} {mtbf:>7.0f} {statistics.mean(fails):>6.1f} "
                  + " ".join(f"{statistics.mean(rows[s]):>12.2%}" for s in STRATEGIES), flush=True)
        print(f"{'':>14} {'ceiling':>7} {'':>6} " + " ".join(f"{ceiling[s]:>12.2%}" for s in STRATEGIES))


def month() -> None:
    pp, dp, m, mtbf = 32, 256, 64, 50_000.0
    began = time.perf_counter()
    f = poisson_failures(pp, dp, 30 * DAY, mtbf, REPAIR_S, seed=0)
    r = goodput(pp, dp, m, f, duration_s=30 * DAY, system_mtbf_s=system_mtbf(pp, dp, mtbf), **SETTINGS)
    took = time.perf_counter() - began
    print(f"\nTable 3: pp=32 dp=256 (8,192 GPUs), 30 days, MTBF 50,000 h: {len(f)} failures, {r.scenarios} "
          f"distinct failure sets, {len(r.runs)} strategies, rates {r.fidelity}: {took:.1f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--table", type=int, choices=(1, 2, 3), help="run only this table")
    args = p.parse_args()
    if args.table in (None, 1):
        fidelity(4 if args.quick else 12)
    if args.table in (None, 2):
        table(SHAPES[:1] if args.quick else SHAPES)
    if args.table in (None, 3):
        month()


if __name__ == "__main__":
    main()
