"""The validator's time against plan size (issue 17: it must be linear), and `import-torch` of a
200k-row PyTorch CSV end to end (target: under 10 s).

Reproduce (from the repository root):

    python bench/bench_validate.py                 # both sweeps and the 200k-row import
    python bench/bench_validate.py --max-rows 50000 # a quicker run
    python bench/bench_validate.py --import-only    # only the 200k-row import
    python bench/bench_validate.py --import-only --phases  # and its phases' CPU seconds

Two sweeps, doubling the plan each step, so linear time shows as a constant time per instruction
and a ratio near 2 between neighbouring rows (quadratic would show 4):
- stages: a GPipe-like CSV with R rows (pp = R stages, dp = 1, 2 micro-batches), imported, lowered
  and checked; this is the shape that was quadratic (a pass over all workers per stage).
- pipelines: 1F1B with pp = 4 and dp = D (D workers per stage), checked.
Times are CPU seconds of this process (`time.process_time`, single-threaded work), best of
`--repeat`. The import row runs `schedcomp import-torch FILE -o OUT` in-process (parse, lower, check,
JSON, atomic write) once on a 200k-row CSV written to a temporary directory, and prints its wall-clock
and CPU seconds (on a shared machine the CPU figure is the one that does not depend on the load).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from schedcomp.check import check
from schedcomp.cli import main
from schedcomp.compiler import compile
from schedcomp.costs import CostModel
from schedcomp.lower import lower
from schedcomp.serialize import order_from_torch_csv
from schedcomp.streamcolumns import instruction_count


def gpipe_csv(rows: int) -> str:
    """Every stage runs F0 F1 BW0 BW1: a valid compute-only schedule with `rows` stages."""
    return "".join(f"{k}F0,{k}F1,{k}B0,{k}B1\n" for k in range(rows))


def best(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return min(times)


def sweep(label: str, sizes: list[int], build: Callable[[int], object], repeat: int) -> None:
    print(f"\n{label}")
    print(f"  {'size':>8} {'instructions':>13} {'check s':>9} {'us/instr':>9} {'ratio':>6}")
    last = None
    for n in sizes:
        plan = build(n)
        count = instruction_count(plan.streams)
        seconds = best(lambda plan=plan: check(plan), repeat)
        ratio = f"{seconds / last:6.2f}" if last else f"{'':>6}"
        print(f"  {n:>8} {count:>13} {seconds:9.3f} {seconds / count * 1e6:9.2f} {ratio}")
        last = seconds


def main_(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-rows", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--import-only", action="store_true", help="only the 200k-row import row")
    ap.add_argument("--phases", action="store_true", help="also time the import's phases one by one")
    args = ap.parse_args(argv)

    rows = [r for r in (12_500, 25_000, 50_000, 100_000, 200_000) if r <= args.max_rows]

    if not args.import_only:
        sweeps(rows, args.repeat)
    import_row(args.max_rows)
    if args.phases:
        import_phases(args.max_rows)


def by_stages(rows: int) -> object:
    order = order_from_torch_csv(gpipe_csv(rows))
    return lower(order, CostModel.uniform(rows))


def sweeps(rows: list[int], repeat: int) -> None:
    sweep("stages (pp = rows, dp = 1, M = 2): CSV -> lower -> check", rows, by_stages, repeat)
    sweep("pipelines (1F1B, pp = 4, M = 8, dp = D)", [1_000, 2_000, 4_000, 8_000, 16_000],
          lambda d: compile(4, d, 8, schedule="1f1b"), repeat)


def import_row(rows: int) -> None:

    with tempfile.TemporaryDirectory() as d:
        csv, out = Path(d) / "schedule.csv", Path(d) / "plan.json"
        csv.write_text(gpipe_csv(rows))
        t0, c0 = time.perf_counter(), time.process_time()
        with contextlib.redirect_stdout(io.StringIO()):
            code = main(["import-torch", str(csv), "-o", str(out)])
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        print(f"\nimport-torch of a {rows:,}-row CSV: exit {code}, {wall:.2f} s wall, {cpu:.2f} s CPU "
              f"(target < 10 s; wall exceeds CPU when other processes share the cores), "
              f"plan {out.stat().st_size / 1e6:.1f} MB")


def import_phases(rows: int) -> None:
    """The import's stages one by one, CPU seconds each (the garbage collector paused, as the CLI does)."""
    from schedcomp.gcpause import paused_gc
    from schedcomp.serialize import plan_to_json

    text = gpipe_csv(rows)
    with paused_gc():
        c0 = time.process_time()
        order = order_from_torch_csv(text)
        c1 = time.process_time()
        plan = lower(order, CostModel.uniform(order.topology.pp))
        c2 = time.process_time()
        check(plan)
        c3 = time.process_time()
        plan_to_json(plan)
        c4 = time.process_time()
    print(f"  phases (CPU s): parse {c1 - c0:.2f}, lower {c2 - c1:.2f}, check {c3 - c2:.2f}, JSON {c4 - c3:.2f}")


if __name__ == "__main__":
    main_()
