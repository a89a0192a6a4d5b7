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
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from schedcomp.adaptive import adaptive_order
from schedcomp.check import check
from schedcomp.compiler import ADAPTIVE, job_layers, layered_failure_plan, unit_costs
from schedcomp.costs import CostModel
from schedcomp.errors import CostModelError, MemoryLimitError, RecoveryError, SchedcompTypeError, ScheduleError
from schedcomp.ir import Op, Order
from schedcomp.layers import LayerCosts, static_of
from schedcomp.lower import lower
from schedcomp.memory import FAULT_FREE, MemoryLimit, resolve_limit
from schedcomp.reformed import STOPPED as _STOPPED
from schedcomp.reformed import Layered, Memo, bamboo, oobleck
from schedcomp.reformed import Run as _Run
from schedcomp.reformed import simulated as _simulated
from schedcomp.simulator import simulate
from schedcomp.solvers.plain import rerouted_1f1b_order as rerouted_1f1b_order  # re-exported
from schedcomp.topology import LOOP, Topology, Worker

__all__ = ["STRATEGIES", "Memo", "Outcome", "bamboo", "compare", "fault_free", "oobleck", "rerouted_1f1b_order"]

STRATEGIES = (
    "fault-free", "adaptive", "adaptive-no-split", "adaptive-no-stagger", "adaptive-reformed", "drop-pipeline",
    "oobleck", "bamboo",
)
LAYERED_ONLY = ("adaptive-reformed",)
"""Strategies that need per-layer costs: left out of `compare`'s default without them."""
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
    partition: tuple[int, ...] | None = None
    """With layer costs, the layers per stage every pipeline ran, but the `reformed` ones (None: oobleck's and
    bamboo's differ per pipeline, or no layer costs)."""
    reformed: tuple[int, ...] = ()
    """The pipelines re-formed over their live workers (adaptive with layer costs, where that was faster)."""

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
            "partition": list(self.partition) if self.partition is not None else None,
            "reformed": list(self.reformed),
        }


def compare(
    pp: int,
    dp: int,
    microbatches: int,
    failed: Iterable[Worker | tuple[int, int]] = (),
    costs: CostModel | None = None,
    *,
    strategies: Sequence[str] | None = None,
    solver: str = "greedy",
    time_limit: float = 10.0,
    memory_limit: MemoryLimit = FAULT_FREE,
    chunks: int = 1,
    placement: str = LOOP,
    layers: LayerCosts | int | None = None,
    partition: Sequence[int] | None = None,
    recut: bool = False,
) -> list[Outcome]:
    """Simulate each strategy on the same topology, failures and costs (see the module docstring).

    `memory_limit` is resolved as by `compile` for the failure set (default: fault-free ZB-H1's per-stage
    peak) and every strategy that schedules (fault-free, adaptive and its ablations, drop-pipeline) is
    held to it; oobleck and bamboo re-partition the stages, so they are reported against it instead.

    With `chunks` > 1 each worker holds that many model chunks placed by `placement` (see
    `schedcomp.topology`; `costs` has one entry per virtual stage, default the unit model with chunks of
    1/chunks of a stage): the schedulers keep the chunks (the fault-free reference too, so the ratios
    compare like with like), while oobleck and bamboo, which run 1F1B, see each worker's chunks as one
    stage (`one_stage_view`).

    `layers` (a `LayerCosts`, or K even layers per stage of `costs`) and the job's `partition` (default
    even) as `compile`'s: adaptive then re-partitions as well as re-routes (`schedcomp.repartition`),
    oobleck's re-formed pipelines cut whole layers, and every strategy's memory counts the static memory
    of the layers each device holds (`schedcomp.reformed`). `recut`: adaptive may also re-cut the failed
    workers' micro-batches, as `compile(recut=True)` (the ablations keep whole micro-batches). With layer costs
    and failures adaptive is `compile(reform="auto")`'s choice: re-routing or, where faster within the memory
    limit, the pipelines that lost workers re-formed; "adaptive-reformed" is the re-formed plan alone.
    `strategies` defaults to all (those needing layer costs only with them)."""
    if not isinstance(recut, bool):
        raise SchedcompTypeError(f"recut must be True or False, got {recut!r}")
    if strategies is None:
        strategies = [s for s in STRATEGIES if s not in LAYERED_ONLY or layers is not None or partition is not None]
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise ScheduleError(f"unknown strategy {unknown[0]!r}: choose from {', '.join(STRATEGIES)}")
    topology = Topology.of(pp, dp, failed, chunks, placement)
    if costs is not None and costs.pp != topology.stages:
        raise CostModelError(f"the cost model has {costs.pp} stages but the job has {topology.stages}: give one "
                             "cost per (virtual) stage")
    given_costs = costs is not None
    costs = unit_costs(topology) if costs is None else costs
    layered = None
    if layers is not None or partition is not None:
        layer_costs, job_partition, costs = job_layers(topology, costs, layers, partition, given_costs=given_costs)
        layered = Layered(layer_costs, job_partition)
    costs = resolve_limit(memory_limit, topology, microbatches, costs)
    reference = fault_free(topology, microbatches, costs, solver=solver, time_limit=time_limit)
    out = []
    for name in strategies:
        job, job_costs = (topology, costs) if name not in _ONE_STAGE else one_stage_view(topology, costs)
        extra = {"recut": True} if recut and name == "adaptive" else {}
        run = reference if name == "fault-free" else _RUNNERS[name](
            job, microbatches, job_costs, solver=solver, time_limit=time_limit, layers=layered, **extra)
        rel = reference.period / run.period if math.isfinite(run.period) and run.period > 0 else 0.0
        kept = layered.partition if layered is not None and name not in _ONE_STAGE else None
        out.append(Outcome(name, run.period, rel, run.peak_memory, run.note, *_against_limit(run, costs),
                           partition=run.partition or kept, reformed=run.reformed))
    return out


def _against_limit(run: _Run, costs: CostModel) -> tuple[float | list[float] | None, bool | None]:
    """The limit as JSON, and whether the run kept within it: per place of the job where the run says
    what each place holds (in the job's accounting, `schedcomp.reformed`), else its peak against the
    largest limit."""
    limit = costs.memory_limit
    if limit is None:
        return None, None
    shown = list(limit) if isinstance(limit, tuple) else limit
    if not math.isfinite(run.period):
        return shown, None
    if run.stage_peaks is not None:
        return shown, all(p <= costs.limit_at(s) * (1 + 1e-9) for s, p in enumerate(run.stage_peaks))
    return shown, run.peak_memory <= max(costs.stage_limits) * (1 + 1e-9)


def fault_free(topology: Topology, microbatches: int, costs: CostModel, *, solver: str = "greedy",
               time_limit: float = 10.0) -> _Run:
    """The reference: no failures, the adaptive schedules (split backward, staggered optimizer) on all
    dp pipelines, so ratios isolate what the failures cost."""
    healthy = dataclasses.replace(topology, failed=frozenset())
    return _adaptive_run(healthy, microbatches, costs, solver=solver, time_limit=time_limit)


def _adaptive_run(topology: Topology, microbatches: int, costs: CostModel, *, split: bool = True,
                  synchronous: bool = False, solver: str = "greedy", time_limit: float = 10.0,
                  recut: bool = False) -> _Run:
    try:
        order, bound, used = adaptive_order(topology, microbatches, costs, solver=solver, time_limit=time_limit,
                                            split=split, synchronous=synchronous, recut=recut)
    except RecoveryError as exc:
        return _Run(_STOPPED, 0.0, str(exc))
    plan = lower(order, costs, solver=used, lower_bound=bound)
    check(plan)
    return _simulated(plan, synchronous)


def adaptive(topology: Topology, microbatches: int, costs: CostModel, *, layers: Layered | None = None,
             **kw: object) -> _Run:
    """Ours (ReCycle's idea): each failed worker's micro-batches re-routed to its stage's live peers,
    split backward with W deferred into bubbles, staggered per-stage optimizer step; with `layers`, layer
    boundaries moved off stages that lost workers as well (`schedcomp.repartition`), or the pipelines that
    lost workers re-formed where that is faster (`compile(reform="auto")`)."""
    if layers is None or not topology.failed:
        return _adaptive_run(topology, microbatches, costs, **kw)  # type: ignore[arg-type]
    return _layered(topology, microbatches, costs, layers, "auto", **kw)


def adaptive_reformed(topology: Topology, microbatches: int, costs: CostModel, *, layers: Layered | None = None,
                      **kw: object) -> _Run:
    """Ablation: the re-formed candidate of `adaptive` alone (`compile(reform=...)` naming every pipeline
    that lost workers), with layer costs; stopped where it cannot be compiled (without failures: `adaptive`)."""
    if layers is None:
        return _Run(_STOPPED, 0.0, "re-forming pipelines needs per-layer costs (layers=K)")
    if not topology.failed:
        return adaptive(topology, microbatches, costs, layers=layers, **kw)
    from schedcomp.reform import lost_pipelines

    return _layered(topology, microbatches, costs, layers, lost_pipelines(topology), **kw)


def _layered(topology: Topology, microbatches: int, costs: CostModel, layers: Layered,
             reform: Literal["auto"] | tuple[int, ...], **kw: object) -> _Run:
    """`compile`'s plan with layer costs (`reform`: "auto", or the pipelines to re-form), simulated, each
    place's peak in the job's accounting (activations + the static memory of the layers its worker holds -
    what the place held under the job's partition)."""
    options = {"solver": str(kw.get("solver", "greedy")), "time_limit": float(kw.get("time_limit", 10.0))}  # type: ignore[arg-type]
    try:
        if reform == "auto":
            plan = layered_failure_plan(topology, microbatches, costs, layers.costs, layers.partition,
                                        recut=bool(kw.get("recut", False)), **options)  # type: ignore[arg-type]
        else:
            from schedcomp.reform import compile_reformed

            plan = compile_reformed(topology, microbatches, costs, layers.costs, layers.partition, reform, ADAPTIVE)
    except (RecoveryError, ScheduleError, MemoryLimitError) as exc:
        return _Run(_STOPPED, 0.0, str(exc))
    sim = simulate(plan, iterations=ITERATIONS)
    peaks = [0.0] * topology.pp
    for w, held in sim.memory.items():
        partition = plan.partitions[w.pipeline] if plan.partitions is not None else plan.partition
        assert partition is not None
        moved = static_of(layers.costs, partition)[w.stage] - layers.static[w.stage]
        peaks[w.stage] = max(peaks[w.stage], held + moved)
    reformed = tuple(plan.meta["reform"]["pipelines"]) if "reform" in plan.meta else ()
    note = f"pipeline(s) {', '.join(map(str, reformed))} re-formed" if reformed else ""
    return _Run(sim.period, sim.peak_memory, note, stage_peaks=tuple(peaks), partition=plan.partition,
                reformed=reformed)


def adaptive_no_split(topology: Topology, microbatches: int, costs: CostModel, **kw: object) -> _Run:
    """Ablation: as `adaptive`, but with a fused backward (BW = B + W), so no W can fill a bubble."""
    kw.pop("layers", None)
    return _adaptive_run(topology, microbatches, costs, split=False, **kw)  # type: ignore[arg-type]


def adaptive_no_stagger(topology: Topology, microbatches: int, costs: CostModel, **kw: object) -> _Run:
    """Ablation: as `adaptive`, but scheduled and simulated with a global barrier after the optimizer
    steps, so no stage may start its next iteration before every stage has stepped."""
    kw.pop("layers", None)
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
    "adaptive-reformed": adaptive_reformed,
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


