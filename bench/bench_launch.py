"""A resilient job's fixed cost: start, agree on generation 0, train a few iterations, leave.

Reproduce (about 1 minute on a busy 2-core machine):

    python bench/bench_launch.py                       # 1 and 5 iterations, one launch each
    python bench/bench_launch.py --iterations 1 --repeats 3

The job is the chaos tests' (`tests/support/chaos_job.py`: pp = 4, dp = 2, 8 worker processes,
CPU/gloo, `ResilientTrainer` over a precompiled plan cache, no failure), started as the slow tests
start it: `python -m schedcomp.runtime.fault.launch --pp 4 --dp 2 --preload torch,schedcomp.runtime
-- python tests/support/resilient_procs.py resilient N ...`. Columns, seconds from the launch
(`time.time()` when each line of the job's output arrives): `store` the launcher is up and serving
its store (its imports); `sealed` every worker sealed generation 0 (zygote imports, forks, the
workers' start and the agreement); `results` every worker printed its result (training); `exit`
the launcher exited (the workers' and the launcher's way out). `cpu` is the CPU time of every
process of the launch (launcher, zygote, workers). 5 iterations minus 1 is what training costs;
what 1 iteration takes is mostly fixed cost.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))

from chaos_job import DP, MICROBATCHES, PP
from fault_procs import PRELOAD
from resilient_procs import HERE

from schedcomp.cache import precompile


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def launch(cache: str, iterations: int) -> dict[str, float]:
    """One launch of the job; the seconds at which each phase ended, and its CPU seconds."""
    cmd = [sys.executable, "-m", "schedcomp.runtime.fault.launch", "--pp", str(PP), "--dp", str(DP), *PRELOAD,
           "--", sys.executable, str(HERE), "resilient", str(iterations), cache, "", "-1"]
    cpu, start = children_cpu(), time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "FAULT_LOG": "INFO"})
    got: dict[str, float] = {}
    sealed = results = 0
    assert proc.stdout is not None
    for line in proc.stdout:
        now = time.time() - start
        if "store at" in line:
            got["store"] = now
        elif "generation 0 sealed" in line:
            sealed += 1
            got["sealed"] = now
        elif line.startswith("{"):
            results += 1
            got["results"] = now
    code = proc.wait()
    got["exit"] = time.time() - start
    got["cpu"] = children_cpu() - cpu
    if code != 0 or sealed != PP * DP or results != PP * DP:
        raise SystemExit(f"the job failed (exit {code}, {sealed} sealed, {results} results)")
    return got


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, nargs="+", default=[1, 5])
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        precompile(PP, DP, MICROBATCHES, 1, time_limit=1.0, directory=cache)
        print(f"load average {os.getloadavg()[0]:.1f}; pp={PP}, dp={DP}, {PP * DP} workers")
        print("| iterations | store s | sealed s | results s | exit s | cpu s |")
        print("|---|---|---|---|---|---|")
        for iterations in args.iterations:
            for _ in range(args.repeats):
                t = launch(cache, iterations)
                print(f"| {iterations} | {t['store']:.2f} | {t['sealed']:.2f} | {t['results']:.2f} | "
                      f"{t['exit']:.2f} | {t['cpu']:.1f} |", flush=True)
        print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
