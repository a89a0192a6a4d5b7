"""The strategies that re-form pipelines after failures: Oobleck-style re-instantiation and Bamboo-style
redundancy, each pipeline run as 1F1B with a synchronous optimizer (see `schedcomp.baselines`).

Memory: each run reports, per place of the job (a worker's stage before the failures), the most
activation memory any worker there holds *in the job's accounting*: its re-formed stage's activation
peak plus the static memory (weights, gradients, optimizer state) of the layers it now holds, minus the
static memory its place held under the job's partition. So `compare` holds it to the same per-place
limit as every other strategy: a device's total stays what the fault-free plan used. Without layer costs
the static memory is zero and only activations count.

With layer costs (`Layered`) Oobleck's re-formed pipelines cut whole layers: the best contiguous
partition of the layers over the pipeline's live workers (`repartition.min_max_partition`); without them
each new stage takes a fractional share of the stages (an idealisation in Oobleck's favour).
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from schedcomp.costs import CostModel
from schedcomp.ir import Order, Plan
from schedcomp.layers import LayerCosts, stage_costs, static_of
from schedcomp.lower import lower
from schedcomp.partition import Partition
from schedcomp.schedules.one_f_one_b import stage_order
from schedcomp.simulator import simulate
from schedcomp.topology import Topology, Worker

ITERATIONS = 4


@dataclass(frozen=True)
class Layered:
    """The job's per-layer costs and partition, for strategies that re-cut the model."""

    costs: LayerCosts
    partition: Partition

    @property
    def static(self) -> tuple[float, ...]:
        """Static memory per stage of the job."""
        return static_of(self.costs, self.partition)


@dataclass(frozen=True)
class Run:
    period: float
    peak_memory: float
    note: str = ""
    stage_peaks: tuple[float, ...] | None = None
    """Per stage (place) of the job, the most activation memory held there, in the job's accounting (see the
    module docstring); held to that stage's limit."""
    partition: tuple[int, ...] | None = None
    """Layers per stage, where the run chose one (adaptive with layer costs; its re-formed pipelines' aside)."""
    reformed: tuple[int, ...] = ()
    """The pipelines the run re-formed over their live workers (adaptive with layer costs)."""


STOPPED = float("inf")
Memo = dict[Any, Any]
"""A cache of per-pipeline cost models and runs (see `oobleck`); valid for one job cost model."""


def simulated(plan: Plan, synchronous: bool = False) -> Run:
    sim = simulate(plan, iterations=ITERATIONS, synchronous_optimizer=synchronous)
    peaks = tuple(max((m for w, m in sim.memory.items() if w.stage == s), default=0.0)
                  for s in range(plan.topology.pp))
    return Run(sim.period, sim.peak_memory, stage_peaks=peaks)


def oobleck(topology: Topology, microbatches: int, costs: CostModel, *, memo: Memo | None = None,
            layers: Layered | None = None, **kw: object) -> Run:
    """Oobleck-style re-instantiation: the surviving workers of a broken pipeline are re-formed into a
    shorter pipeline whose stages split the model evenly (fractional layers: each new stage costs a
    proportional share of the per-stage F, B, W, activation, all-reduce and step, an idealisation in
    Oobleck's favour), and the global batch is dealt to pipelines in proportion to their throughput,
    as Oobleck's pipeline templates do. Each pipeline runs 1F1B (fused backward) with a synchronous
    optimizer (Oobleck is built on DeepSpeed's 1F1B); the cross-pipeline all-reduce is charged to each
    stage's step and the iteration lasts as long as the slowest pipeline. With `layers` the new stages
    cut whole layers (the best contiguous partition over the live workers, their speeds counted). Not
    held to the memory limit while scheduling (re-formed stages hold more); `stage_peaks` reports it per
    place (module docstring).

    `memo` (any dict, shared across calls on one cost model) keeps each distinct pipeline's run, so
    equal pipelines are simulated once: the result is the same with or without it."""
    pp, dp = topology.pp, topology.dp
    memo = {} if memo is None else memo
    pipes: list[tuple[tuple[object, ...], int, float]] = []  # (memo key, stages, 1F1B slot)
    places: list[list[int]] = []
    dead, every = _dead_stages(topology), list(range(pp))
    for d in range(dp):
        live = [s for s in every if s not in dead[d]] if d in dead else every
        if not live:
            continue
        key = ("oobleck", len(live), _speeds(costs, d, live), layers is not None)
        if key not in memo:
            c, memo[key, "static"] = (_repartition(costs, d, live), (0.0,) * len(live)) if layers is None \
                else _whole_layers(layers, costs, d, live)
            memo[key] = c
            memo[key, "slot"] = max(c.forward[s] + c.backward_input[s] + c.backward_weight[s] for s in range(c.pp))
        pipes.append((key, len(live), memo[key, "slot"]))
        places.append(live)
    if not pipes:
        return Run(STOPPED, 0.0, "every worker failed")
    # Deal micro-batches one at a time to the pipeline that would finish its share soonest
    # (1F1B: (m + stages - 1) slots of its slowest stage); a heap keeps it linear in the batch.
    share = [0] * len(pipes)
    heap = [(n * slot, j) for j, (_, n, slot) in enumerate(pipes)]
    heapq.heapify(heap)
    for _ in range(dp * microbatches):
        _, i = heapq.heappop(heap)
        share[i] += 1
        heapq.heappush(heap, ((share[i] + pipes[i][1]) * pipes[i][2], i))
    runs, held = [], _Held(pp, layers)
    for (key, _, _), m, live in zip(pipes, share, places, strict=True):
        if m > 0:
            runs.append(_memo_1f1b(memo, key, m))
            held.add(runs[-1], live, memo[key, "static"])
    return Run(max(r.period for r in runs), max(r.peak_memory for r in runs), stage_peaks=held.peaks())


def bamboo(topology: Topology, microbatches: int, costs: CostModel, *, memo: Memo | None = None,
           layers: Layered | None = None, **kw: object) -> Run:
    """Bamboo-style redundant computation: every worker also runs its successor's forward (the last
    stage's successor is stage 0, a ring), paid even without failures, and keeps those activations
    too. On a failure of (d, s) its predecessor (d, s-1), which holds a copy of stage s, takes it over:
    pipeline d becomes one stage shorter, the merged worker doing both stages' F, B, W (and the
    redundant forward of its new successor). A failed stage 0 is taken over by stage 1. Two failures
    that are neighbours in one pipeline lose both copies of a stage: Bamboo must restart from a
    checkpoint. Each pipeline keeps its own micro-batches and runs 1F1B (fused backward) with a
    synchronous optimizer (DeepSpeed); the all-reduce is charged to each stage's step. Not held to the
    memory limit while scheduling; `stage_peaks` reports each place's activations (the redundant ones
    included) with the static memory of the stages it holds and of the copy of its successor.
    `memo`: as `oobleck`'s."""
    pp, dp = topology.pp, topology.dp
    memo = {} if memo is None else memo
    runs, held = [], _Held(pp, layers)
    static = layers.static if layers is not None else (0.0,) * pp
    lost = _dead_stages(topology)
    for d in range(dp):
        dead = lost.get(d, [])
        if any(_bamboo_host(s) in dead for s in dead):
            return Run(STOPPED, 0.0, f"pipeline {d} lost two neighbouring stages: Bamboo restarts from a checkpoint")
        groups: list[list[int]] = [[s] for s in range(pp) if s not in dead]  # original stages per live worker
        for s in dead:
            next(g for g in groups if _bamboo_host(s) in g).append(s)
        groups.sort(key=min)
        key = ("bamboo", tuple(map(tuple, groups)), _speeds(costs, d, [min(g) for g in groups]))
        if key not in memo:
            memo[key] = _bamboo_costs(costs, d, groups, pp)
        runs.append(_memo_1f1b(memo, key, microbatches))
        copies = [static[(max(g) + 1) % pp] if pp > 1 else 0.0 for g in groups]
        held.add(runs[-1], [g[0] for g in groups],  # (a group's first stage is its live worker's place)
                 [sum(static[s] for s in g) + c for g, c in zip(groups, copies, strict=True)])
    return Run(max(r.period for r in runs), max(r.peak_memory for r in runs), stage_peaks=held.peaks())


class _Held:
    """Per place of the job, the most memory any re-formed worker there holds, in the job's accounting:
    activation peak + static held - the static its place held under the job's partition."""

    def __init__(self, pp: int, layers: Layered | None) -> None:
        self.before = layers.static if layers is not None else (0.0,) * pp
        self.most = [0.0] * pp

    def add(self, run: Run, places: Sequence[int], static: Sequence[float]) -> None:
        assert run.stage_peaks is not None
        for place, peak, held in zip(places, run.stage_peaks, static, strict=True):
            self.most[place] = max(self.most[place], peak + held - self.before[place])

    def peaks(self) -> tuple[float, ...]:
        return tuple(self.most)


def _whole_layers(layers: Layered, costs: CostModel, pipeline: int,
                  live: Sequence[int]) -> tuple[CostModel, tuple[float, ...]]:
    """A re-formed pipeline's cost model cutting whole layers (the min-max partition over its live
    workers, weighted by their speeds), and the static memory of each new stage."""
    from schedcomp.repartition import live_partition

    speeds = [costs.speed.get(Worker(pipeline, s), 1.0) for s in live]
    partition = live_partition(layers.costs, costs.speed, pipeline, live)
    cut = stage_costs(layers.costs, partition)
    speed = {Worker(0, i): v for i, v in enumerate(speeds) if Worker(pipeline, live[i]) in costs.speed}
    step = [a + o for a, o in zip(cut.allreduce, cut.optimizer, strict=True)]
    model = dataclasses.replace(cut, allreduce=[0.0] * len(live), optimizer=step, memory_limit=None, speed=speed)
    return model, static_of(layers.costs, partition)


def _dead_stages(topology: Topology) -> dict[int, list[int]]:
    """Failed stages of each pipeline that lost any, sorted."""
    dead: dict[int, list[int]] = {}
    for w in sorted(topology.failed):
        dead.setdefault(w.pipeline, []).append(w.stage)
    return dead


def _speeds(costs: CostModel, pipeline: int, stages: Iterable[int]) -> tuple[float, ...]:
    """The speed factors of a pipeline's `stages` (empty when the model has none: all equal)."""
    return tuple(costs.speed.get(Worker(pipeline, s), 1.0) for s in stages) if costs.speed else ()


def _bamboo_host(stage: int) -> int:
    """The worker that holds a copy of `stage` and takes it over (stage 0's: stage 1)."""
    return stage - 1 if stage > 0 else 1


def _repartition(costs: CostModel, pipeline: int, live: Sequence[int]) -> CostModel:
    """Spread the pp stages' costs evenly over len(live) new stages (fractional layers)."""
    pp, n = costs.pp, len(live)

    def spread(values: Sequence[float]) -> list[float]:
        out = []
        for j in range(n):
            lo, hi = j * pp / n, (j + 1) * pp / n
            out.append(sum(v * max(0.0, min(hi, s + 1) - max(lo, s)) for s, v in enumerate(values)))
        return out

    step = [a + o for a, o in zip(costs.allreduce, costs.optimizer, strict=True)]
    speed = {Worker(0, i): costs.speed[Worker(pipeline, s)] for i, s in enumerate(live)
             if Worker(pipeline, s) in costs.speed}
    return CostModel(forward=spread(costs.forward), backward_input=spread(costs.backward_input),
                     backward_weight=spread(costs.backward_weight), p2p=costs.p2p, allreduce=[0.0] * n,
                     optimizer=spread(step), activation=spread(costs.activation), b_frees=_mixed_frees(costs),
                     memory_limit=None, speed=speed, memory_unit=costs.memory_unit)


def _bamboo_costs(costs: CostModel, pipeline: int, groups: Sequence[Sequence[int]], pp: int) -> CostModel:
    """Per live worker: the sum of its original stages' costs, plus the redundant forward (and its
    activations) of the stage after its last one (a ring)."""
    def total(values: Sequence[float], group: Sequence[int]) -> float:
        return sum(values[s] for s in group)

    succ = [(max(g) + 1) % pp for g in groups]
    speed = {Worker(0, i): costs.speed[Worker(pipeline, min(g))] for i, g in enumerate(groups)
             if Worker(pipeline, min(g)) in costs.speed}
    redundant = pp > 1
    return CostModel(
        forward=[total(costs.forward, g) + (costs.forward[n] if redundant else 0.0)
                 for g, n in zip(groups, succ, strict=True)],
        backward_input=[total(costs.backward_input, g) for g in groups],
        backward_weight=[total(costs.backward_weight, g) for g in groups],
        p2p=costs.p2p, allreduce=[0.0] * len(groups),
        optimizer=[total(costs.allreduce, g) + total(costs.optimizer, g) for g in groups],
        activation=[total(costs.activation, g) + (costs.activation[n] if redundant else 0.0)
                    for g, n in zip(groups, succ, strict=True)],
        b_frees=_mixed_frees(costs), memory_limit=None, speed=speed, memory_unit=costs.memory_unit,
    )


def _mixed_frees(costs: CostModel) -> float:
    """Re-partitioned stages mix the original ones, so their B frees the activation-weighted mean."""
    if not isinstance(costs.b_frees, tuple):
        return costs.b_frees
    total = sum(costs.activation)
    return sum(a * f for a, f in zip(costs.activation, costs.b_frees, strict=True)) / total if total else 0.5


def _memo_1f1b(memo: Memo, key: tuple[object, ...], microbatches: int) -> Run:
    """`_one_pipeline_1f1b` of the cost model stored at `memo[key]`, kept in `memo` too."""
    run_key = (key, microbatches)
    if run_key not in memo:
        memo[run_key] = _one_pipeline_1f1b(memo[key], microbatches)
    return memo[run_key]


def _one_pipeline_1f1b(costs: CostModel, microbatches: int) -> Run:
    """Simulate one pipeline running 1F1B (fused backward) with a synchronous optimizer."""
    topo = Topology(costs.pp, 1)
    ops = {Worker(0, s): stage_order(costs.pp, microbatches, s) for s in range(costs.pp)}
    plan = lower(Order(topo, microbatches, ops, "1f1b"), costs)
    return simulated(plan, synchronous=True)
