"""Global gradient clipping in the pipeline: post-validation against a synchronous barrier, measured and simulated.

Workload: pp = 4 processes over gloo on CPU, one thread each; each stage is 2 x (Linear(H, H) +
GELU); M micro-batches of 16 rows; MSE loss; SGD with momentum; four global batches used in
rotation (so gradient norms vary and clipping is due on some iterations only). Three trainers in
the same processes, run in rotation `--repeats` times (each first in turn) after `--warmup` steps each:
- "none": no clipping;
- "post": `max_grad_norm` with Zero Bubble's post-validation (`grad_check="post"`: step at once,
  undo and redo clipped when the global norm says so);
- "barrier": the same clipping, every stage waiting for the global norm before stepping.
`max_grad_norm` is the median global norm of the first iterations, so clipping is active on
about half of them. Measures: "steady", `--steps` steps back to back between two barriers
divided by `--steps` (what the staggered optimizer is for), and "step", the median of single
steps from a barrier to a barrier.

The simulator's period for the same three uses the cost model profiled from a fourth, untimed
trainer without clipping (`profile=True`, `schedcomp.profile.profile_costs`), the measured latency
of the check's all-reduce, and for "post" the measured fraction of iterations a worker redid its
step (`schedcomp.gradcheck`).

Reproduce:  python bench/bench_training.py                 (pp=4, M=8, H=512, zb-h1)
            python bench/bench_training.py --schedule 1f1b --hidden 256
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from bench_runtime import _timed, stage_module  # the same workload and timing as the runtime bench
from torch import nn

ROWS, BATCHES = 16, 4
MODES = ("none", "post", "barrier")


def _sgd(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)  # type: ignore[arg-type]


def batches(microbatches: int, hidden: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(microbatches * ROWS, hidden, generator=g),
             torch.randn(microbatches * ROWS, hidden, generator=g) * (1 + 2 * (b % 2))) for b in range(BATCHES)]


def trainer_for(mode: str, plan: object, hidden: int, max_norm: float, profile: bool = False) -> object:
    from schedcomp.runtime import PipelineTrainer

    torch.manual_seed(1)
    options = {} if mode == "none" else {"max_grad_norm": max_norm, "grad_check": mode}
    return PipelineTrainer(plan, lambda s: stage_module(hidden), nn.functional.mse_loss, _sgd, profile=profile,
                           **options)


def reduce_latency(trainer: object, rounds: int = 50) -> float:
    """Seconds for one all-reduce of two float64 over every worker (the check's collective)."""
    buffer = torch.zeros(2, dtype=torch.float64)
    group = trainer.comm.control  # type: ignore[attr-defined]
    dist.barrier()
    start = time.perf_counter()
    for _ in range(rounds):
        dist.all_reduce(buffer, group=group)
    return (time.perf_counter() - start) / rounds


def worker(rank: int, schedule: str, microbatches: int, hidden: int, warmup: int, steps: int, repeats: int) -> None:
    from schedcomp.compiler import compile

    pp = dist.get_world_size()
    plan = compile(pp, 1, microbatches=microbatches, schedule=schedule)
    data = batches(microbatches, hidden)
    probe = trainer_for("post", plan, hidden, 1e30)
    norms = [probe.step(data[i % BATCHES]).grad_norm for i in range(2 * BATCHES)]  # type: ignore[attr-defined]
    max_norm = statistics.median(n for n in norms if n is not None)
    trainers = {mode: trainer_for(mode, plan, hidden, max_norm) for mode in MODES}
    counters = {mode: 0 for mode in MODES}
    results: dict[str, list] = {mode: [] for mode in MODES}

    def stepper(mode: str) -> Callable[[], None]:
        def step() -> None:
            results[mode].append(trainers[mode].step(data[counters[mode] % BATCHES]))  # type: ignore[attr-defined]
            counters[mode] += 1
        return step

    single: dict[str, list[float]] = {m: [] for m in MODES}
    steady: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(repeats):
        for mode in MODES[r % len(MODES):] + MODES[:r % len(MODES)]:  # each goes first in turn
            one, back_to_back = _timed(stepper(mode), warmup, steps)
            single[mode] += one
            steady[mode].append(back_to_back)
    latency = reduce_latency(trainers["none"])
    outcomes = [r.outcome for r in results["post"]]
    redo = sum(1 for o in outcomes if o is not None and o.redone) / max(1, len(outcomes))
    clipped = sum(1 for o in outcomes if o is not None and o.clipped) / max(1, len(outcomes))
    profiled = trainer_for("none", plan, hidden, max_norm, profile=True)  # untimed: recording costs time
    for i in range(warmup + steps):
        profiled.step(data[i % BATCHES])  # type: ignore[attr-defined]
    trace = profiled.spans()  # type: ignore[attr-defined]
    gathered: list = [None] * pp
    dist.all_gather_object(gathered, (trace, redo))
    if rank == 0:
        report(schedule, microbatches, hidden, single, steady, gathered, latency, clipped, max_norm)
    for t in trainers.values():
        t.settle()  # type: ignore[attr-defined]


def report(schedule: str, microbatches: int, hidden: int, single: dict, steady: dict,
           gathered: list, latency: float, clipped: float, max_norm: float) -> None:
    from schedcomp.gradcheck import GradCheckCost
    from schedcomp.lower import lower
    from schedcomp.profile import profile_costs
    from schedcomp.schedules import fault_free_order
    from schedcomp.simulator import simulate
    from schedcomp.topology import Topology

    spans = [s for trace, _ in gathered for s in trace]
    costs = profile_costs([spans])
    timed = lower(fault_free_order(schedule, Topology.of(len(gathered), 1), microbatches), costs)
    redo = statistics.mean(r for _, r in gathered)
    ms = latency * 1e3  # profile_costs works in milliseconds
    simulated = {"none": simulate(timed, 6).period,
                 "post": simulate(timed, 6, grad_check=GradCheckCost("post", reduce=ms, redo=redo)).period,
                 "barrier": simulate(timed, 6, grad_check=GradCheckCost("barrier", reduce=ms)).period}
    print(f"\npp={len(gathered)} M={microbatches} H={hidden} {schedule}, gloo, 1 thread per process; "
          f"max_grad_norm {max_norm:.3g}: clipped on {clipped:.0%} of iterations, a worker redid its step "
          f"on {redo:.0%}; the check's all-reduce {ms:.3f} ms")
    print(f"  {'':10s} {'steady (ms)':>12s} {'step (ms)':>10s} {'simulated period (ms)':>22s}")
    for mode in MODES:
        one, back_to_back = statistics.median(single[mode]) * 1e3, statistics.median(steady[mode]) * 1e3
        print(f"  {mode:10s} {back_to_back:12.2f} {one:10.2f} {simulated[mode]:22.2f}")
    unredone = simulate(timed, 6, grad_check=GradCheckCost("post", reduce=ms)).period
    print(f"  post if no step were redone: simulated {unredone:.2f} ms ({unredone / simulated['none']:.3f} x none)")
    for a, b in (("post", "none"), ("barrier", "none"), ("post", "barrier")):
        print(f"  {a} / {b}: steady {statistics.median(steady[a]) / statistics.median(steady[b]):.3f}, "
              f"simulated {simulated[a] / simulated[b]:.3f}")
    sys.stdout.flush()


def main() -> None:
    from schedcomp.runtime.launch import spawn

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--schedule", default="zb-h1")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    print(__doc__.split("\n\n")[1])
    spawn(worker, args.pp, (args.schedule, args.microbatches, args.hidden, args.warmup, args.steps, args.repeats),
          timeout=1800)


if __name__ == "__main__":
    main()
