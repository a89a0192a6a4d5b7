"""Lowering: a compute-only `Order` -> a `Plan` with loads, transfers, all-reduce and step.

For each worker, in its compute order:
- receives are posted one compute op early (before the op that precedes their consumer), so
  the transfer overlaps that op;
- `LOAD` comes right before a forward at the first stage (inputs) and the last stage (targets);
- a send follows the op that produced its tensor;
- with virtual stages (`Topology.chunks` > 1) stages are the model's chunks: a tensor between two
  chunks that the same worker runs is handed off locally (no SEND or RECV: stream order carries it,
  and `check` proves the producer comes first), any other goes to the worker running the neighbour;
- the stream ends with `ALLREDUCE` then `STEP`;
- with per-pipeline partitions (re-formed pipelines, `schedcomp.partitions`) a pipeline's ops run at its
  held stages only: a tensor goes to the next (previous) held stage of its pipeline, over any gap, and
  LOAD feeds the forwards of its first and last held stage. Its ALLREDUCE reduces each of the worker's
  segments in layer order (one instruction: what it reduces is the plan's partitions').

NCCL matches point-to-point messages between two ranks in posting order, whatever the tag, so
on every channel (sender X -> receiver Y) Y must post its receives in the order X posts its
sends. Sends follow X's compute order; when Y needs a receive, it first posts every receive
that X sends earlier on that channel and that Y has not posted yet.

An order without problems is lowered over columns, all ops at once (`schedcomp.lower_columns`); any other
takes the op-by-op path below, which gives the same streams or names the first problem.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from schedcomp.costs import CostModel
from schedcomp.errors import ScheduleError
from schedcomp.gcpause import paused_gc
from schedcomp.ir import INSTRUCTION_SETTERS, InstrKind, Instruction, Op, OpKind, Order, Plan
from schedcomp.lower_columns import lower_streams
from schedcomp.partitions import Reach, held_ends, neighbours, reach
from schedcomp.topology import Worker

Tensor = int
"""A tensor crossing a stage boundary: `producing slot * 2 + (0 activation | 1 input gradient)`, where the
slot of (pipeline d, micro-batch m, stage s) is `(d * microbatches + m) * stages + s`. Ints, not tuples:
a 200k-row plan looks tensors up millions of times, and an int hashes in one step."""

_COMPUTE = {kind: InstrKind(kind.value) for kind in OpKind}
_ALLREDUCE = Instruction(InstrKind.ALLREDUCE)
_STEP = Instruction(InstrKind.STEP)


def lower(
    order: Order,
    costs: CostModel,
    *,
    solver: str = "",
    lower_bound: float | None = None,
    meta: Mapping[str, Any] | None = None,
    pipeline_costs: Mapping[int, CostModel] | None = None,
    layer_allreduce: Sequence[float] = (),
) -> Plan:
    """Turn `order` into instruction streams; the result is checked by `schedcomp.check.check`.
    With `order.partitions`: `pipeline_costs`, the stage cost model of each pipeline whose partition is not
    `order.partition`, and `layer_allreduce`, each layer's all-reduce time (`Plan.pipeline_costs`,
    `Plan.layer_allreduce`)."""
    with paused_gc():  # (the op-by-op path makes many small acyclic objects: see `schedcomp.gcpause`)
        plan = _lower(order, costs, solver, lower_bound, meta)
    if not pipeline_costs and not layer_allreduce:
        return plan
    return replace(plan, pipeline_costs=dict(pipeline_costs or {}), layer_allreduce=tuple(map(float, layer_allreduce)))


def _lower(
    order: Order, costs: CostModel, solver: str, lower_bound: float | None, meta: Mapping[str, Any] | None
) -> Plan:
    streams = lower_streams(order, (_ALLREDUCE, _STEP))  # all ops at once, for an order with no problem
    if streams is not None:
        return _plan(order, costs, streams, solver, lower_bound, meta)
    reached = None if order.partitions is None else reach(order.partitions)  # neighbours across gaps
    ends = None if order.partitions is None else [held_ends(p) for p in order.partitions]  # what LOAD feeds
    # Op by op: the same streams, or the first problem named.
    topology = order.topology
    pp = topology.stages  # virtual stages: the model's stages, whichever workers hold them
    mbs = order.cut.width(order.microbatches)  # slot ids' stride: a re-cut pipeline may run more pieces than M
    # Workers are numbered by their place in `order.ops` and every per-worker table below is a list
    # indexed by that number: hashing the `Worker` dataclass per op cost more than the lowering itself.
    workers = list(order.ops)
    runner: dict[int, int] = {}  # slot (see `Tensor`) -> the worker running its F
    F, B, BW = OpKind.F, OpKind.B, OpKind.BW
    cut = order.cut if order.cut else None  # (tested once: per op it cost a method call on a 2.4M-op plan)
    for x, ops in enumerate(order.ops.values()):
        for op in ops:
            count = mbs if cut is None else cut.count(op.pipeline, order.microbatches)
            if not (0 <= op.microbatch < count and 0 <= op.stage < pp):  # slots are distinct only in range
                raise ScheduleError(f"{workers[x]} runs {op} of stage {op.stage}, outside micro-batches "
                                    f"0..{count - 1} and stages 0..{pp - 1}: give ops of this job only")
            if op.kind is F:
                runner[(op.pipeline * mbs + op.microbatch) * pp + op.stage] = x

    # Every op sends at most one tensor: per worker, per op index, (tensor, receiver) or None.
    sends: list[list[tuple[Tensor, int] | None]] = []
    # Per receiver, per sender: the tensors on that channel in the sender's order (FIFO per channel).
    inbound: list[dict[int, list[Tensor]]] = [{} for _ in workers]
    for x, ops in enumerate(order.ops.values()):
        out: list[tuple[Tensor, int] | None] = []
        sends.append(out)
        for op in ops:
            kind, s = op.kind, op.stage
            slot = (op.pipeline * mbs + op.microbatch) * pp + s
            up, down = (s + 1, s - 1) if reached is None else _around(reached, op.pipeline, s)
            if kind is F and up < pp:
                tensor, to = slot * 2, slot + up - s
            elif (kind is B or kind is BW) and down >= 0:
                tensor, to = slot * 2 + 1, slot + down - s
            else:
                out.append(None)
                continue
            y = runner.get(to)
            if y is None:
                raise _missing(to, mbs, pp)
            if y == x:  # the next chunk runs here too: a local hand-off
                out.append(None)
                continue
            out.append((tensor, y))
            lst = inbound[y].get(x)
            if lst is None:
                inbound[y][x] = [tensor]
            else:
                lst.append(tensor)

    streams = {
        w: _stream(x, ops, pp, mbs, runner, workers, sends[x], inbound[x], reached, ends)
        for x, (w, ops) in enumerate(order.ops.items())
    }
    return _plan(order, costs, streams, solver, lower_bound, meta)


def _plan(order: Order, costs: CostModel, streams: Mapping[Worker, tuple[Instruction, ...]], solver: str,
          lower_bound: float | None, meta: Mapping[str, Any] | None) -> Plan:
    return Plan(
        topology=order.topology,
        costs=costs,
        microbatches=order.microbatches,
        streams=streams,
        family=order.family,
        solver=solver,
        lower_bound=lower_bound,
        meta=dict(meta or {}),
        cut=order.cut,
        partition=order.partition,
        partitions=order.partitions,
    )


def _around(reached: Reach, pipeline: int, stage: int) -> tuple[int, int]:
    """The next and previous held stage of `pipeline` around `stage` (past the ends: out of range)."""
    if not 0 <= pipeline < len(reached):
        return stage + 1, stage - 1  # (an op of no pipeline: the range checks name it)
    return neighbours(reached, pipeline, stage)


def _slot_key(slot: int, mbs: int, pp: int) -> tuple[int, int, int]:
    """(pipeline, micro-batch, stage) of a slot id."""
    rest, stage = divmod(slot, pp)
    return (*divmod(rest, mbs), stage)


def _missing(slot: int, mbs: int, pp: int) -> ScheduleError:
    d, m, stage = _slot_key(slot, mbs, pp)
    return ScheduleError(
        f"the order has no F for micro-batch {m} of pipeline {d} at stage {stage}, which a neighbouring "
        "stage sends to or receives from: give every (pipeline, micro-batch, stage) an F"
    )


def _not_sent(w: Worker, op: Op, runner: Worker, t: Tensor, mbs: int, pp: int) -> ScheduleError:
    what = "activation" if t & 1 == 0 else "gradient"
    return ScheduleError(
        f"{w} runs {op} of stage {op.stage}, but {runner}, which runs stage {_slot_key(t >> 1, mbs, pp)[2]}'s F of "
        f"it, does not send it the {what} it needs: give every (pipeline, micro-batch, stage) exactly one F and one "
        "B or BW, run on one worker"
    )


_RECV = (InstrKind.RECV_ACT, InstrKind.RECV_GRAD)  # by a tensor's low bit
_SEND = (InstrKind.SEND_ACT, InstrKind.SEND_GRAD)


def _stream(
    me: int,
    ops: tuple[Op, ...],
    pp: int,
    mbs: int,
    runner: Mapping[int, int],
    workers: list[Worker],
    sends: list[tuple[Tensor, int] | None],
    inbound: Mapping[int, list[Tensor]],
    reached: Reach | None = None,
    ends: list[tuple[int, int]] | None = None,
) -> tuple[Instruction, ...]:
    """The stream of worker number `me` (see the module docstring for where each instruction goes);
    workers are named by their number in `workers`."""
    w = workers[me]
    # `Instruction.trusted` inlined (the fields are right by construction): a Python call per instruction was a
    # fifth of lowering 3.6 million of them.
    new, set_kind, set_op, set_peer = object.__new__, *INSTRUCTION_SETTERS
    instruction = Instruction
    # What this worker receives: tensor -> (consumer op here, sender), and per op its one input.
    consumer: dict[Tensor, tuple[Op, int]] = {}
    needs: list[Tensor | None] = []
    F, B, BW = OpKind.F, OpKind.B, OpKind.BW
    for op in ops:
        kind, s = op.kind, op.stage
        tensor: Tensor | None = None
        up, down = (s + 1, s - 1) if reached is None else _around(reached, op.pipeline, s)
        if kind is F and down >= 0:
            source = (op.pipeline * mbs + op.microbatch) * pp + down
            tensor = source * 2
        elif (kind is B or kind is BW) and up < pp:
            source = (op.pipeline * mbs + op.microbatch) * pp + up
            tensor = source * 2 + 1
        if tensor is not None:
            x = runner.get(source)
            if x is None:
                raise _missing(source, mbs, pp)
            if x == me:  # produced here, by another chunk: a local hand-off, nothing to receive
                tensor = None
            else:
                consumer[tensor] = (op, x)
        needs.append(tensor)
    position: dict[Tensor, int] = {}  # tensor -> its place on its channel
    for x, tensors in inbound.items():
        for i, t in enumerate(tensors):
            position[t] = i
            if t not in consumer:
                what = "F" if t & 1 == 0 else "B or BW"
                d, m, stage = _slot_key(t >> 1, mbs, pp)
                stage += 1 if t & 1 == 0 else -1
                raise ScheduleError(
                    f"{workers[x]} sends {w} a tensor of micro-batch {m} of pipeline {d} but {w} runs no {what} "
                    f"for it at stage {stage}: run F, B and W of a (pipeline, micro-batch, stage) on one worker"
                )
    out: list[Instruction] = []
    append = out.append
    posted: dict[int, int] = {}  # sender -> how many of its sends to us are posted (FIFO per channel)
    LOAD, last_stage = InstrKind.LOAD, pp - 1
    # Receives are posted one op early (they overlap the op before their consumer): before op j, post
    # what op j + 1 needs, and before op 0 what op 0 needs. Inlined, not a helper: millions of calls.
    needs.append(None)  # after the last op: nothing
    for j, tensor in enumerate(needs, -1):  # tensor: what op j + 1 needs
        if tensor is not None:
            x = consumer[tensor][1]
            upto = position.get(tensor)
            if upto is None or x not in inbound:
                raise _not_sent(w, ops[j + 1], workers[x], tensor, mbs, pp)
            done = posted.get(x, 0)
            if upto >= done:
                peer = workers[x]
                for t in inbound[x][done : upto + 1]:  # earlier-sent tensors first: FIFO per channel
                    ins = new(instruction)
                    set_kind(ins, _RECV[t & 1])
                    set_op(ins, consumer[t][0])
                    set_peer(ins, peer)
                    append(ins)
                posted[x] = upto + 1
        if j < 0:
            continue
        op = ops[j]
        kind = op.kind
        if kind is F and ((op.stage == 0 or op.stage == last_stage) if ends is None
                          else op.stage in ends[op.pipeline]):  # re-formed: its pipeline's first and last held
            ins = new(instruction)
            set_kind(ins, LOAD)
            set_op(ins, op)
            set_peer(ins, None)
            append(ins)
        ins = new(instruction)
        set_kind(ins, _COMPUTE[kind])
        set_op(ins, op)
        set_peer(ins, None)
        append(ins)
        sent = sends[j]
        if sent is not None:
            ins = new(instruction)
            set_kind(ins, _SEND[sent[0] & 1])
            set_op(ins, op)
            set_peer(ins, workers[sent[1]])
            append(ins)
    out += [_ALLREDUCE, _STEP]
    return tuple(out)
