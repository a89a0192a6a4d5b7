"""Re-formed pipelines as plans (issue 14, part 1): their period against re-routing and Oobleck's model.

Reproduce (about a minute on the shared 2-core machine):

    python bench/bench_reform.py

Unit costs, K = 4 layers per stage (each stage's F = B = W split evenly), every figure a simulated period
of this run: `compile(..., layers=4)` (re-route + re-partition, one partition for every pipeline),
`compile(..., layers=4, reform=...)` (the failed pipeline re-formed over its live workers, the batch
re-balanced by throughput: `schedcomp.reform`), and `compare`'s oobleck (the analytic baseline of
`schedcomp.reformed`: separate 1F1B simulations, no plan), with no memory limit and with the default one
(fault-free ZB-H1's per-stage peaks). Lower is better; CPU seconds are the two compiles'.
"""

from __future__ import annotations

import time

from schedcomp.baselines import compare
from schedcomp.compiler import compile
from schedcomp.errors import SchedcompError
from schedcomp.simulator import simulate

CASES = [  # (pp, dp, M, failed, pipelines re-formed)
    (4, 4, 8, ["3:1"], (3,)),
    (4, 8, 8, ["3:1"], (3,)),  # issue 14's re-cut case (its target: period <= 28)
    (4, 4, 8, ["3:1", "3:2"], (3,)),
    (4, 4, 8, ["3:0", "3:1", "3:2"], (3,)),
    (4, 2, 8, ["1:1"], (1,)),
    (8, 4, 16, ["3:3", "3:5"], (3,)),
    (8, 4, 16, ["1:2", "3:5"], (1, 3)),
]
K = 4


def main() -> None:
    print(f"{'job':14} {'failed':12} {'limit':10} {'re-route':>9} {'reformed':>9} {'oobleck':>8}  how  cpu")
    for pp, dp, m, failed, reform in CASES:
        for limit in (None, "fault-free"):
            t = time.process_time()
            rerouted = simulate(compile(pp=pp, dp=dp, microbatches=m, failed=failed, layers=K,
                                        memory_limit=limit, reform="never")).period
            try:
                plan = compile(pp=pp, dp=dp, microbatches=m, failed=failed, layers=K, reform=reform,
                               memory_limit=limit)
                won = plan.meta["reform"]
                reformed, how = simulate(plan).period, f"{won['shares']} x{won['finer']}"
            except SchedcompError as exc:
                reformed, how = float("nan"), type(exc).__name__
            cpu = time.process_time() - t
            oobleck = next(o.period for o in compare(pp, dp, m, failed, strategies=("oobleck",), layers=K,
                                                     memory_limit=limit))
            print(f"pp{pp} dp{dp} M{m:<5} {','.join(failed):12} {limit or 'none':10} {rerouted:9.2f} {reformed:9.2f} "
                  f"{oobleck:8.2f}  {how}  {cpu:.1f}s")


if __name__ == "__main__":
    main()
