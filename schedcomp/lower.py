"""Lowering: a compute-only `Order` -> a `Plan` with loads, transfers, all-reduce and step.

For each worker, in its compute order:
- receives are posted one compute op early (before the op that precedes their consumer), so
  the transfer overlaps that op;
- `LOAD` comes right before a forward at the first stage (inputs) and the last stage (targets);
- a send follows the op that produced its tensor;
- the stream ends with `ALLREDUCE` then `STEP`.

NCCL matches point-to-point messages between two ranks in posting order, whatever the tag, so
on every channel (sender X -> receiver Y) Y must post its receives in the order X posts its
sends. Sends follow X's compute order; when Y needs a receive, it first posts every receive
that X sends earlier on that channel and that Y has not posted yet.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from schedcomp.costs import CostModel
from schedcomp.errors import ScheduleError
from schedcomp.ir import InstrKind, Instruction, Op, OpKind, Order, Plan
from schedcomp.topology import Worker

Tensor = tuple[str, int, int, int]
"""A tensor crossing a stage boundary: ("act" | "grad", pipeline, microbatch, producing stage)."""

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
) -> Plan:
    """Turn `order` into instruction streams; the result is checked by `schedcomp.check.check`."""
    topology = order.topology
    pp = topology.pp
    runner = order.runner()

    def missing(d: int, m: int, stage: int) -> ScheduleError:
        return ScheduleError(
            f"the order has no F for micro-batch {m} of pipeline {d} at stage {stage}, which a neighbouring "
            "stage sends to or receives from: give every (pipeline, micro-batch, stage) an F"
        )

    # Every worker's sends, in its compute order: (op producing it, tensor, receiver).
    sends: dict[Worker, list[tuple[Op, Tensor, Worker]]] = {}
    for w, ops in order.ops.items():
        out = sends[w] = []
        for op in ops:
            d, m, s = op.key
            if op.kind is OpKind.F and s < pp - 1:
                tensor, to = ("act", d, m, s), (d, m, s + 1)
            elif op.kind in (OpKind.B, OpKind.BW) and s > 0:
                tensor, to = ("grad", d, m, s), (d, m, s - 1)
            else:
                continue
            if to not in runner:
                raise missing(*to)
            out.append((op, tensor, runner[to]))

    # Per channel (X, Y): the tensors in X's send order, and where each one sits in it.
    channel: dict[tuple[Worker, Worker], list[Tensor]] = {}
    for x, out in sends.items():
        for _, tensor, y in out:
            channel.setdefault((x, y), []).append(tensor)
    position = {tensor: i for tensors in channel.values() for i, tensor in enumerate(tensors)}

    streams = {w: _stream(w, ops, pp, runner, sends[w], channel, position) for w, ops in order.ops.items()}
    return Plan(
        topology=topology,
        costs=costs,
        microbatches=order.microbatches,
        streams=streams,
        family=order.family,
        solver=solver,
        lower_bound=lower_bound,
        meta=dict(meta or {}),
    )


def _stream(
    w: Worker,
    ops: tuple[Op, ...],
    pp: int,
    runner: Mapping[tuple[int, int, int], Worker],
    sends: list[tuple[Op, Tensor, Worker]],
    channel: Mapping[tuple[Worker, Worker], list[Tensor]],
    position: Mapping[Tensor, int],
) -> tuple[Instruction, ...]:
    """One worker's stream (see the module docstring for where each instruction goes)."""
    # What this worker receives: tensor -> (consumer op here, sender), and per op its one input.
    consumer: dict[Tensor, tuple[Op, Worker]] = {}
    needs: list[Tensor | None] = []
    for op in ops:
        d, m, s = op.key
        tensor: Tensor | None = None
        if op.kind is OpKind.F and s > 0:
            tensor = ("act", d, m, s - 1)
            consumer[tensor] = (op, runner[(d, m, s - 1)])
        elif op.kind in (OpKind.B, OpKind.BW) and s < pp - 1:
            tensor = ("grad", d, m, s + 1)
            consumer[tensor] = (op, runner[(d, m, s + 1)])
        needs.append(tensor)
    for (x, y), tensors in channel.items():
        for t in tensors if y == w else ():
            if t not in consumer:
                what = "F" if t[0] == "act" else "B or BW"
                stage = t[3] + 1 if t[0] == "act" else t[3] - 1
                raise ScheduleError(
                    f"{x} sends {w} a tensor of micro-batch {t[2]} of pipeline {t[1]} but {w} runs no {what} "
                    f"for it at stage {stage}: run F, B and W of a (pipeline, micro-batch, stage) on one worker"
                )

    out: list[Instruction] = []
    posted: dict[Worker, int] = {}  # sender -> how many of its sends to us are received

    def post(tensor: Tensor | None) -> None:
        if tensor is None:
            return
        x = consumer[tensor][1]
        tensors = channel[(x, w)]
        done, upto = posted.get(x, 0), position[tensor]
        for t in tensors[done : upto + 1]:  # earlier-sent tensors first: FIFO per channel
            op_here = consumer[t][0]
            kind = InstrKind.RECV_ACT if t[0] == "act" else InstrKind.RECV_GRAD
            out.append(Instruction(kind, op_here, x))
        posted[x] = max(done, upto + 1)

    sends_of: dict[Op, list[tuple[Tensor, Worker]]] = {}
    for op, tensor, y in sends:
        sends_of.setdefault(op, []).append((tensor, y))

    if ops:
        post(needs[0])
    for j, op in enumerate(ops):
        if j + 1 < len(ops):
            post(needs[j + 1])  # early: overlaps this op
        if op.kind is OpKind.F and (op.stage == 0 or op.stage == pp - 1):
            out.append(Instruction(InstrKind.LOAD, op))
        out.append(Instruction(_COMPUTE[op.kind], op))
        for tensor, y in sends_of.get(op, ()):
            kind = InstrKind.SEND_ACT if tensor[0] == "act" else InstrKind.SEND_GRAD
            out.append(Instruction(kind, op, y))
    out += [_ALLREDUCE, _STEP]
    return tuple(out)
