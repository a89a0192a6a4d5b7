"""Compile speed, phase by phase: building the order (`adaptive_order` or the family), `lower`,
`check`, and `compile(...)` end to end, against the targets of issues 2 and 3.

Reproduce (from the repository root):

    python bench/bench_compile_speed.py              # best of 3 runs per case
    python bench/bench_compile_speed.py --repeat 1   # one run per case
    python bench/bench_compile_speed.py --scale      # issue 14: 8,192 GPUs end to end, and plan repair
    python bench/bench_compile_speed.py --scale --repeat 1   # one compile with each list loop (C, Python)
    python bench/bench_compile_speed.py --choice     # issue 14's choice: reform="auto" against "never"

Times are CPU seconds of this process (`time.process_time`: everything here is single-threaded, so
that is what an idle machine's wall clock would show, and it does not depend on how busy the shared
machine is; `--wall` for wall time), the best of `--repeat` runs. `total` is one call of
`schedcomp.compile(...)`, timed separately (it includes building the topology and cost model).
Targets: issue 3, greedy compile of pp = 16, dp = 64, M = 32 with 8 failures under 2 s; issue 2,
compile + validate up to pp = 32, M = 128 under 1 s (dp = 1 and dp = 4).

`--scale` (issue 14, a few minutes): each case in a fresh process, timed from outside (wall, CPU, peak RSS of that
process from `os.wait4`): `schedcomp compile --pp 32 --dp 256 -m 64` with 16 spread failures through the CLI
(import, compile, check, write the plan, simulate the summary; targets < 10 s wall and < 1 GB), `--repeat` times
with the list scheduler's compiled loop and once with its Python loop (the plan's md5 shows they are the same
bytes); the same phases timed in one process (CPU s, and resident memory after each: where the time and the peak
go); and `repair` of that plan for one more failed worker, several workers, each timed inside the process (target <
1 s; wall and CPU s), with the memory the repair allocates (tracemalloc, a second run) and the time of `check` on
the result. Repair needs the plan's timeline (`schedcomp.optimes.op_times`), timed once beforehand as the runtime
would while the plan is in use; each repair edits the compiled plan.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from schedcomp.adaptive import adaptive_order
from schedcomp.check import check
from schedcomp.compiler import compile
from schedcomp.costs import CostModel
from schedcomp.errors import RecoveryError, ValidationError
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


SCALE = {"pp": 32, "dp": 256, "microbatches": 64, "failed": spread_failures(32, 256, 16)}
REPAIRED = [(200, 17), (100, 31), (3, 0), (250, 5), (14, 11), (130, 24)]
"""Workers failed next in the repair case: stages without an earlier failure (17, 24), the last stage, the
first stage (inputs), and stages that lost a worker already (5: 7:5; 11: 105:11, its pipeline 14 lost 14:10)."""


CHOICE_CASES: list[tuple[str, dict[str, Any]]] = [
    ("pp16 dp32 M32 K2 4 fail", {"pp": 16, "dp": 32, "microbatches": 32, "failed": spread_failures(16, 32, 4),
                                 "layers": 2}),
    ("pp4 dp8 M8 K4 3:1", {"pp": 4, "dp": 8, "microbatches": 8, "failed": [(3, 1)], "layers": 4}),
    ("pp8 dp4 M8 K4 0:3,1:3", {"pp": 8, "dp": 4, "microbatches": 8, "failed": [(0, 3), (1, 3)], "layers": 4}),
]
"""Layered jobs with failures for `--choice`: `reform="auto"` against "never" (issue 14's choice)."""


def choice_rows(repeat: int, clock: Callable[[], float]) -> None:
    """`--choice`: per case the compile with `reform="never"` (re-route), the re-formed candidate alone (the
    failed pipelines forced) and `"auto"` (both, the faster kept), each the best of `repeat` runs, taken in
    turn. auto's floor is never + re-formed: what is over it is the choice's own cost."""
    from schedcomp.reform import lost_pipelines

    print("| case | never s | re-formed s | auto s | auto - (never + re-formed) s | auto / never | kept |")
    print("|---|---|---|---|---|---|---|")
    for name, kw in CHOICE_CASES:
        modes = {"never": "never", "re-formed": lost_pipelines(Topology.of(kw["pp"], kw["dp"], kw["failed"])),
                 "auto": "auto"}
        best = dict.fromkeys(modes, math.inf)
        for _ in range(max(1, repeat)):
            for mode, reform in modes.items():
                t0 = clock()
                plan = compile(**kw, schedule="adaptive", solver="greedy", reform=reform)
                best[mode] = min(best[mode], clock() - t0)
        over = best["auto"] - best["never"] - best["re-formed"]
        print(f"| {name} | {best['never']:.2f} | {best['re-formed']:.2f} | {best['auto']:.2f} | {over:+.2f} | "
              f"{best['auto'] / best['never']:.1f} | {plan.meta['choice']['kept']} |", flush=True)


def measured(argv: list[str], env: dict[str, str] | None = None) -> tuple[float, float, float, str]:
    """(wall s, CPU s, peak RSS MB, stdout) of `argv` run as a fresh process (`env`: added to the environment)."""
    began = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    out = proc.stdout.read() if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - began
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(argv)} failed with status {status}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, out


def repair_child() -> None:
    """Compile the scale case, then time `repair` for each of `REPAIRED`: prints one JSON line per worker."""
    import tracemalloc

    from schedcomp.gcpause import paused_gc
    from schedcomp.optimes import op_times
    from schedcomp.repair import repair
    from schedcomp.simulator import simulate

    plan = compile(**SCALE)  # type: ignore[arg-type]
    period = simulate(plan).period
    t0 = time.perf_counter()
    op_times(plan)  # once per plan in use, before any failure
    print(json.dumps({"timeline_s": time.perf_counter() - t0}), flush=True)
    for w in REPAIRED:
        with paused_gc():  # as the runtime would: the plan's millions of objects need no collection
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                fixed = repair(plan, w, validate=False)
            except RecoveryError as exc:  # refused (memory): the runtime compiles instead
                print(json.dumps({"worker": f"{w[0]}:{w[1]}", "repair_s": time.perf_counter() - t0,
                                  "repair_cpu_s": time.process_time() - c0, "refused": str(exc),
                                  "period": period}), flush=True)
                continue
            seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        tracemalloc.start()
        repair(plan, w, validate=False)
        allocated = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
        t0 = time.perf_counter()
        try:
            check(fixed)
            valid = True
        except ValidationError:
            valid = False
        checked = time.perf_counter() - t0
        after = simulate(fixed).period if valid else math.nan
        print(json.dumps({"worker": f"{w[0]}:{w[1]}", "repair_s": seconds, "repair_cpu_s": cpu,
                          "allocated_mb": allocated, "valid": valid, "check_s": checked, "period": period,
                          "repaired_period": after}), flush=True)


def phases_child() -> None:
    """The scale case's phases as `compile` and the CLI run them (the collector paused throughout, as there), in
    one process: prints one JSON line with each phase's CPU seconds and the resident memory (now and peak, MB)
    after it."""
    from schedcomp.gcpause import paused_gc

    with paused_gc():
        _phases()


def _phases() -> None:
    import resource

    from schedcomp.adaptive import ITERATIONS, adaptive_solution
    from schedcomp.compiler import unit_costs
    from schedcomp.fileio import write_atomic
    from schedcomp.memory import FAULT_FREE, resolve_limit
    from schedcomp.serialize import plan_json_pieces
    from schedcomp.simfast import remember, solver_timing
    from schedcomp.simulator import simulate

    row: dict[str, float] = {}
    clock = time.process_time()

    def done(phase: str) -> None:
        nonlocal clock
        now = time.process_time()
        with open("/proc/self/statm") as f:  # (Linux: resident pages now; the peak from getrusage)
            resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
        row.update({f"{phase}_s": now - clock, f"{phase}_mb": resident,
                    f"{phase}_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})
        clock = now

    topo = Topology.of(SCALE["pp"], SCALE["dp"], SCALE["failed"])  # type: ignore[arg-type]
    costs = resolve_limit(FAULT_FREE, topo, SCALE["microbatches"], unit_costs(topo))  # type: ignore[arg-type]
    sol = adaptive_solution(topo, SCALE["microbatches"], costs, solver="auto")  # type: ignore[arg-type]
    done("solve")
    order = sol.order()
    timed = solver_timing(sol.problem, sol.seqs, sol.timing, ITERATIONS, sol.synchronous) if sol.timing else None
    del sol
    done("order")
    plan = lower(order, costs, solver="greedy")  # (as `compiler._adaptive`)
    del order
    done("lower")
    check(plan)
    remember(plan, timed)
    done("check")
    with tempfile.TemporaryDirectory() as tmp:
        write_atomic(os.path.join(tmp, "plan.json"), plan_json_pieces(plan))
    done("json")
    simulate(plan)
    done("simulate")
    print(json.dumps(row), flush=True)


def scale(repeat: int) -> None:
    """The issue-14 table (see the module docstring)."""
    fails = [f"--fail={d}:{s}" for d, s in SCALE["failed"]]  # type: ignore[attr-defined]
    print("| case | wall s | CPU s | peak RSS MB | plan md5 | target |")
    print("|---|---|---|---|---|---|")
    # The compiled list loop `repeat` times, and once the Python one (`SCHEDCOMP_LIST_LOOP`), side by side: the
    # same plan bytes, the difference the loop makes.
    for loop in ["native"] * repeat + ["python"]:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "plan.json")
            argv = [sys.executable, "-m", "schedcomp.cli", "compile", "--pp", "32", "--dp", "256", "-m", "64", *fails,
                    "-o", path, "--json"]
            wall, cpu, rss, out = measured(argv, {"SCHEDCOMP_LIST_LOOP": loop})
            with open(path, "rb") as f:
                digest = hashlib.md5(f.read()).hexdigest()
        facts = json.loads(out)
        print(f"| CLI compile pp32 dp256 M64, 16 failures (period {facts['period']:g}), {loop} list loop | "
              f"{wall:.1f} | {cpu:.1f} | {rss:.0f} | {digest[:8]} | "
              f"< 10 s, < 1 GB: {'yes' if wall < 10 and rss < 1024 else 'NO'} |")
    _, _, _, out = measured([sys.executable, __file__, "--phases-child"])
    row = json.loads(out)
    print("\n| phase (one process) | CPU s | RSS MB after | peak RSS MB |\n|---|---|---|---|")
    for phase in ("solve", "order", "lower", "check", "json", "simulate"):
        print(f"| {phase} | {row[phase + '_s']:.2f} | {row[phase + '_mb']:.0f} | {row[phase + '_peak_mb']:.0f} |")
    print()
    wall, cpu, rss, out = measured([sys.executable, __file__, "--repair-child"])
    print(f"| compile + {len(REPAIRED)} repairs and checks in one process | {wall:.1f} | {cpu:.1f} | {rss:.0f} | |")
    print()
    print("| one more failed worker | repair s (wall) | CPU s | allocated MB | check s | valid | "
          "period before -> after | target |")
    print("|---|---|---|---|---|---|---|---|")
    timeline = math.nan
    for line in out.splitlines():
        r = json.loads(line)
        if "timeline_s" in r:
            timeline = r["timeline_s"]
            continue
        cpu = f"{r['repair_cpu_s']:.3f}" if "repair_cpu_s" in r else ""
        if "refused" in r:
            print(f"| {r['worker']} | {r['repair_s']:.3f} | {cpu} | | | refused: {r['refused']} | | "
                  f"< 1 s: {'yes' if r['repair_s'] < 1 else 'NO'} |")
            continue
        print(f"| {r['worker']} | {r['repair_s']:.3f} | {cpu} | {r['allocated_mb']:.0f} | {r['check_s']:.1f} | "
              f"{'yes' if r['valid'] else 'NO'} | {r['period']:g} -> {r['repaired_period']:g} | "
              f"< 1 s: {'yes' if r['repair_s'] < 1 else 'NO'} |")
    print(f"\nThe plan's timeline (`op_times`, once per plan, before any failure): {timeline:.1f} s wall.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--wall", action="store_true", help="wall-clock time instead of CPU time")
    parser.add_argument("--scale", action="store_true", help="the issue-14 cases instead (minutes)")
    parser.add_argument("--choice", action="store_true", help="reform='auto' against 'never' on layered jobs")
    parser.add_argument("--repair-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--phases-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.repair_child:
        repair_child()
        return
    if args.phases_child:
        phases_child()
        return
    if args.scale:
        scale(args.repeat)
        return
    clock = time.perf_counter if args.wall else time.process_time
    if args.choice:
        choice_rows(args.repeat, clock)
        return
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
