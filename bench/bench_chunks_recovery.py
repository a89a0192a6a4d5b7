"""Recovery with virtual stages: one chunk per worker against two, the same death, the same job.

Reproduce (about 2 minutes on a 2-core machine):

    python bench/bench_chunks_recovery.py                 # seeds 0 1 2
    python bench/bench_chunks_recovery.py --seeds 0 1 2 3 4

The job: `ResilientTrainer` on the chaos-test model (`tests/support/resilient_procs.py`: one small
float64 layer per (virtual) stage, so two chunks mean twice the layers), pp = 2, dp = 2 (4
processes, CPU/gloo), M = 4, 7 iterations, launched with `--respawn 1`; its plan cache
holds the family's fault-free plan and the re-routed plan for each failed worker
(`chaos_job.precompile_family`). Per seed, one worker SIGKILLs itself at the same fraction of its
iteration-1 stream in every family (1f1b: one stage per worker; interleaved-1f1b and zb-v: two
chunks); the survivors wait at iteration 2 for the replacement to announce itself, which enters at
iteration 4 or 5. Columns (seconds, per seed and family):

- `iteration`: the time of the last iteration (the fault-free plan again), median over the workers;
- `recovered`: from the death to the re-run iteration completed on every survivor (agreement,
  regroup, plan switch, rollback, the re-run);
- `handover`: from the replacement's admission to its state loaded (every chunk it holds, from the
  donor at its place), and the bytes it received.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))

from chaos_job import precompile_family  # the job lives with the tests
from fault_procs import run_job
from resilient_procs import HERE

from schedcomp.cache import PlanCache
from schedcomp.topology import Worker

PP, DP, MICROBATCHES, ITERATIONS = 2, 2, 4, 7
FAMILIES = ("1f1b", "interleaved-1f1b", "zb-v")


def one_run(cache_dir: str, victim: Worker, fraction: float) -> dict[str, float]:
    """Launch the job with `victim` dying at `fraction` of its iteration-1 stream; its timings."""
    plan = PlanCache.load(cache_dir).lookup([])
    index = int(fraction * len(plan.streams[victim]))
    results, _ = run_job(PP, DP, ["--respawn", "1"],
                         [str(HERE), "resilient", str(ITERATIONS), cache_dir, f"{victim}@1.{index}", "2"], 150.0)
    killed = next(r["killed_at"] for r in results.values() if r["killed_at"] is not None)
    survivors = [r for w, r in results.items() if w != str(victim)]
    (rerun,) = {rec["rerun"] for r in survivors for rec in r["recoveries"]}
    joined = results[str(victim)]["rejoined"]

    last, before = str(ITERATIONS - 1), str(ITERATIONS - 2)
    steady = [r["completed_at"][last] - r["completed_at"][before]
              for r in results.values() if before in r["completed_at"]]
    return {"iteration": statistics.median(steady),
            "recovered": max(r["completed_at"][str(rerun)] for r in survivors) - killed,
            "handover": joined["loaded_at"] - joined["admitted_at"], "bytes": joined["received_bytes"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = p.parse_args()
    print(f"pp={PP} dp={DP} M={MICROBATCHES}, {ITERATIONS} iterations, --respawn 1: seconds")
    print(f"{'seed':>4} {'victim':>7} {'at':>5} {'family':>17} {'chunks':>6} {'iteration':>9} {'recovered':>9} "
          f"{'handover':>8} {'bytes':>6}")
    with tempfile.TemporaryDirectory(prefix="schedcomp-bench-") as root:
        caches = {f: precompile_family(Path(root) / f, PP, DP, MICROBATCHES, 1, f) for f in FAMILIES}
        rows: dict[str, list[dict[str, float]]] = {f: [] for f in FAMILIES}
        for seed in args.seeds:
            rng = random.Random(seed)
            victim, fraction = Worker(rng.randrange(DP), rng.randrange(PP)), rng.uniform(0.1, 0.9)
            for family in FAMILIES:
                row = one_run(caches[family], victim, fraction)
                rows[family].append(row)
                chunks = PlanCache.load(caches[family]).chunks
                print(f"{seed:>4} {victim!s:>7} {fraction:>5.2f} {family:>17} {chunks:>6} {row['iteration']:>9.3f} "
                      f"{row['recovered']:>9.3f} {row['handover']:>8.3f} {row['bytes']:>6.0f}", flush=True)
        print("medians:")
        for family in FAMILIES:
            med = {k: statistics.median(r[k] for r in rows[family]) for k in ("iteration", "recovered", "handover")}
            print(f"{'':>4} {'':>7} {'':>5} {family:>17} {'':>6} {med['iteration']:>9.3f} {med['recovered']:>9.3f} "
                  f"{med['handover']:>8.3f}")


if __name__ == "__main__":
    main()
