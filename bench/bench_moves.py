"""What moving layers at a plan switch costs (`runtime.moves`), against one training iteration.

Two processes (pp = 2, dp = 1, gloo, CPU) train L blocks of Linear(H, H) + Tanh (float32, Adam, zb-h1,
M micro-batches of 16 rows), cut (L/2, L/2). For each k, `use_plan` to (L/2 + k, L/2 - k) moves k layers
from stage 1 to stage 0 and the switch back moves them home: each switch's seconds (median over the
rounds, both directions), the bytes sent (each layer's parameters and its Adam `step`, `exp_avg`,
`exp_avg_sq`), and the same switch with no move (the plan digest check alone) for comparison, beside
the median training iteration.

Reproduce:  python bench/bench_moves.py                       (H 256 512 1024, k 1 2 4, 5 rounds)
            python bench/bench_moves.py --hidden 2048 --moved 1 4 --rounds 3
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from schedcomp import CostModel, Topology
from schedcomp.lower import lower
from schedcomp.runtime.launch import spawn
from schedcomp.runtime.moves import layer_states, moved_bytes, plan_moves
from schedcomp.schedules import fault_free_order

ROWS, PP = 16, 2


def _model(layers: int, hidden: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh()) for _ in range(layers)))


def _run(rank: int, hidden: int, moved: list[int], microbatches: int, rounds: int, out: dict) -> None:
    from schedcomp.runtime import PipelineTrainer

    torch.set_num_threads(1)
    layers = 2 * max(moved) + 2
    half = layers // 2
    plan = lower(fault_free_order("zb-h1", Topology.of(PP, 1), microbatches), CostModel.uniform(PP))
    base = dataclasses.replace(plan, partition=(half, half))
    trainer = PipelineTrainer(base, _model(layers, hidden), F.mse_loss, lambda p: torch.optim.Adam(p, lr=1e-4))
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(ROWS * microbatches, hidden, generator=g), torch.randn(ROWS * microbatches, hidden,
                                                                                 generator=g))
    steps = []
    for i in range(rounds + 2):
        torch.distributed.barrier()
        began = time.perf_counter()
        float(trainer.step(batch))  # Adam's state exists from here on
        if i >= 2:
            steps.append(time.perf_counter() - began)

    def switch(partition: tuple[int, int]) -> float:
        torch.distributed.barrier()
        began = time.perf_counter()
        trainer.use_plan(dataclasses.replace(plan, partition=partition))
        torch.distributed.barrier()  # until the slower end is done
        return time.perf_counter() - began

    rows = []
    still = [switch((half, half)) for _ in range(rounds)]
    for k in moved:
        cut = (half + k, half - k)
        stage = trainer.stage
        states = layer_states(stage.module, stage.optimizer, sum(trainer.partition[: trainer.worker.stage]))
        sent = moved_bytes([m for m in plan_moves((half, half), cut, plan.workers) if m.source == trainer.worker],
                           states)
        times = []
        for _ in range(rounds):
            times += [switch(cut), switch((half, half))]
        rows.append((k, sent, statistics.median(times)))
    if rank == 1:  # the sender of the first move: it knows the bytes
        out.update({"rows": rows, "step": statistics.median(steps), "still": statistics.median(still)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--moved", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    import multiprocessing

    print(f"pp={PP} dp=1 gloo CPU, zb-h1 M={args.microbatches} x {ROWS} rows, Adam, float32; layers = 2 max(k) + 2")
    print("| H | k layers | MB moved | switch with move ms | switch, no move ms | iteration ms | move / iteration |")
    print("|---|---|---|---|---|---|---|")
    for hidden in args.hidden:
        with multiprocessing.Manager() as manager:
            out = manager.dict()
            spawn(_run, PP, (hidden, args.moved, args.microbatches, args.rounds, out), timeout=600.0)
            rows, step, still = out["rows"], out["step"], out["still"]
        for k, sent, seconds in rows:
            print(f"| {hidden} | {k} | {sent / 1e6:.2f} | {seconds * 1e3:.1f} | {still * 1e3:.1f} | {step * 1e3:.1f} | "
                  f"{seconds / step:.2f} |")


if __name__ == "__main__":
    main()
