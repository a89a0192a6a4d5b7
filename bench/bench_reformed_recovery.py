"""A resilient job's recovery onto a re-formed plan, against the same job recovering onto the re-routed plan.

The job of `tests/fault/test_fault_reformed.py` (pp = 3, dp = 2, M = 3, 6 processes on CPU/gloo, a 6-layer
float64 `nn.Sequential` of Linear(8, 8) + Tanh blocks, Adam, 2 rows per micro-batch): worker 1:1 SIGKILLs itself
in the middle of iteration 1 and the survivors roll back and switch. Two plan caches, the same but for that
failure's plan: `re-routed` (what `precompile(layers=2, reform="never")` compiles: one partition for every
pipeline, 1:1's work on its peer) and `re-formed` (`compile(..., reform=(1,))`: pipeline 1 over its places 0
and 2, layers 2 and 3 moved there from 0:1, shares 3.6 / 2.4, one collective per segment). Per run: `recovered`,
seconds from the death to the re-run iteration completed on every survivor (detection, agreement, regroup, layer
moves, re-run); `ready`, the median survivor's seconds from noticing the failure to running the new plan
(`Recovery.ready`); `iteration`, the median wall seconds per iteration after the recovery (every survivor done,
consecutive iterations). The model is tiny, so these are the runtime's overheads, not compute; `period` is the simulated
period of the failure plan over the fault-free one (the cost model's, what the compiler optimises).

Reproduce (about 30 s per run on a 2-core machine):

    python bench/bench_reformed_recovery.py              # 2 rounds of both caches, alternating
    python bench/bench_reformed_recovery.py --rounds 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve()
SUPPORT = HERE.parent.parent / "tests" / "support"
sys.path.insert(0, str(SUPPORT))

ITERATIONS = 8


def run(plans: Path, victim: str, index: int) -> dict[str, dict]:
    """The job on `plans` with `victim` killed before instruction `index` of iteration 1; each survivor's result."""
    from fault_procs import run_job
    from reformed_cache import DP, PP

    results, _ = run_job(PP, DP, ["--respawn", "0"], [str(SUPPORT / "resilient_procs.py"), "resilient",
                                                      str(ITERATIONS), str(plans), f"{victim}@1.{index}", "-1"], 400.0)
    return results


def measure(results: dict[str, dict]) -> tuple[float, float, float]:
    """(recovered, ready, iteration) of one run (module docstring)."""
    killed = next(r["killed_at"] for r in results.values() if r["killed_at"] is not None)
    (rerun,) = {rec["rerun"] for r in results.values() for rec in r["recoveries"]}
    done = {i: max(r["completed_at"][str(i)] for r in results.values()) for i in range(rerun, ITERATIONS)}
    ready = statistics.median(rec["ready"] for r in results.values() for rec in r["recoveries"])
    return done[rerun] - killed, ready, statistics.median(done[i] - done[i - 1] for i in range(rerun + 1, ITERATIONS))


def main() -> None:
    from reformed_cache import VICTIM, reformed_cache

    from schedcomp.cache import precompile
    from schedcomp.simulator import simulate

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    os.environ["CHAOS_MOVES"] = "6"  # the workers' model: the 6-layer nn.Sequential, Adam
    with tempfile.TemporaryDirectory(prefix="schedcomp-bench-") as tmp:
        caches = {"re-routed": Path(tmp) / "rerouted", "re-formed": Path(tmp) / "reformed"}
        precompile(3, 2, 3, 1, time_limit=1.0, layers=2, reform="never", directory=caches["re-routed"])
        reformed_cache(caches["re-formed"])
        from schedcomp.cache import PlanCache

        periods, index = {}, 0
        for name, directory in caches.items():
            cache = PlanCache.load(directory)
            periods[name] = simulate(cache.lookup([VICTIM])).period / simulate(cache.lookup([])).period
            index = len(cache.lookup([]).streams[VICTIM]) // 2
        print(f"pp=3 dp=2 M=3, 6 layers, victim {VICTIM} at 1.{index}, {ITERATIONS} iterations; uptime: "
              f"{os.getloadavg()[0]:.2f} load")
        print(f"{'plan':>10} {'round':>5} {'recovered s':>11} {'ready s':>8} {'iteration s':>11} {'period':>7}")
        for round_ in range(args.rounds):
            for name, directory in caches.items():
                recovered, ready, iteration = measure(run(directory, str(VICTIM), index))
                print(f"{name:>10} {round_:>5} {recovered:>11.3f} {ready:>8.3f} {iteration:>11.3f} "
                      f"{periods[name]:>7.3f}", flush=True)


if __name__ == "__main__":
    main()
