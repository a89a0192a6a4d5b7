"""Our runtime against `torch.distributed.pipelining` on the same workload, measured in the same run.

Workload: each stage is 2 x (Linear(H, H) + GELU); micro-batch 16 rows;
MSE loss on the last stage; SGD; `torch.set_num_threads(1)` per process; one process per stage
over gloo on CPU. Every schedule runs in the same processes, one after the other, `--repeats`
times in rotation (so a busy neighbour hurts all of them alike), `--warmup` steps first. Two
measures: "step", one step from a barrier to a barrier (the slowest rank), the median of
`--steps`; "steady", `--steps` steps back to back between two barriers, divided by `--steps`
(the period when nothing waits between steps: our staggered optimizer shows there).
With `--paired N`, also "paired": for each pair compared with a target (ours / theirs), N rounds of one
step of each, alternating which goes first, each from a barrier to a barrier; the median of the
per-round ratios and its interquartile range. A ratio of two neighbouring steps cancels the load
drift that moves separate runs by +-25% on a shared machine.

PyTorch's schedules: `ScheduleGPipe`, `Schedule1F1B`, `ScheduleInterleavedZeroBubble` with one
stage per rank (their ZB1P), followed by `optimizer.step()`. Ours: `PipelineTrainer.step` on
plans compiled for gpipe, 1f1b, zb-h1, zb-h2 (the optimizer step is in the plan).
Virtual stages, two chunks per rank, each chunk one Linear + GELU (the same model, cut in 2pp):
their `ScheduleInterleaved1F1B` and `ScheduleZBVZeroBubble` against ours, interleaved-1f1b and zb-v.

Reproduce:  python bench/bench_runtime.py            (pp=4 M=8 and pp=8 M=16, H=512)
            python bench/bench_runtime.py --configs 4x8x512
Targets (issue 4): ours 1F1B <= theirs 1F1B; ours ZB-H1 <= 0.85 x their ZB1P and < their 1F1B.
Targets (issue 15): ours interleaved-1f1b <= their Interleaved1F1B; ours zb-v <= their ZBVZeroBubble.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

ROWS = 16
THEIRS = ("gpipe", "1f1b", "zb1p", "interleaved", "zbv")
OURS = ("gpipe", "1f1b", "zb-h1", "zb-h2", "interleaved-1f1b", "zb-v")
CHUNKS = 2  # virtual stages per rank in the interleaved and V schedules
VIRTUAL = {"interleaved": "loop", "zbv": "v", "interleaved-1f1b": "loop", "zb-v": "v"}  # kind -> placement


def stage_module(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU())


def chunk_module(hidden: int) -> nn.Module:
    """Half a stage: the model cut into `CHUNKS` x pp virtual stages is the same model."""
    return nn.Sequential(nn.Linear(hidden, hidden), nn.GELU())


def held_stages(kind: str, rank: int, pp: int) -> tuple[int, ...]:
    """The virtual stages rank holds (PyTorch's stage_to_rank: loop for interleaved, V for ZB-V)."""
    if VIRTUAL[kind] == "v":
        return (rank, 2 * pp - 1 - rank)
    return tuple(rank + k * pp for k in range(CHUNKS))


def _sgd(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-3)  # type: ignore[arg-type]


def _timed(step: Callable[[], None], warmup: int, steps: int) -> tuple[list[float], float]:
    """Barrier-to-barrier times of `steps` single steps, and the mean time of `steps` steps back to back."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    return times, (time.perf_counter() - start) / steps


def theirs(kind: str, rank: int, pp: int, microbatches: int, hidden: int) -> Callable[[], None]:
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    loss = nn.functional.mse_loss
    cpu = torch.device("cpu")
    if kind in VIRTUAL:
        held = held_stages(kind, rank, pp)
        modules = [chunk_module(hidden) for _ in held]
        stages = [PipelineStage(m, s, CHUNKS * pp, cpu) for m, s in zip(modules, held, strict=True)]
        multi = ScheduleInterleaved1F1B if kind == "interleaved" else ScheduleZBVZeroBubble
        schedule = multi(stages, microbatches, loss_fn=loss)
        last = CHUNKS * pp - 1 in held
    else:
        modules = [stage_module(hidden)]
        stage = PipelineStage(modules[0], rank, pp, cpu)
        if kind == "zb1p":
            schedule = ScheduleInterleavedZeroBubble([stage], microbatches, loss_fn=loss)
        else:
            schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[kind](stage, microbatches, loss_fn=loss)
        last = rank == pp - 1
    optimizer = _sgd([p for m in modules for p in m.parameters()])
    x, y = torch.randn(microbatches * ROWS, hidden), torch.randn(microbatches * ROWS, hidden)

    def step() -> None:
        schedule.step(*((x,) if rank == 0 else ()), target=y if last else None)  # inputs at stage 0's rank
        optimizer.step()
        optimizer.zero_grad()

    return step


def ours(kind: str, rank: int, pp: int, microbatches: int, hidden: int) -> Callable[[], None]:
    from schedcomp.compiler import compile
    from schedcomp.runtime import PipelineTrainer

    chunked = kind in VIRTUAL
    plan = compile(pp, 1, microbatches=microbatches, schedule=kind, chunks=CHUNKS if chunked else None)
    module = chunk_module if chunked else stage_module
    trainer = PipelineTrainer(plan, lambda s: module(hidden), nn.functional.mse_loss, _sgd)
    batch = (torch.randn(microbatches * ROWS, hidden), torch.randn(microbatches * ROWS, hidden))

    def step() -> None:
        trainer.step(batch)

    return step


PAIRS = (("1f1b", "1f1b"), ("zb-h1", "zb1p"), ("interleaved-1f1b", "interleaved"), ("zb-v", "zbv"))
"""(ours, theirs) compared with a target: the paired measure's pairs."""
TARGETS = {"1f1b": "<= 1.00", "zb-h1": "<= 0.85", "interleaved-1f1b": "<= 1.00", "zb-v": "<= 1.00"}


def _once(step: Callable[[], None]) -> float:
    dist.barrier()
    start = time.perf_counter()
    step()
    dist.barrier()
    return time.perf_counter() - start


def paired(runs: dict[tuple[str, str], Callable[[], None]], rounds: int) -> dict[str, list[float]]:
    """Per pair of `PAIRS`, the ratio ours / theirs of `rounds` neighbouring single steps (order alternating)."""
    ratios: dict[str, list[float]] = {}
    for mine, other in PAIRS:
        a, b = runs[("ours", mine)], runs[("theirs", other)]
        out = ratios.setdefault(mine, [])
        for r in range(rounds):
            if r % 2:
                tb, ta = _once(b), _once(a)
            else:
                ta, tb = _once(a), _once(b)
            out.append(ta / tb)
    return ratios


def worker(rank: int, configs: list[tuple[int, int, int]], warmup: int, steps: int, repeats: int,
           rounds: int = 0) -> None:
    for pp, microbatches, hidden in configs:
        if dist.get_world_size() != pp:
            continue
        runs = {("theirs", k): theirs(k, rank, pp, microbatches, hidden) for k in THEIRS}
        runs |= {("ours", k): ours(k, rank, pp, microbatches, hidden) for k in OURS}
        times: dict[tuple[str, str], list[float]] = {key: [] for key in runs}
        steady: dict[tuple[str, str], list[float]] = {key: [] for key in runs}
        for _ in range(repeats):
            for key, step in runs.items():
                one, back_to_back = _timed(step, warmup, steps)
                times[key] += one
                steady[key].append(back_to_back)
        if rank == 0:
            report(pp, microbatches, hidden, "step", {key: statistics.median(t) for key, t in times.items()})
            report(pp, microbatches, hidden, "steady", {key: statistics.median(t) for key, t in steady.items()})
        if rounds:
            ratios = paired(runs, rounds)
            if rank == 0:
                print(f"\npp={pp} M={microbatches} H={hidden}, paired: ours / theirs, {rounds} alternating rounds "
                      "of one step each (median [interquartile range])")
                for (mine, other), values in zip(PAIRS, ratios.values(), strict=True):
                    q1, med, q3 = statistics.quantiles(values, n=4)
                    spread = f"[{q1:4.2f} - {q3:4.2f}]"
                    print(f"  ours {mine:17s} / their {other:12s} {med:5.2f}  {spread}   target {TARGETS[mine]}")
                sys.stdout.flush()


def report(pp: int, microbatches: int, hidden: int, measure: str, ms: dict[tuple[str, str], float]) -> None:
    def t(side: str, kind: str) -> float:
        return ms[(side, kind)] * 1e3

    what = "median step time" if measure == "step" else "steady-state time per step"
    print(f"\npp={pp} M={microbatches} H={hidden}, {measure}: {what} (ms), gloo, 1 thread per process")
    print("  torch.distributed.pipelining: " + "  ".join(f"{k} {t('theirs', k):7.1f}" for k in THEIRS))
    print("  schedcomp runtime:            " + "  ".join(f"{k} {t('ours', k):7.1f}" for k in OURS))
    rows = [
        ("ours 1F1B / their 1F1B", t("ours", "1f1b") / t("theirs", "1f1b"), "<= 1.00"),
        ("ours ZB-H1 / their ZB1P", t("ours", "zb-h1") / t("theirs", "zb1p"), "<= 0.85"),
        ("ours ZB-H1 / their 1F1B", t("ours", "zb-h1") / t("theirs", "1f1b"), "<  1.00"),
        ("ours ZB-H2 / their ZB1P", t("ours", "zb-h2") / t("theirs", "zb1p"), ""),
        ("ours GPipe / their GPipe", t("ours", "gpipe") / t("theirs", "gpipe"), ""),
        ("ours ZB-H1 / ours 1F1B", t("ours", "zb-h1") / t("ours", "1f1b"), ""),
        ("ours interleaved / theirs", t("ours", "interleaved-1f1b") / t("theirs", "interleaved"), "<= 1.00"),
        ("ours ZB-V / their ZBV", t("ours", "zb-v") / t("theirs", "zbv"), "<= 1.00"),
    ]
    for name, ratio, target in rows:
        print(f"  {name:26s} {ratio:5.2f}   {('target ' + target) if target else ''}")
    sys.stdout.flush()


def main() -> None:
    from schedcomp.runtime.launch import spawn

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=["4x8x512", "8x16x512"], help="PPxMxH (default 4x8x512 8x16x512)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--repeats", type=int, default=2, help="rotations over the schedules (default 2)")
    p.add_argument("--paired", type=int, default=0, metavar="N",
                   help="also N alternating rounds of one step per compared pair (default 0: none; else at least 2)")
    args = p.parse_args()
    if args.paired == 1 or args.paired < 0:
        p.error("--paired takes 0 (none) or at least 2 rounds (a median and quartiles need two)")
    configs = [tuple(int(v) for v in c.split("x")) for c in args.configs]
    print(__doc__.split("\n\n")[1])
    for pp in sorted({c[0] for c in configs}):
        spawn(worker, pp, ([c for c in configs if c[0] == pp], args.warmup, args.steps, args.repeats, args.paired),
              timeout=1800)


if __name__ == "__main__":
    main()
