"""Adaptive re-routing with virtual stages: throughput under failures, gap to the bound, compile time.

Reproduce (about 2-4 minutes on a 2-core machine):

    python bench/bench_vroute.py            # the whole grid
    python bench/bench_vroute.py --quick    # pp=4 only, for a smoke run

For interleaved-1f1b (loop placement, 2 chunks) and zb-v (V placement), unit costs with each chunk 1/2
of a stage, prints per job and failure set, every figure measured in this run on the simulator:
the fault-free family's period; the re-routed plan's period (`compile` with the failures, default
solver and memory limit: the fault-free family's peak) and its throughput relative to fault-free (same
global batch, so the ratio of periods); its gap to the proven lower bound; the throughput of the
re-routed plan without a memory limit, of dropping the broken pipelines (`compare`'s drop-pipeline:
the surviving pipelines share the batch, each scheduled with its chunks by the adaptive scheduler,
held to the same limit) and of the one-chunk adaptive plan of the same job (pp stages, same total
work per micro-batch); compile seconds of the re-routed plan.
"""

from __future__ import annotations

import argparse
import time

from schedcomp.baselines import compare
from schedcomp.compiler import compile
from schedcomp.costs import CostModel
from schedcomp.simulator import simulate

FAMILIES = ("interleaved-1f1b", "zb-v")


def grid(quick: bool) -> list[tuple[int, int, int, tuple[tuple[int, int], ...]]]:
    """(pp, dp, M, failed): M a multiple of pp, as interleaved-1f1b runs equal rounds."""
    cases = [
        (4, 2, 8, ((1, 0),)),
        (4, 4, 8, ((1, 0),)),
        (4, 4, 8, ((1, 0), (2, 3))),
        (4, 4, 8, ((1, 1), (3, 1))),
    ]
    if not quick:
        cases += [
            (8, 4, 16, ((1, 0),)),
            (8, 4, 16, ((0, 3), (2, 5))),
            (8, 8, 16, ((1, 7), (5, 2), (6, 4))),
        ]
    return cases


def row(family: str, pp: int, dp: int, m: int, failed: tuple[tuple[int, int], ...]) -> str:
    reference = simulate(compile(pp, dp, m, schedule=family)).period
    began = time.perf_counter()
    plan = compile(pp, dp, m, failed=failed, schedule=family)
    seconds = time.perf_counter() - began
    period = simulate(plan).period
    bound = plan.lower_bound or 0.0
    free = simulate(compile(pp, dp, m, failed=failed, schedule=family, memory_limit=None)).period
    placement = plan.topology.placement
    dropped = compare(pp, dp, m, failed, chunks=2, placement=placement, strategies=("drop-pipeline",))[0].period
    one_chunk = simulate(compile(pp, dp, m, failed=failed, schedule="adaptive", costs=CostModel.uniform(pp))).period
    failed_text = " ".join(f"{d}:{s}" for d, s in failed)
    return (f"| {family} | pp{pp} dp{dp} m{m} | {failed_text} | {reference:g} | {period:g} | "
            f"{reference / period:.1%} | {period / bound - 1:.1%} | {reference / free:.1%} | "
            f"{reference / dropped:.1%} | {reference / one_chunk:.1%} | {seconds:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="pp=4 only")
    args = parser.parse_args()
    print("| family | job | failed | fault-free period | re-routed period | throughput | gap to bound | "
          "no memory limit | drop-pipeline | adaptive, 1 chunk | compile s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for pp, dp, m, failed in grid(args.quick):
        for family in FAMILIES:
            print(row(family, pp, dp, m, failed), flush=True)


if __name__ == "__main__":
    main()
