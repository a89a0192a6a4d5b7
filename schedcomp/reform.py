"""`compile(..., reform=(d, ...))`: re-formed pipelines (Oobleck's) as a plan.

Each named pipeline has lost workers; its live workers take all the model's layers between them (the
min-max contiguous partition over them, their speeds counted, as `schedcomp.reformed`'s baseline cuts
them), so it is a shallower pipeline. Every other pipeline keeps the job's partition and has no failure
(re-routing around a failure in a pipeline that is not re-formed, in the same plan, is not compiled
yet). The global batch is re-balanced by throughput: pipeline d's share is proportional to the inverse
of its bottleneck stage's F + B + W per micro-batch (speeds counted), the shares totalling dp x M, each
cut into at least ceil(share) equal pieces (so no piece outgrows a regular micro-batch) and at least as
many as the family needs; a share of exactly M stays M whole micro-batches. Each pipeline runs the
family's order over its held stages (`schedule` when it is a one-stage family, else ZB-H1) on its own
pieces: pipelines meet only at the per-segment all-reduce.

Both candidates are lowered, checked and timed: equal shares (M each) and the shares by throughput; the
faster wins (ties: fewer pieces, then equal shares: the batch as the job cuts it), a candidate over the
memory limit drops out. Each is tried with the re-formed pipelines' pieces 1, 2 and 4 times finer
(`FINER`): their workers hold more layers, so a piece holds more activation, and smaller ones fit a
memory limit that whole micro-batches break. `meta["reform"]` says which won.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

from schedcomp.check import check
from schedcomp.choice import Timed
from schedcomp.costs import CostModel
from schedcomp.cut import NO_CUT, Cut
from schedcomp.errors import MemoryLimitError, SchedcompTypeError, ScheduleError, ValidationError
from schedcomp.ir import Op, Order, Plan
from schedcomp.layers import LayerCosts, moved_limit, stage_costs
from schedcomp.lower import lower
from schedcomp.memory import limit_top, stage_deltas
from schedcomp.partition import Partition
from schedcomp.partitions import Partitions, held_stages
from schedcomp.repartition import live_partition
from schedcomp.schedules import ONE_STAGE_FAMILIES, get_family
from schedcomp.schedules.family import StageOrders
from schedcomp.topology import Topology, Worker

DEFAULT_FAMILY = "zb-h1"
FINER = (1, 2, 4)
"""How many times finer a re-formed pipeline's pieces may be cut (its workers hold more layers, so a piece
holds more activation; smaller ones fit a memory limit that whole micro-batches break)."""


def lost_pipelines(topology: Topology) -> tuple[int, ...]:
    """The pipelines that lost workers: what `reform="auto"` re-forms (every one must be)."""
    return tuple(sorted({w.pipeline for w in topology.failed}))


def reform_pipelines(value: object, topology: Topology) -> tuple[int, ...]:
    """`reform=` checked: pipelines of the job, each with a failed and a live worker, covering every pipeline
    that has a failure; ScheduleError in one line otherwise."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise SchedcompTypeError(f"reform must be a list of pipelines to re-form, got {type(value).__name__}")
    pipes = list(value)
    if not pipes or not all(isinstance(d, int) and not isinstance(d, bool) for d in pipes):
        raise SchedcompTypeError(f"reform must name pipelines by number, e.g. reform=(3,), got {value!r}")
    hit = set(lost_pipelines(topology))
    for d in pipes:
        if not 0 <= d < topology.dp or d not in hit:
            raise ScheduleError(f"reform names pipeline {d}, which lost no worker: re-form the pipelines that lost "
                                f"workers ({', '.join(map(str, sorted(hit))) or 'none'})")
        if all(Worker(d, s) in topology.failed for s in range(topology.pp)):
            raise ScheduleError(f"pipeline {d} lost every worker: there is nothing left to re-form")
    if hit - set(pipes):
        rest = ", ".join(map(str, sorted(hit - set(pipes))))
        raise ScheduleError(f"pipeline(s) {rest} lost workers but are not re-formed: re-form every pipeline that "
                            "lost workers (re-routing beside re-formed pipelines is not compiled yet)")
    if topology.chunks > 1:
        raise ScheduleError("re-formed pipelines run one stage per worker, not chunks: drop chunks or reform")
    return tuple(sorted(set(pipes)))


def reformed_partition(layers: LayerCosts, costs: CostModel, topology: Topology, pipeline: int) -> Partition:
    """Pipeline `pipeline`'s partition: the min-max contiguous partition of the layers over its live places
    (weighted by their speeds), 0 at its failed places."""
    live = [s for s in range(topology.pp) if Worker(pipeline, s) not in topology.failed]
    found = live_partition(layers, costs.speed, pipeline, live)
    out = [0] * topology.pp
    for s, n in zip(live, found, strict=True):
        out[s] = n
    return tuple(out)


def compile_reformed(topology: Topology, microbatches: int, costs: CostModel, layers: LayerCosts,
                     job_partition: Partition, reform: object, schedule: str) -> Plan:
    """The plan of the module docstring (`costs`: the job's stage model, its memory limit resolved)."""
    return timed_reformed(topology, microbatches, costs, layers, job_partition, reform, schedule).plan


def timed_reformed(topology: Topology, microbatches: int, costs: CostModel, layers: LayerCosts,
                   job_partition: Partition, reform: object, schedule: str) -> Timed:
    """`compile_reformed`'s plan with the period its variants were compared by (`reform="auto"` compares it
    with re-routing's)."""
    pipes = reform_pipelines(reform, topology)
    family = schedule if schedule in ONE_STAGE_FAMILIES and schedule != "1f1b" else DEFAULT_FAMILY
    partitions: Partitions = tuple(reformed_partition(layers, costs, topology, d) if d in pipes else job_partition
                                   for d in range(topology.dp))
    times = {d: dataclasses.replace(stage_costs(layers, partitions[d]), speed=costs.speed)  # the job's speeds
             for d in pipes}
    from schedcomp.simulator import simulate

    timed: list[tuple[float, int, Plan]] = []  # (period, preference: fewer pieces, equal shares first, plan)
    refused: str | None = None
    candidates = [(name, shares, finer) for finer in FINER for name, shares in (
        ("equal", [float(microbatches)] * topology.dp),
        ("throughput", _shares(partitions, times, costs, topology, microbatches)))]
    least = get_family(family).min_microbatches

    def piece(d: int, shares: list[float], finer: int) -> float:
        return _piece_size(shares[d], microbatches, finer, least(len(held_stages(partitions[d]))))

    built_ops: PipelineOps = {}
    for rank, (name, shares, finer) in enumerate(candidates):
        try:  # each re-formed stage's limit (the static-memory rule), with room for one of its pieces
            own = {d: times[d].with_memory_limit(moved_limit(layers, partitions[d], costs, job_partition,
                                                             piece=piece(d, shares, finer))) for d in pipes}
        except MemoryLimitError as exc:  # no room for this candidate's pieces: finer ones may fit
            refused = str(exc)
            continue
        order = _order(topology, microbatches, partitions, job_partition, shares, family,
                       dict.fromkeys(pipes, finer), built_ops)
        if rank < len(candidates) - 1 and _over_limit(order, costs, own):  # (the last one is lowered and
            continue  # checked whatever it holds: when every variant is refused, `check` says why)
        plan = lower(order, costs, pipeline_costs=own, layer_allreduce=layers.costs.allreduce,
                     meta={"reform": {"pipelines": list(pipes), "shares": name, "finer": finer,
                                      "partitions": [list(p) for p in partitions]}})
        try:
            check(plan)
        except ValidationError as exc:  # a fixed family cannot trade time for memory: finer pieces may fit
            if "memory_limit" not in str(exc):
                raise
            refused = str(exc)
            continue
        timed.append((simulate(plan).period, rank, plan))
    if not timed:
        raise MemoryLimitError(f"no re-formed plan fits the memory limit, even with {FINER[-1]}x finer pieces "
                               f"({refused}): raise memory_limit or re-route instead")
    period, _, plan = min(timed, key=lambda t: (round(t[0], 9), t[1]))
    return Timed(plan, period)


def _over_limit(order: Order, costs: CostModel, own: dict[int, CostModel]) -> bool:
    """Whether a worker of `order` holds more activation than its limit (`own`: a re-formed pipeline's costs):
    `check`'s memory rule, summed as it sums the lowered plan (each worker's compute ops' deltas, times a
    piece's size, in order: lowering keeps them), so a variant it would refuse is not lowered."""
    cut = order.cut or None
    for w, ops in order.ops.items():
        c = own.get(w.pipeline, costs)
        top = limit_top(c.limit_at(w.stage))
        if top == math.inf:
            continue
        deltas, held = stage_deltas(c, w.stage), 0.0
        for op in ops:
            held += deltas[op.kind] * cut.size(op.pipeline, op.microbatch) if cut else deltas[op.kind]
            if held > top:
                return True
    return False


def _shares(partitions: Partitions, own: dict[int, CostModel], costs: CostModel, topology: Topology,
            microbatches: int) -> list[float]:
    """Each pipeline's share of the global batch by throughput (module docstring), totalling dp x M."""
    speed = []
    for d, partition in enumerate(partitions):
        c = own.get(d, costs)
        slowest = max((c.forward[s] + c.backward_input[s] + c.backward_weight[s])
                      / costs.speed.get(Worker(d, s), 1.0) for s in held_stages(partition))
        speed.append(1.0 / slowest if slowest > 0 else 1.0)
    total = topology.dp * microbatches
    shares = [total * v / math.fsum(speed) for v in speed]
    shares[-1] = total - math.fsum(shares[:-1])  # (the total exact whatever the rounding)
    return shares


def _piece_count(share: float, microbatches: int, finer: int, least: int) -> int | None:
    """How many equal pieces a pipeline cuts its share into: at least ceil(share) (none over a micro-batch),
    `finer` times that, and at least `least` (the family's minimum); None: its M whole micro-batches."""
    if share == microbatches and finer == 1:
        return None
    return max(math.ceil(share * finer - 1e-9), least, 1)


def _piece_size(share: float, microbatches: int, finer: int, least: int) -> float:
    """The size of each of a pipeline's pieces, in micro-batches (`_piece_count`)."""
    count = _piece_count(share, microbatches, finer, least)
    return 1.0 if count is None else share / count


PipelineOps = dict[tuple[int, int], dict[Worker, tuple[Op, ...]]]
"""(pipeline, pieces) -> its workers' ops: what `_order` built for one variant, the same for the next variant
that cuts that pipeline alike (a pipeline's held stages are the same in every variant)."""


def _order(topology: Topology, microbatches: int, partitions: Partitions, job_partition: Partition,
           shares: list[float], family: str, finer: dict[int, int], built_ops: PipelineOps | None = None) -> Order:
    """Each pipeline runs `family` over its held stages on its pieces of its share (`finer[d]` times as many
    as it needs for pieces of at most a micro-batch). `built_ops`: the pipelines' ops built for earlier
    variants, which this one adds to."""
    fam = get_family(family)
    ops: dict[Worker, tuple[Op, ...]] = {}
    bounds: dict[int, tuple[float, ...]] = {}
    built: dict[tuple[int, int], StageOrders] = {}  # (stages, pieces) -> the family's orders: most pipelines share one
    built_ops = {} if built_ops is None else built_ops
    for d, (partition, share) in enumerate(zip(partitions, shares, strict=True)):
        held = held_stages(partition)
        cut = _piece_count(share, microbatches, finer.get(d, 1), fam.min_microbatches(len(held)))
        pieces = microbatches if cut is None else cut
        if cut is not None:
            bounds[d] = (*(share * i / pieces for i in range(pieces)), share)
        if pieces < fam.min_microbatches(len(held)):
            raise ScheduleError(f"{family} over {len(held)} stages needs at least {fam.min_microbatches(len(held))} "
                                f"micro-batches, pipeline {d} runs {pieces}: use more micro-batches")
        if (d, pieces) not in built_ops:
            shape = (len(held), pieces)
            if shape not in built:
                built[shape] = fam.orders(len(held), pieces, 1)
            built_ops[d, pieces] = {Worker(d, s): tuple(Op(o.kind, d, o.microbatch, s) for o in stage_ops)
                                    for s, stage_ops in zip(held, built[shape], strict=True)}
        ops.update(built_ops[d, pieces])
    cut = Cut.of(bounds, shares=True) if bounds else NO_CUT
    return Order(topology, microbatches, ops, f"reformed-{family}", cut=cut, partition=job_partition,
                 partitions=partitions)
