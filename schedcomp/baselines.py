"""Strategies for training through failures, each simulated on the same cost model, side by side.

`compare(pp, dp, microbatches, failed, costs)` returns one `Outcome` per strategy: its steady-state
period (simulator, several iterations), throughput relative to fault-free (same global batch per
iteration, so the ratio of periods), and peak activation memory. Each strategy's assumptions are in
its function's docstring. A strategy that cannot continue without a checkpoint restart reports an
infinite period and a relative throughput of 0.

Also here: `rerouted_1f1b_order` (from `solvers.plain`), the plain construction the adaptive schedules
must beat.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from schedcomp.adaptive import adaptive_order
from schedcomp.check import check
from schedcomp.compiler import unit_costs
from schedcomp.costs import CostModel
from schedcomp.errors import CostModelError, RecoveryError, ScheduleError
from schedcomp.ir import Op, Order, Plan
from schedcomp.lower import lower
from schedcomp.memory import FAULT_FREE, MemoryLimit, resolve_limit
from schedcomp.schedules.one_f_one_b import stage_order
from schedcomp.simulator import simulate
from schedcomp.solvers.plain import rerouted_1f1b_order as rerouted_1f1b_order  # re-exported
from schedcomp.topology import LOOP, Topology, Worker

STRATEGIES = (
    "fault-free", "adaptive", "adaptive-no-split", "adaptive-no-stagger", "drop-pipeline", "oobleck", "bamboo",
)
ITERATIONS = 4


@dataclass(frozen=True)
class Outcome:
    """One strategy's result; `period` is inf when the strategy cannot continue without a restart."""

    strategy: str
    period: float
    relative_throughput: float
    peak_memory: float
    note: str = ""
    memory_limit: float | list[float] | None = None
    within_memory_limit: bool | None = None
    """Whether every worker stays within its stage's limit (None: no limit, or the strategy stopped)."""

    def to_dict(self) -> dict[str, object]:
        finite = math.isfinite(self.period)
        return {
            "strategy": self.strategy,
            "period": self.period if finite else None,
            "relative_throughput": self.relative_throughput,
            "peak_memory": self.peak_memory if finite else None,
            "memory_limit": self.memory_limit,
            "within_memory_limit": self.within_memory_limit,
            "note": self.note,
        }


@dataclass(frozen=True)
class _Run:
    period: float
    peak_memory: float
    note: str = ""
    stage_peaks: tuple[float, ...] | None = None
    """Per stage of the job, when the run keeps the job's stages (then it is held to per-stage limits)."""


_STOPPED = float("inf")
Memo = dict[Any, Any]
"""A cache of per-pipeline cost models and runs (see `oobleck`); valid for one job cost model."""


def compare(
    pp: int,
    dp: int,
    microbatches: int,
    failed: Iterable[Worker | tuple[int, int]] = (),
    costs: CostModel | None = None,
    *,
    strategies: Sequence[str] = STRATEGIES,
    solver: str = "greedy",
    time_limit: float = 10.0,
    memory_limit: MemoryLimit = FAULT_FREE,
    chunks: int = 1,
    placement: str = LOOP,
) -> list[Outcome]:
    """Simulate each strategy on the same topology, failures and costs (see the module docstring).

    `memory_limit` is resolved as by `compile` for the failure set (default: fault-free ZB-H1's per-stage
    peak) and every strategy that schedules (fault-free, adaptive and its ablations, drop-pipeline) is
    held to it; oobleck and bamboo re-partition the stages, so they are reported against it instead.

    With `chunks` > 1 each worker holds that many model chunks placed by `placement` (see
    `schedcomp.topology`; `costs` has one entry per virtual stage, default the unit model with chunks of
    1/chunks of a stage): the schedulers keep the chunks (the fault-free reference too, so the ratios
    compare like with like), while oobleck and bamboo, which run 1F1B, see each worker's chunks as one
    stage (`one_stage_view`)."""
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise ScheduleError(f"unknown strategy {unknown[0]!r}: choose from {', '.join(STRATEGIES)}")
    topology = Topology.of(pp, dp, failed, chunks, placement)
    if costs is not None and costs.pp != topology.stages:
        raise CostModelError(f"the cost model has {costs.pp} stages but the job has {topology.stages}: give one "
                             "cost per (virtual) stage")
    costs = resolve_limit(memory_limit, topology, microbatches, unit_costs(topology) if costs is None else costs)
    reference = fault_free(topology, microbatches, costs, solver=solver, time_limit=time_limit)
    out = []
    for name in strategies:
        job, job_costs = (topology, costs) if name not in _ONE_STAGE else one_stage_view(topology, costs)
        run = reference if name == "fault-free" else _RUNNERS[name](
            job, microbatches, job_costs, solver=solver, time_limit=time_limit)
        rel = reference.period / run.period if math.isfinite(run.period) and run.period > 0 else 0.0
        out.append(Outcome(name, run.period, rel, run.peak_memory, run.note, *_against_limit(run, costs)))
    return out


def _against_limit(run: _Run, costs: CostModel) -> tuple[float | list[float] | None, bool | None]:
    """The limit as JSON, and whether the run kept within it: with per-stage limits, a re-partitioned
    strategy (whose stages are not the job's) is held to the largest one."""
    limit = costs.memory_limit
    if limit is None:
        return None, None
    shown = list(limit) if isinstance(limit, tuple) else limit
    if not math.isfinite(run.period):
        return shown, None
    if run.stage_peaks is not None:
        return shown, all(p <= costs.limit_at(s) * (1 + 1e-9) for s, p in enumerate(run.stage_peaks))
    return shown, run.peak_memory <= max(costs.stage_limits) * (1 + 1e-9)


def _simulated(plan: Plan, synchronous: bool = False) -> _Run:
    sim = simulate(plan, iterations=ITERATIONS, synchronous_optimizer=synchronous)
    peaks = tuple(max((m for w, m in sim.memory.items() if w.stage == s), default=0.0)
                  for s in range(plan.topology.pp))
    return _Run(sim.period, sim.peak_memory, stage_peaks=peaks)


def fault_free(topology: Topology, microbatches: int, costs: CostModel, *, solver: str = "greedy",
               time_limit: float = 10.0) -> _Run:
    """The reference: no failures, the adaptive schedules (split backward, staggered optimizer) on all
    dp pipelines, so ratios isolate what the failures cost."""
    healthy = dataclasses.replace(topology, failed=frozenset())
    return _adaptive_run(healthy, microbatches, costs, solver=solver, time_limit=time_limit)


def _adaptive_run(topology: Topology, microbatches: int, costs: CostModel, *, split: bool = True,
                  synchronous: bool = False, solver: str = "greedy", time_limit: float = 10.0) -> _Run:
    try:
        order, bound, used = adaptive_order(topology, microbatches, costs, solver=solver, time_limit=time_limit,
                                            split=split, synchronous=synchronous)
    except RecoveryError as exc:
        return _Run(_STOPPED, 0.0, str(exc))
    plan = lower(order, costs, solver=used, lower_bound=bound)
    check(plan)
    return _simulated(plan, synchronous)


def adaptive(topology: Topology, microbatches: int, costs: CostModel, **kw: object) -> _Run:
    """Ours (ReCycle's idea): each failed worker's micro-batches re-routed to its stage's live peers,
    split backward with W deferred into bubbles, staggered per-stage optimizer step."""
    return _adaptive_run(topology, microbatches, costs, **kw)  # type: ignore[arg-type]


def adaptive_no_split(topology: Topology, microbatches: int, costs: CostModel, **kw: object) -> _Run:
    """Ablation: as `adaptive`, but with a fused backward (BW = B + W), so no W can fill a bubble."""
    return _adaptive_run(topology, microbatches, costs, split=False, **kw)  # type: ignore[arg-type]


def adaptive_no_stagger(topology: Topology, microbatches: int, costs: CostModel, **kw: object) -> _Run:
    """Ablation: as `adaptive`, but scheduled and simulated with a global barrier after the optimizer
    steps, so no stage may start its next iteration before every stage has stepped."""
    return _adaptive_run(topology, microbatches, costs, synchronous=True, **kw)  # type: ignore[arg-type]


def drop_pipeline(topology: Topology, microbatches: int, costs: CostModel, **kw: object) -> _Run:
    """Pipelines that lost any worker stop (their live workers idle); the surviving pipelines share the
    global batch, dealt round-robin, each running it with the adaptive scheduler (split backward,
    staggered optimizer) as a fault-free pipeline. All pipelines lost: a checkpoint restart."""
    pp, dp = topology.pp, topology.dp
    broken = sorted({w.pipeline for w in topology.failed})
    alive = [d for d in range(dp) if d not in broken]
    if not alive:
        return _Run(_STOPPED, 0.0, "every pipeline lost a worker: training needs a checkpoint restart")
    # Micro-batch lists per surviving pipeline: its own, then the dropped pipelines' dealt round-robin.
    lists: dict[int, list[tuple[int, int]]] = {d: [(d, m) for m in range(microbatches)] for d in alive}
    extra = [(d, m) for m in range(microbatches) for d in broken]
    for i, item in enumerate(extra):
        lists[alive[i % len(alive)]].append(item)
    stopped = dataclasses.replace(topology, failed=frozenset(Worker(d, s) for d in broken for s in range(pp)))
    one = Topology(pp, 1, chunks=topology.chunks, placement=topology.placement)
    ops: dict[Worker, tuple[Op, ...]] = {}
    solver = str(kw.get("solver", "greedy"))
    time_limit = float(kw.get("time_limit", 10.0))  # type: ignore[arg-type]
    for d in alive:
        mine = lists[d]
        local_costs = pipeline_costs(costs, d, range(pp))
        order, _, _ = adaptive_order(one, len(mine), local_costs, solver=solver, time_limit=time_limit)
        for s in range(pp):
            ops[Worker(d, s)] = tuple(Op(o.kind, mine[o.microbatch][0], mine[o.microbatch][1], o.stage)
                                      for o in order.ops[Worker(0, s)])
    plan = lower(Order(stopped, microbatches, ops, "drop-pipeline"), costs)
    check(plan)
    return _simulated(plan)


def oobleck(topology: Topology, microbatches: int, costs: CostModel, *, memo: Memo | None = None,
            **kw: object) -> _Run:
    """Oobleck-style re-instantiation: the surviving workers of a broken pipeline are re-formed into a
    shorter pipeline whose stages split the model evenly (fractional layers: each new stage costs a
    proportional share of the per-stage F, B, W, activation, all-reduce and step, an idealisation in
    Oobleck's favour), and the global batch is dealt to pipelines in proportion to their throughput,
    as Oobleck's pipeline templates do. Each pipeline runs 1F1B (fused backward) with a synchronous
    optimizer (Oobleck is built on DeepSpeed's 1F1B); the cross-pipeline all-reduce is charged to each
    stage's step and the iteration lasts as long as the slowest pipeline. Assumes re-formed stages fit
    in device memory: the memory limit is not applied (the peak memory is reported).

    `memo` (any dict, shared across calls on one cost model) keeps each distinct pipeline's run, so
    equal pipelines are simulated once: the result is the same with or without it."""
    pp, dp = topology.pp, topology.dp
    memo = {} if memo is None else memo
    pipes: list[tuple[tuple[object, ...], int, float]] = []  # (memo key, stages, 1F1B slot)
    dead, every = _dead_stages(topology), list(range(pp))
    for d in range(dp):
        live = [s for s in every if s not in dead[d]] if d in dead else every
        if not live:
            continue
        key = ("oobleck", len(live), _speeds(costs, d, live))
        if key not in memo:
            c = _repartition(costs, d, live)
            memo[key] = c
            memo[key, "slot"] = max(c.forward[s] + c.backward_input[s] + c.backward_weight[s] for s in range(c.pp))
        pipes.append((key, len(live), memo[key, "slot"]))
    if not pipes:
        return _Run(_STOPPED, 0.0, "every worker failed")
    # Deal micro-batches one at a time to the pipeline that would finish its share soonest
    # (1F1B: (m + stages - 1) slots of its slowest stage); a heap keeps it linear in the batch.
    share = [0] * len(pipes)
    heap = [(n * slot, j) for j, (_, n, slot) in enumerate(pipes)]
    heapq.heapify(heap)
    for _ in range(dp * microbatches):
        _, i = heapq.heappop(heap)
        share[i] += 1
        heapq.heappush(heap, ((share[i] + pipes[i][1]) * pipes[i][2], i))
    runs = [_memo_1f1b(memo, key, m) for (key, _, _), m in zip(pipes, share, strict=True) if m > 0]
    return _Run(max(r.period for r in runs), max(r.peak_memory for r in runs))


def bamboo(topology: Topology, microbatches: int, costs: CostModel, *, memo: Memo | None = None,
           **kw: object) -> _Run:
    """Bamboo-style redundant computation: every worker also runs its successor's forward (the last
    stage's successor is stage 0, a ring), paid even without failures, and keeps those activations
    too. On a failure of (d, s) its predecessor (d, s-1), which holds a copy of stage s, takes it over:
    pipeline d becomes one stage shorter, the merged worker doing both stages' F, B, W (and the
    redundant forward of its new successor). A failed stage 0 is taken over by stage 1. Two failures
    that are neighbours in one pipeline lose both copies of a stage: Bamboo must restart from a
    checkpoint. Each pipeline keeps its own micro-batches and runs 1F1B (fused backward) with a
    synchronous optimizer (DeepSpeed); the all-reduce is charged to each stage's step. The memory limit
    is not applied (the peak memory, which includes the redundant activations, is reported).
    `memo`: as `oobleck`'s."""
    pp, dp = topology.pp, topology.dp
    memo = {} if memo is None else memo
    runs = []
    lost = _dead_stages(topology)
    for d in range(dp):
        dead = lost.get(d, [])
        if any(_bamboo_host(s) in dead for s in dead):
            return _Run(_STOPPED, 0.0, f"pipeline {d} lost two neighbouring stages: Bamboo restarts from a checkpoint")
        groups: list[list[int]] = [[s] for s in range(pp) if s not in dead]  # original stages per live worker
        for s in dead:
            next(g for g in groups if _bamboo_host(s) in g).append(s)
        groups.sort(key=min)
        key = ("bamboo", tuple(map(tuple, groups)), _speeds(costs, d, [min(g) for g in groups]))
        if key not in memo:
            memo[key] = _bamboo_costs(costs, d, groups, pp)
        runs.append(_memo_1f1b(memo, key, microbatches))
    return _Run(max(r.period for r in runs), max(r.peak_memory for r in runs))


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


_ONE_STAGE = ("oobleck", "bamboo")
"""Strategies that run one stage per worker (1F1B): with chunks they see `one_stage_view`."""


def one_stage_view(topology: Topology, costs: CostModel) -> tuple[Topology, CostModel]:
    """The job with each worker's chunks merged into one stage (their costs summed; B frees the
    activation-weighted mean); the job itself without virtual stages."""
    if topology.chunks == 1:
        return topology, costs
    held = [topology.chunks_of(p) for p in range(topology.pp)]

    def fold(values: Sequence[float]) -> list[float]:
        return [sum(values[c] for c in chunks) for chunks in held]

    frees = costs.b_frees
    if isinstance(frees, tuple):
        frees = tuple(sum(costs.activation[c] * frees[c] for c in chunks) / a if a else 0.5
                      for chunks, a in zip(held, fold(costs.activation), strict=True))
    merged = dataclasses.replace(
        costs, forward=fold(costs.forward), backward_input=fold(costs.backward_input),
        backward_weight=fold(costs.backward_weight), allreduce=fold(costs.allreduce), optimizer=fold(costs.optimizer),
        activation=fold(costs.activation), b_frees=frees)
    return Topology(topology.pp, topology.dp, topology.failed), merged


_RUNNERS: dict[str, Callable[..., _Run]] = {
    "adaptive": adaptive,
    "adaptive-no-split": adaptive_no_split,
    "adaptive-no-stagger": adaptive_no_stagger,
    "drop-pipeline": drop_pipeline,
    "oobleck": oobleck,
    "bamboo": bamboo,
}


# ---- helpers: single-pipeline cost models and 1F1B runs ------------------------------------------


def pipeline_costs(costs: CostModel, pipeline: int, stages: Iterable[int]) -> CostModel:
    """The cost model of one pipeline's workers as a dp=1 job (speed factors moved to pipeline 0)."""
    stages = list(stages)
    speed = {Worker(0, i): costs.speed[Worker(pipeline, s)]
             for i, s in enumerate(stages) if Worker(pipeline, s) in costs.speed}
    return CostModel(**{**costs.__dict__, "speed": speed})


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


def _memo_1f1b(memo: Memo, key: tuple[object, ...], microbatches: int) -> _Run:
    """`_one_pipeline_1f1b` of the cost model stored at `memo[key]`, kept in `memo` too."""
    run_key = (key, microbatches)
    if run_key not in memo:
        memo[run_key] = _one_pipeline_1f1b(memo[key], microbatches)
    return memo[run_key]


def _one_pipeline_1f1b(costs: CostModel, microbatches: int) -> _Run:
    """Simulate one pipeline running 1F1B (fused backward) with a synchronous optimizer."""
    topo = Topology(costs.pp, 1)
    ops = {Worker(0, s): stage_order(costs.pp, microbatches, s) for s in range(costs.pp)}
    plan = lower(Order(topo, microbatches, ops, "1f1b"), costs)
    return _simulated(plan, synchronous=True)
