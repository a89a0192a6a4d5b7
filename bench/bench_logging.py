"""Logging-based recovery (SWIFT) against checkpoint-restart when a stage loses every replica, CPU/gloo.

Reproduce (about 15 minutes on a 2-core machine; `--quick`: one model size, two intervals, about 5):

    python bench/bench_logging.py
    python bench/bench_logging.py --quick
    python bench/bench_logging.py --overhead     # only Table 2
    python bench/bench_logging.py --helpers 1 3 --rows 1024   # only Table 3: parallel replay, k = 0, 1, 3

The job: pp = 4, dp = 1 (4 processes, so every death loses a whole stage), 4 micro-batches, the
chaos-test model of `tests/support/resilient_procs.py` at two widths (hidden 8 and 512: 0.6 KB and
2 MB of parameters per stage), Momentum SGD, an asynchronous checkpoint every `every` iterations
(2, 4, 8), launched with `--respawn 1 --max-restarts 1`. Stage 1 SIGKILLs itself late in iteration
3 x every - 1 (so about `every` iterations lie between its newest checkpoint and the death), and
the same job runs twice with the same death:

- `logging s`: `ResilientTrainer(logging=LoggingPolicy("memory"))`: the survivors keep their state,
  the replacement restores stage 1's checkpoint and replays from its neighbours' logs. Seconds
  from the death to the iteration in flight at the death completed on every worker.
- `restart s`: the same job without logging: every worker is stopped and restarted from the
  newest complete checkpoint and re-runs the iterations since; seconds to the same point.
- `replayed`: iterations the replacement replayed (`replay s`: how long, of `logging s`);
  `lost`: iterations every worker re-ran after the restart.
- `step ms` (no logging / logging): median time between consecutive iterations' STEP on each
  worker, without logging in the restarted run, with logging before the death; `overhead`:
  their ratio - 1 (noisy on a loaded machine: a few iterations of a few milliseconds each).
  `log B/it`: boundary bytes the whole job logs per iteration (each worker's `Report.log_bytes`, summed).

Table 2 (`--overhead`, in one process, seconds): what logging adds to one worker's iteration, the
part the end-to-end step times above cannot resolve: `BoundaryLog.add` of a middle stage's sends
(4 micro-batches of 2 x hidden float64 each way) and the pruning, in host memory and on local disk;
median of 200 iterations. (Random layers cost the log nothing: each micro-batch's forward draws from
a stream of its own, `runtime.rng`, which a replay derives again; its cost is `bench_rng.py`'s.)

Table 3 (`--helpers K ...`): the same death with logging, the replacement replaying alone (k = 0) and
with k = K idle survivors helping (`LoggingPolicy(helpers=K)`, `fault.swift_parallel`), one after
the other in one run; a heavier replay (`--rows`, default 128 per micro-batch, hidden 512, checkpoints
every 8: 7 iterations replayed). `replay s`: the replacement's replay (receiving its share of the
logs, the replayers' group, the forwards, backwards, gradient sums and steps), `helpers s`: the
slowest helper's; `death s`: from the death to the iteration in flight completed on every worker.

Both recovery times include process start-up of the replacement (logging) or of every worker
(restart): on this machine the start-up (importing torch) dominates restart, and replay is short
because the model is small; the shape of the comparison is the point, not the absolute seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROCS = os.path.join(ROOT, "tests", "support", "swift_procs.py")
PP, DP, MICROBATCHES, LOST = 4, 1, 4, 1


def job(plans: str, iterations: int, victims: str, every: int, where: str, hidden: int, helpers: int = 0,
        rows: int = 2) -> dict[str, dict]:
    """Launch the job; each worker's last JSON line (a later run's or replacement's wins)."""
    with tempfile.TemporaryDirectory(prefix="schedcomp-ckpt-") as ckpt:
        run = subprocess.run([sys.executable, "-m", "schedcomp.runtime.fault.launch", "--pp", str(PP), "--dp", str(DP),
                              "--respawn", "1", "--max-restarts", "1", "--", sys.executable, PROCS, str(iterations),
                              plans, ckpt, victims, str(every), where, str(1 << 30), str(hidden), "0",
                              str(helpers), "none", str(rows)],
                             capture_output=True, text=True, timeout=600)
    results = {r["worker"]: r for r in (json.loads(line) for line in run.stdout.splitlines() if line.startswith("{"))}
    if run.returncode != 0 or len(results) != PP * DP:
        raise RuntimeError(f"the job failed ({run.returncode}):\n{run.stderr[-3000:]}")
    return results


def until(results: dict[str, dict], iteration: int) -> float:
    """Seconds from the death to `iteration` completed on every worker."""
    killed = next(r["killed_at"] for r in results.values() if r["killed_at"] is not None)
    return max(r["completed_at"][str(iteration)] for r in results.values()) - killed


def step_seconds(results: dict[str, dict], iterations: range) -> float:
    """Median time between consecutive STEPs of `iterations` on each worker, over every worker."""
    gaps = [r["completed_at"][str(i)] - r["completed_at"][str(i - 1)] for r in results.values()
            for i in iterations if str(i) in r["completed_at"] and str(i - 1) in r["completed_at"]]
    return statistics.median(gaps)


def overhead(sizes: list[int], repeats: int = 200) -> None:
    """Table 2: milliseconds logging adds to one worker's iteration (see the module docstring)."""
    import time

    import torch

    from schedcomp.runtime.fault.boundary_log import BoundaryLog, LoggingPolicy
    from schedcomp.semantics import ACT, GRAD
    from schedcomp.topology import Worker

    print("\nTable 2: logging's cost per worker and iteration (middle stage, 4 micro-batches), median ms")
    print(f"{'hidden':>6} {'memory ms':>9} {'disk ms':>8} {'bytes/it':>9}")
    for hidden in sizes:
        sent = {(d, 1, (0, m)): (torch.randn(2, hidden, dtype=torch.float64),) for d in (ACT, GRAD) for m in range(4)}
        row = []
        with tempfile.TemporaryDirectory(prefix="schedcomp-log-") as folder:
            for where in ("memory", folder):
                log = BoundaryLog(LoggingPolicy(where), Worker(0, 1))
                times = []
                for i in range(repeats):
                    began = time.perf_counter()
                    log.add(i, sent)
                    log.prune(0, i - 4)
                    log.prune(2, i - 4)
                    times.append(time.perf_counter() - began)
                row.append(statistics.median(times))
        nbytes = sum(t.numel() * t.element_size() for ts in sent.values() for t in ts)
        print(f"{hidden:>6} {1e3 * row[0]:>9.3f} {1e3 * row[1]:>8.3f} {nbytes:>9}", flush=True)


def parallel(sizes: list[int], helpers: list[int], every: int = 8, rows: int = 128) -> None:
    """Table 3: replay alone against replay with each of `helpers` idle survivors (see the module docstring)."""
    from schedcomp.cache import precompile

    print(f"\nTable 3: parallel replay, pp={PP} dp={DP} (stage {LOST} lost), {MICROBATCHES} micro-batches of {rows} "
          f"rows, checkpoint every {every}")
    print(f"{'hidden':>6} {'k':>2} {'replayed':>8} {'replay s':>8} {'helpers s':>9} {'death s':>8}  replayers")
    at = 3 * every - 1
    with tempfile.TemporaryDirectory(prefix="schedcomp-bench-") as plans:
        precompile(PP, DP, MICROBATCHES, 0, directory=plans, time_limit=1.0)
        for hidden in sizes:
            for k in (0, *helpers):
                results = job(plans, at + 2, f"0:{LOST}@{at}.{2 * MICROBATCHES + 2}", every, "memory", hidden, k,
                              rows)
                assert all(r["run"] == 0 for r in results.values()), "logging fell back to a restart"
                rebuilt = results[f"0:{LOST}"]
                helped = [r["replay_seconds"] for r in results.values() if r["helped"] is not None]
                print(f"{hidden:>6} {k:>2} {len(rebuilt['replayed']):>8} {rebuilt['replay_seconds']:>8.3f} "
                      f"{max(helped, default=0.0):>9.3f} {until(results, at):>8.3f}  "
                      f"{','.join(rebuilt['replayed_with'])}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="hidden 8 only, every 2 and 4")
    parser.add_argument("--sizes", type=int, nargs="+", help="model widths (default 8 512)")
    parser.add_argument("--overhead", action="store_true", help="only Table 2 (in one process, seconds)")
    parser.add_argument("--helpers", type=int, nargs="+", help="only Table 3: replay alone and with these many helpers")
    parser.add_argument("--rows", type=int, default=128, help="Table 3: rows per micro-batch")
    args = parser.parse_args()
    if args.helpers is not None:
        parallel(args.sizes or [512], args.helpers, rows=args.rows)
        return
    from schedcomp.cache import precompile

    if args.overhead:
        overhead(args.sizes or [8, 512])
        return

    sizes, intervals = ([8], [2, 4]) if args.quick else ([8, 512], [2, 4, 8])
    sizes = args.sizes or sizes
    print(f"pp={PP} dp={DP} (stage {LOST} lost), {MICROBATCHES} micro-batches: death -> the iteration in flight "
          "completed on every worker")
    print(f"{'hidden':>6} {'every':>5} {'logging s':>9} {'replayed':>8} {'replay s':>8} {'restart s':>9} "
          f"{'lost':>4} {'log/restart':>11} {'step ms':>7} {'+log ms':>7} {'overhead':>8} {'log B/it':>9}")
    with tempfile.TemporaryDirectory(prefix="schedcomp-bench-") as plans:
        precompile(PP, DP, MICROBATCHES, 0, directory=plans, time_limit=1.0)
        for hidden in sizes:
            for every in intervals:
                at = 3 * every - 1
                victims = f"0:{LOST}@{at}.{2 * MICROBATCHES + 2}"  # late: most of its backwards done
                logged = job(plans, at + 2, victims, every, "memory", hidden)
                plain = job(plans, at + 2, victims, every, "none", hidden)
                assert all(r["run"] == 0 for r in logged.values()), "logging fell back to a restart"
                assert all(r["run"] == 1 for r in plain.values()), "the job was not restarted"
                rebuilt = logged[f"0:{LOST}"]
                ours, theirs = until(logged, at), until(plain, at)
                lost = next(iter(plain.values()))["iterations_lost"]
                # without logging: the restarted run's iterations (the only ones it reports), none after a death
                with_log, without = step_seconds(logged, range(1, at)), step_seconds(plain, range(1, at + 2))
                per_it = statistics.mean(sum(r["log_bytes"].get(str(i), 0) for r in logged.values())
                                         for i in range(at))
                print(f"{hidden:>6} {every:>5} {ours:>9.3f} {len(rebuilt['replayed']):>8} "
                      f"{rebuilt['replay_seconds']:>8.4f} {theirs:>9.3f} {lost:>4} {ours / theirs:>11.3f} "
                      f"{1e3 * without:>7.2f} {1e3 * with_log:>7.2f} {with_log / without - 1:>8.1%} {per_it:>9.0f}",
                      flush=True)
    overhead(sizes)


if __name__ == "__main__":
    main()
