"""`compile`: a pipeline configuration and a cost model in, a validated `Plan` out.

Fault-free families go family -> `fault_free_order` -> `lower` -> `check`. With failed workers,
or `schedule="adaptive"`, the order comes from `schedcomp.adaptive.adaptive_order` (re-routing
plus a solver) and then takes the same `lower` -> `check` path.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence
from typing import Literal

from schedcomp import limits
from schedcomp.check import check, peak_memory
from schedcomp.choice import AUTO, NEVER, Reform, Timed, fastest, reform_mode, timed
from schedcomp.costs import CostModel
from schedcomp.errors import CostModelError, MemoryLimitError, SchedcompTypeError, ScheduleError
from schedcomp.gcpause import paused_gc
from schedcomp.ir import Order, Plan
from schedcomp.layers import LayerCosts, stage_costs
from schedcomp.lower import lower
from schedcomp.memory import FAULT_FREE, MemoryLimit, family_stage_peaks, resolve_limit, show_memory
from schedcomp.partition import Partition, as_partition, even
from schedcomp.schedules import FAMILIES, ONE_STAGE_FAMILIES, fault_free_order, get_family
from schedcomp.topology import LOOP, PLACEMENTS, Topology, V, Worker

log = logging.getLogger(__name__)

ADAPTIVE = "adaptive"


def compile(
    pp: int,
    dp: int = 1,
    microbatches: int | None = None,
    failed: Iterable[Worker | tuple[int, int]] = (),
    schedule: str = "1f1b",
    costs: CostModel | None = None,
    memory_limit: MemoryLimit = FAULT_FREE,
    solver: str = "auto",
    time_limit: float = 10.0,
    chunks: int | None = None,
    placement: str | None = None,
    recut: bool = False,
    layers: LayerCosts | int | None = None,
    partition: Sequence[int] | None = None,
    reform: Reform = AUTO,
) -> Plan:
    """Compile and validate a plan for `pp` stages x `dp` pipelines running `microbatches` each.

    `schedule` is a fault-free family (gpipe, 1f1b, zb-h1, zb-h2, interleaved-1f1b, zb-v) or "adaptive";
    failures always use the adaptive schedules, which re-route a failed worker's micro-batches at each
    chunk it held to the live workers holding the same chunks. `costs` defaults to the unit model. `memory_limit` is
    "fault-free" (default: with failures, no worker holds more than fault-free ZB-H1 does on its stage;
    a limit in the cost model wins), a family name (its per-stage peak), None / "none" (no limit), a
    number, one per stage, or bytes ("60GiB", with a measured cost model): see `schedcomp.memory`.
    `solver` and `time_limit` go to the adaptive scheduler.

    `chunks` is the virtual stages per worker of a family that has them (interleaved-1f1b, zb-v;
    default: the family's own, 2; "adaptive" takes any, placed as interleaved-1f1b's): the model then
    has pp x chunks stages, `costs` gives one entry per virtual stage, and the default unit model makes
    each chunk cost 1/chunks of a stage. With failures the family names the placement and the adaptive
    schedules run. `placement` ("loop" or "v", see `schedcomp.topology`) places the chunks of "adaptive";
    a family's is its own.

    `recut` (with failures) splits the failed workers' micro-batches into pieces sized for the peers that
    take them (`schedcomp.recut`), so the busiest peer carries the work bound rather than its ceiling;
    the plan then carries the cut (`Plan.cut`, `schedcomp.cut`).

    `layers` (per-layer costs, `schedcomp.layers.LayerCosts`, or K: each stage of `costs` split evenly
    into K layers) lets the adaptive schedules move layer boundaries as well as re-route when there are
    failures (`schedcomp.repartition`); the plan then carries its `partition`, the fault-free plan the
    job's. `partition` is the job's (layers per stage; default: even). With layer costs `costs` is derived.
    With both `layers` and `recut`, each partition the search schedules in full may also re-cut.

    `reform` (with `layers` and failures): "auto" (default) compiles both re-routing (as above) and
    re-forming every pipeline that lost workers, Oobleck-style (each one's live workers hold all the layers,
    the others keep the job's partition, the global batch re-balanced over the pipelines by throughput:
    `schedcomp.reform`), and keeps the faster plan within the memory limit (ties: re-routing;
    `schedcomp.choice`, `meta["choice"]`); "never" only re-routes; pipelines named (every one that lost
    workers, without `recut`) are re-formed. A re-formed plan carries `partitions` and per-pipeline costs
    (`schedcomp.partitions`).
    """
    if not isinstance(recut, bool):
        raise SchedcompTypeError(f"recut must be True or False, got {recut!r}")
    if not isinstance(schedule, str):
        raise SchedcompTypeError(f"schedule must be a family name such as '1f1b', got {type(schedule).__name__}")
    chunks, placement = _chunks(schedule, chunks, placement)
    topology = Topology.of(pp, dp, failed, chunks, placement)
    if microbatches is None or isinstance(microbatches, bool) or not isinstance(microbatches, int):
        raise ScheduleError(f"microbatches must be a positive integer, got {microbatches!r}: pass microbatches=M")
    if microbatches < 1:
        raise ScheduleError(f"microbatches must be at least 1, got {microbatches}: pass microbatches=M with M >= 1")
    limits.check_job(pp, dp, microbatches)  # before any per-slot work
    if costs is not None and not isinstance(costs, CostModel):
        raise SchedcompTypeError(f"costs must be a CostModel, got {type(costs).__name__}: "
                                 "build one with CostModel.from_dict(...) or CostModel.load(path)")
    stages = topology.stages
    given_costs = costs is not None
    if costs is None:
        costs = unit_costs(topology)
    if costs.pp != stages:
        raise CostModelError(f"the cost model has {costs.pp} stages but pp={pp}: give one cost per stage" if chunks == 1
                             else f"the cost model has {costs.pp} stages but the model has pp x chunks = {stages} "
                                  "virtual stages: give one cost per virtual stage")
    costs.check_workers(topology)
    job_partition: Partition | None = None
    if layers is not None or partition is not None:
        layers, job_partition, costs = job_layers(topology, costs, layers, partition, given_costs=given_costs)
    costs = resolve_limit(memory_limit, topology, microbatches, costs)

    mode = reform_mode(reform)
    if isinstance(mode, tuple):
        if not isinstance(layers, LayerCosts) or job_partition is None:
            raise ScheduleError("reform needs per-layer costs to re-partition the re-formed pipelines: pass layers=K "
                                "(layers per stage) or a LayerCosts")
        if recut:
            raise ScheduleError("reform re-balances the batch itself: drop recut")
        from schedcomp.reform import compile_reformed

        return compile_reformed(topology, microbatches, costs, layers, job_partition, mode, schedule)

    if isinstance(layers, LayerCosts) and job_partition is not None and topology.failed:
        return layered_failure_plan(topology, microbatches, costs, layers, job_partition, solver=solver,
                                    time_limit=time_limit, recut=recut, reform=mode, schedule=schedule)
    if topology.failed or schedule == ADAPTIVE:
        return _adaptive(topology, microbatches, costs, solver, time_limit, recut, job_partition)

    family = get_family(schedule)
    order = fault_free_order(family.name, topology, microbatches)
    plan = lower(dataclasses.replace(order, partition=job_partition), costs)
    _fit_memory(plan)
    check(plan)
    log.debug("compiled %s pp=%d dp=%d M=%d", family.name, pp, dp, microbatches)
    return plan


def layered_failure_plan(topology: Topology, microbatches: int, costs: CostModel, layers: LayerCosts,
                         job_partition: Partition, *, solver: str = "auto", time_limit: float = 10.0,
                         recut: bool = False, reform: Literal["auto", "never"] = AUTO,
                         schedule: str = ADAPTIVE) -> Plan:
    """The plan for a job with per-layer costs and failures (`costs`: its stage model, limit resolved):
    re-routed and re-partitioned (re-cut with `recut`), or with `reform="auto"` the faster of that and
    every pipeline that lost workers re-formed (`schedcomp.choice.fastest`; the re-formed candidate
    re-balances the batch itself, so `recut` is re-routing's alone)."""
    def rerouted() -> Plan:
        return _repartitioned(topology, microbatches, costs, layers, job_partition, solver, time_limit, recut)

    from schedcomp.adaptive import check_solver_options

    check_solver_options(solver, time_limit)  # (a mistake here is not a candidate that cannot build the job)
    if reform == NEVER:
        return rerouted()
    from schedcomp.reform import lost_pipelines, timed_reformed

    def reformed() -> Timed:  # (its winning variant's period, simulated among the variants: not again)
        return timed_reformed(topology, microbatches, costs, layers, job_partition, lost_pipelines(topology),
                              schedule)

    return fastest((("re-route", lambda: timed(rerouted())), ("re-form", reformed)))


def unit_costs(topology: Topology) -> CostModel:
    """The unit model, each chunk 1/chunks of a stage (exactly the unit model with one chunk)."""
    unit = 1.0 / topology.chunks
    return CostModel.uniform(topology.stages, forward=unit, backward_input=unit, backward_weight=unit,
                             activation=unit)


def _chunks(schedule: str, chunks: int | None, placement: str | None) -> tuple[int, str]:
    """The chunks per worker and their placement for `schedule` (one, looped, without virtual stages)."""
    if placement is not None and placement not in PLACEMENTS:
        raise ScheduleError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    family = FAMILIES.get(schedule)
    if placement is not None and family is not None and placement != (family.placement or LOOP):
        raise ScheduleError(f"{schedule} places its chunks {family.placement or 'one per worker'!r}, not "
                            f"{placement!r}: placement is for schedule='adaptive'")
    if family is not None and family.placement:
        placement = family.placement
    elif placement is None:
        placement = LOOP
    if chunks is None:
        if family is not None:
            return family.default_chunks, placement
        return (2 if placement == V else 1), placement
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ScheduleError(f"chunks must be a positive integer, got {chunks!r}")
    if chunks > 1 and schedule != ADAPTIVE and (family is None or not family.placement):
        with_chunks = ", ".join(name for name, f in FAMILIES.items() if f.placement)
        raise ScheduleError(f"{schedule} runs one stage per worker, not chunks={chunks}: virtual stages need "
                            f"{with_chunks} or adaptive")
    return chunks, placement if chunks > 1 else LOOP  # (one chunk: every placement is the identity)


def _fit_memory(plan: Plan) -> None:
    """A fixed family cannot trade time for memory: say how much it needs instead of failing in check."""
    costs = plan.costs
    if costs.memory_limit is None:
        return
    peaks = peak_memory(plan)
    worst = max(peaks, key=lambda w: (peaks[w] - costs.limit_at(w.stage), -w.stage, -w.pipeline))
    need = peaks[worst]
    limit = costs.limit_at(worst.stage)
    if need > limit * (1 + 1e-9):
        pp, mbs = plan.topology.pp, plan.microbatches

        def fits(name: str) -> bool:
            peaks = family_stage_peaks(name, pp, mbs, costs)
            return all(p <= costs.limit_at(s) * (1 + 1e-9) for s, p in enumerate(peaks))

        # Suggested only for one-stage costs: the families' shapes differ in chunks, and so do their costs.
        fitting = [name for name in ONE_STAGE_FAMILIES
                   if plan.topology.chunks == 1 and mbs >= FAMILIES[name].min_microbatches(pp) and fits(name)]
        other = f", use {' or '.join(fitting)}, which fit{'s' if len(fitting) == 1 else ''}," if fitting else ""
        topo = plan.topology
        where = (f"stage {worst.stage}" if topo.chunks == 1 else
                 f"worker {worst} (chunks {', '.join(map(str, topo.chunks_of(worst.stage)))})")
        adaptive = ' or use schedule="adaptive", which schedules within the limit'
        raise MemoryLimitError(
            f"{plan.family} needs {show_memory(need, costs)} at {where} but memory_limit is "
            f"{show_memory(limit, costs, unit=False)}: set memory_limit >= {show_memory(need, costs, unit=False)}"
            f"{other}{adaptive}"
        )


def _adaptive(topology: Topology, microbatches: int, costs: CostModel, solver: str, time_limit: float,
              recut: bool = False, partition: Partition | None = None) -> Plan:
    try:
        from schedcomp.adaptive import ITERATIONS, adaptive_solution
        from schedcomp.simfast import remember, solver_timing
    except ModuleNotFoundError as exc:
        if exc.name != "schedcomp.adaptive":
            raise
        raise ScheduleError(
            "the adaptive schedules (needed with failed workers) are not available in this build: "
            "use a fault-free family (gpipe, 1f1b, zb-h1, zb-h2) without failures"
        ) from None
    sol = adaptive_solution(topology, microbatches, costs, solver=solver, time_limit=time_limit,
                            **({"recut": True} if recut else {}))
    with paused_gc():  # (as `adaptive_order` decodes it: millions of small acyclic objects at scale)
        order: Order = sol.order()
        # The summary's simulation is the solver's own timing of these sequences: what it reports is kept,
        # the sequences themselves are not (a million ints at scale, alive through `check`).
        timed = None if sol.timing is None else solver_timing(sol.problem, sol.seqs, sol.timing, ITERATIONS,
                                                              sol.synchronous)
    solver_name, bound = sol.solver, (sol.bound if sol.bound > 0 else None)
    del sol
    plan = lower(dataclasses.replace(order, partition=partition), costs, solver=solver_name, lower_bound=bound)
    del order  # (its ops live on in the plan's instructions; its tuples go before `check`'s tables)
    check(plan)
    remember(plan, timed)
    return plan


def job_layers(topology: Topology, costs: CostModel, layers: LayerCosts | int | None, partition: Sequence[int] | None,
               *, given_costs: bool = False) -> tuple[LayerCosts, Partition, CostModel]:
    """(layer costs, the job's partition, the job's stage model) for `compile(layers=, partition=)`:
    K layers split each stage of `costs` evenly; a partition without layer costs is refused."""
    if layers is None:
        raise ScheduleError("a partition needs per-layer costs: pass layers=K (layers per stage) or a LayerCosts")
    if topology.chunks > 1:
        raise ScheduleError(f"layers run one stage per worker, not chunks={topology.chunks}: drop chunks or layers")
    if isinstance(layers, bool) or not isinstance(layers, (int, LayerCosts)):
        raise SchedcompTypeError(f"layers must be layers per stage (an int) or a LayerCosts, got {layers!r}")
    if isinstance(layers, int):
        layers = LayerCosts.even(costs, layers)
    elif given_costs:
        raise CostModelError("give either a stage cost model or per-layer costs, not both: the stage model is "
                             "derived from the layers")
    else:
        layers.costs.check_workers(topology)
    if partition is None:
        job_partition = even(layers.layers, topology.stages)
    else:
        job_partition = as_partition(partition, topology.stages, "partition")
    return layers, job_partition, stage_costs(layers, job_partition)


def _repartitioned(topology: Topology, microbatches: int, costs: CostModel, layers: LayerCosts,
                   job_partition: Partition, solver: str, time_limit: float, recut: bool) -> Plan:
    """Re-route and re-partition (`schedcomp.repartition`): the best candidate's plan, with its partition
    (and, with `recut`, its cut)."""
    from schedcomp.repartition import repartition

    best = repartition(topology, microbatches, layers, job_partition, costs, solver=solver, time_limit=time_limit,
                       recut=recut)
    plan = lower(dataclasses.replace(best.order, partition=best.partition), best.costs, solver=best.solver,
                 lower_bound=best.bound, meta=best.meta(job_partition))
    check(plan)
    return plan
