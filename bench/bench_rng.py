"""What a random stream per micro-batch (`runtime.rng`) costs the fault-free step, side by side.

Two measures, each alternating the two settings round by round (a busy neighbour hurts both alike):
- "fork": entering and leaving `drawing` alone (the generators' state saved, seeded, restored), µs;
- "step": `PipelineTrainer.step` of a zb-h1 plan, pp = 2, dp = 1, with dropout in every stage,
  seed=0 (a stream per micro-batch) against seed=None (the global stream, as before), in the
  same processes: the median step of each, and the difference.

Reproduce:  python bench/bench_rng.py                 (H=512, 8 micro-batches of 16 rows)
            python bench/bench_rng.py --hidden 1024 --steps 30
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from schedcomp import CostModel, Topology
from schedcomp.lower import lower
from schedcomp.runtime.launch import spawn
from schedcomp.runtime.rng import drawing, stream_seed
from schedcomp.schedules import fault_free_order

ROWS, PP = 16, 2


def fork_us(rounds: int = 20000) -> float:
    cpu = torch.device("cpu")
    began = time.perf_counter()
    for i in range(rounds):
        with drawing(stream_seed(0, i, 0, 0, i), cpu):
            pass
    return (time.perf_counter() - began) / rounds * 1e6


def _stage(stage: int, hidden: int) -> nn.Module:
    torch.manual_seed(stage)
    return nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(), nn.Dropout(0.1), nn.Linear(hidden, hidden))


def _run(rank: int, hidden: int, microbatches: int, steps: int, out: dict) -> None:
    from schedcomp.runtime import PipelineTrainer

    torch.set_num_threads(1)
    plan = lower(fault_free_order("zb-h1", Topology.of(PP, 1), microbatches), CostModel.uniform(PP))
    trainers = {name: PipelineTrainer(plan, lambda s: _stage(s, hidden), F.mse_loss,
                                      lambda p: torch.optim.SGD(p, lr=1e-3), seed=seed)
                for name, seed in (("stream", 0), ("global", None))}
    g = torch.Generator().manual_seed(0)
    rows = ROWS * microbatches
    batch = (torch.randn(rows, hidden, generator=g), torch.randn(rows, hidden, generator=g))
    times: dict[str, list[float]] = {name: [] for name in trainers}
    for i in range(steps + 3):
        for name, trainer in sorted(trainers.items(), reverse=i % 2 == 1):  # who goes first alternates
            torch.distributed.barrier()
            began = time.perf_counter()
            float(trainer.step(batch))  # waits for the iteration's loss: the whole step
            if i >= 3:  # warm-up
                times[name].append(time.perf_counter() - began)
    if rank == 0:
        out.update({name: (statistics.median(t), min(t)) for name, t in times.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    print(f"fork (drawing enter + leave): {fork_us():.1f} us per forward")
    import multiprocessing

    with multiprocessing.Manager() as manager:
        out = manager.dict()
        spawn(_run, PP, (args.hidden, args.microbatches, args.steps, out), timeout=600.0)
        stream, plain = out["stream"], out["global"]
    forwards = args.microbatches  # per worker per step
    for i, what in enumerate(("median", "fastest")):
        print(f"step ({what}), zb-h1 pp={PP} H={args.hidden} M={args.microbatches}: seed=0 {stream[i] * 1e3:.2f} ms, "
              f"seed=None {plain[i] * 1e3:.2f} ms, difference {(stream[i] - plain[i]) * 1e3:+.2f} ms "
              f"({(stream[i] / plain[i] - 1) * 100:+.1f}%)")
    print(f"the fork alone: {forwards * fork_us() / 1e3:.3f} ms per step ({forwards} forwards per worker)")


if __name__ == "__main__":
    main()
