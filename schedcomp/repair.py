"""Plan repair: the plan in use and one more failed worker in, a valid plan out at once.

`repair(plan, worker)` re-routes only the failed worker's work and keeps everything else:

1. the failed worker's slots (each micro-batch it ran at its stage: its own and any it had taken over),
   in the order of their F, go to live peers of its stage: to the least-loaded peer (compute ops over
   speed factor) that has memory to spare all along its stream, where the slot's F takes the place the
   failed worker's F had in its compute order, its B likewise and its W right after the B (which frees
   the memory soonest). The neighbours then send and receive each tensor at about the time they did;
2. where no peer has room all along (every peer at the memory limit, as in small jobs), the F waits on
   the least-loaded peers until memory allows (the end of a stream always does), but never past a slot
   taken earlier that ran after it on the failed worker: its neighbours expect them in that order. A
   slot that cannot be placed so is a `RecoveryError` (compile for the new failure set instead);
3. the streams of the peers that took slots and of the failed worker's neighbours are lowered again
   (`lower`'s per-worker step, over their new compute orders, with who runs each neighbouring slot read
   off the streams' own transfers); every other stream is the very tuple it was.

The work is that of the few streams touched, not of the job: at pp = 32, dp = 256, M = 64 with 16
failures a repair takes about 0.2 s where the full compile takes tens of seconds (`bench/bench_compile_speed.py`).
A local re-route is not always sound (a peer's own order can cross a taken slot's through a neighbour
that runs both), so the result is checked (`check`, seconds at that scale) unless `validate=False`, and a
check that fails is a `RecoveryError`. The repaired plan is a stop-gap: its period is worse than a full
compile's for the new failure set, which replaces it at an iteration boundary when ready.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from schedcomp.check import check
from schedcomp.costs import CostModel
from schedcomp.errors import RecoveryError, SchedcompTypeError, ScheduleError, TopologyError, ValidationError
from schedcomp.ir import COMPUTE_KINDS, Instruction, Op, OpKind, Plan
from schedcomp.lower import _stream
from schedcomp.memory import stage_deltas
from schedcomp.semantics import InstrKind
from schedcomp.topology import Topology, Worker, as_workers

__all__ = ["lookup_or_repair", "repair"]

TRIALS = 16
"""Least-loaded peers tried for a slot when none has memory to spare all along: bounds a repair's time
whatever the job's width."""


@dataclass(frozen=True)
class _Slot:
    """One (pipeline, micro-batch) the failed worker ran: its ops and their places in its compute order."""

    ops: tuple[Op, ...]  # F, then B and W (or BW), in the failed worker's order
    at: tuple[int, ...]  # each op's index in the failed worker's compute order


def repair(plan: Plan, failed: Worker | tuple[int, int] | str, *, validate: bool = True) -> Plan:
    """`plan` with `failed` dead too, by a local re-route (see the module docstring); checked unless
    `validate=False`. Raises `TopologyError` for a worker outside the job or already failed,
    `RecoveryError` when its stage has no live worker left, `ScheduleError` for plans with virtual stages
    or re-cut micro-batches."""
    if not isinstance(plan, Plan):
        raise SchedcompTypeError(f"repair needs a Plan, got {type(plan).__name__}")
    topo = plan.topology
    worker = _worker(topo, failed)
    if topo.chunks > 1:
        raise ScheduleError(f"repair re-routes one stage per worker, not chunks={topo.chunks}: compile the plan "
                            "for the new failure set instead")
    if plan.cut:
        raise ScheduleError("repair moves whole micro-batches, and this plan has re-cut ones (--recut): compile "
                            "the plan for the new failure set instead")
    after = Topology(topo.pp, topo.dp, topo.failed | {worker}, topo.chunks, topo.placement)
    peers = after.stage_group(worker.stage)
    if not peers:
        raise RecoveryError(f"{worker} was the last live worker of stage {worker.stage}, so its micro-batches cannot "
                            "be re-routed: recovery needs a checkpoint (restart from the last one)")
    costs = plan.costs  # its memory limit, if any, binds the re-route too
    computes = {g: _compute_ops(plan.streams[g]) for g in peers}
    taken = _place(worker, _slots(plan.streams[worker]), computes, costs)
    repaired = Plan(after, costs, plan.microbatches, _relower(plan, worker, after, taken), plan.family, "repair",
                    None, dict(plan.meta))
    if validate:
        try:
            check(repaired)
        except ValidationError as exc:  # e.g. a peer's own order crosses a taken slot's: its neighbour waits
            raise RecoveryError(f"the local re-route around {worker} does not validate ({exc}): compile the plan "
                                "for the new failure set instead") from None
    return repaired


def lookup_or_repair(plans: Any, failed: Iterable[Worker | tuple[int, int]] | Topology, *,
                     validate: bool = True) -> Plan:
    """`plans.lookup(failed)` (a `PlanCache`), or on a miss the cached plan of the largest set of the
    failed workers in rank order that it holds, repaired around the rest one at a time: a cache of every
    k-failure set then serves more failures at once, with no compile. Deterministic, so every rank of a
    job that calls it gets the same plan (`ResilientTrainer(lambda t: lookup_or_repair(cache, t), ...)`)."""
    try:
        return plans.lookup(failed)  # type: ignore[no-any-return]
    except RecoveryError as miss:
        workers = sorted(failed.failed if isinstance(failed, Topology) else as_workers(failed))
        for n in range(len(workers) - 1, -1, -1):
            try:
                plan: Plan = plans.lookup(workers[:n])
            except RecoveryError:
                continue
            for w in workers[n:]:
                plan = repair(plan, w, validate=validate)
            return plan
        raise miss from None


def _worker(topo: Topology, failed: object) -> Worker:
    (worker,) = as_workers([failed])
    if not (0 <= worker.pipeline < topo.dp and 0 <= worker.stage < topo.pp):
        raise TopologyError(f"worker {worker} is not in the job: pipelines are 0..{topo.dp - 1}, "
                            f"stages 0..{topo.pp - 1}")
    if worker in topo.failed:
        raise TopologyError(f"worker {worker} has failed already: this plan re-routes around it; name a live worker")
    return worker


def _compute_ops(stream: Sequence[Instruction]) -> list[Op]:
    return [ins.op for ins in stream if ins.kind in COMPUTE_KINDS and ins.op is not None]


def _slots(stream: Sequence[Instruction]) -> list[_Slot]:
    """The failed worker's slots, in the order of their F."""
    ops: dict[tuple[int, int], list[tuple[int, Op]]] = {}
    for i, op in enumerate(_compute_ops(stream)):
        ops.setdefault((op.pipeline, op.microbatch), []).append((i, op))
    return [_Slot(tuple(op for _, op in pairs), tuple(i for i, _ in pairs)) for pairs in ops.values()]


class _Peer:
    """A peer's compute order while slots are placed on it, with each op's place on the failed worker's
    clock (own op i at i, a taken op just after the failed worker's op it was; sorted, so a slot's places
    are found by bisection) and the memory it holds after each op."""

    def __init__(self, ops: list[Op], deltas: dict[object, float]) -> None:
        self.ops, self.deltas = ops, deltas
        self.clock = [float(i) for i in range(len(ops))]
        self.taken = [False] * len(ops)
        self.levels = list(itertools.accumulate(deltas[op.kind] for op in ops))

    def room(self, top: float) -> float:
        """Memory to spare all along the stream."""
        return top - max(self.levels, default=0.0)

    def window(self, f_at: float, b_at: float, need: float, top: float) -> tuple[int, int] | None:
        """Where a slot's F and backward go: before op j and before op k (j <= k), from their places on, with
        `need` to spare from j to k (the end of a stream always has it: everything is freed there). Where
        memory is short the F waits, rather than the backward coming early (the peer would then wait for its
        gradient, and on whatever that waits for). None when the F would pass an op taken from the failed
        worker that ran after it there: the neighbours expect them in that order."""
        levels, n = self.levels, len(self.levels)
        start, b_pos = bisect.bisect(self.clock, f_at), bisect.bisect(self.clock, b_at)
        latest = next((i for i in range(start, n) if self.taken[i]), n)
        # The F waits, rather than the backward coming early (the peer would then wait for its gradient, and
        # on whatever that waits for): the first j with room from j to the backward's place.
        short = [i for i in range(max(start - 1, 0), min(b_pos, n)) if levels[i] + need > top]
        j = max(start, short[-1] + 2) if short else start
        while j < n and (levels[j - 1] if j else 0.0) + need > top:
            j += 1
        if j > latest:
            return None
        return j, max(j, min(b_pos, n))

    def take(self, slot: _Slot, j: int, k: int, f_at: float, b_at: float) -> None:
        f_op, *backward = slot.ops
        c = self.clock
        f_clock = max(f_at, c[j - 1] if j else -1.0)
        b_clock = max(b_at, c[k - 1] if k else -1.0, f_clock)
        self.ops = [*self.ops[:j], f_op, *self.ops[j:k], *backward, *self.ops[k:]]
        self.clock = [*c[:j], f_clock, *c[j:k], *([b_clock] * len(backward)), *c[k:]]
        t = self.taken
        self.taken = [*t[:j], True, *t[j:k], *([True] * len(backward)), *t[k:]]
        self.levels = list(itertools.accumulate(self.deltas[op.kind] for op in self.ops))


def _place(worker: Worker, slots: list[_Slot], computes: dict[Worker, list[Op]],
           costs: CostModel) -> dict[Worker, list[Op]]:
    """The new compute orders of the peers that take slots (the others keep theirs)."""
    deltas = stage_deltas(costs, worker.stage)
    limit = costs.limit_at(worker.stage)
    top = limit * (1 + 1e-9) + 1e-9 if math.isfinite(limit) else math.inf
    need = deltas[OpKind.F]  # the most one slot adds (F holds it; B and W only free)
    speed = costs.speed
    load = {g: len(ops) / speed.get(g, 1.0) for g, ops in computes.items()}
    peers = {g: _Peer(list(ops), deltas) for g, ops in computes.items()}
    room = {g: p.room(top) for g, p in peers.items()}
    taken: set[Worker] = set()
    for slot in slots:
        ranked = sorted(computes, key=lambda g: (load[g], -room[g], g))
        f_at, b_at = slot.at[0] + 0.5, (slot.at[1] if len(slot.at) > 1 else slot.at[0]) + 0.5
        # A peer with room all along takes it where the failed worker ran it; else the peer (of the least
        # loaded) where memory lets its F run soonest after that.
        spare = next((g for g in ranked if room[g] >= need), None)
        choices = [spare] if spare is not None else ranked[:TRIALS]
        windows = {g: w for g in choices if (w := peers[g].window(f_at, b_at, need, top)) is not None}
        if not windows:
            raise RecoveryError(
                f"no live peer of {worker} at stage {worker.stage} has the memory to take micro-batch "
                f"{slot.ops[0].microbatch} of pipeline {slot.ops[0].pipeline} in a local re-route: compile the plan "
                "for the new failure set instead")
        g = min(windows, key=lambda c: (windows[c][0] - bisect.bisect(peers[c].clock, f_at), load[c], c))
        peers[g].take(slot, *windows[g], f_at, b_at)
        room[g] = peers[g].room(top)
        load[g] += len(slot.ops) / speed.get(g, 1.0)
        taken.add(g)
    return {g: peers[g].ops for g in sorted(taken)}


_ACT, _GRAD = 0, 1
_SENDS = {InstrKind.SEND_ACT: (1, _ACT), InstrKind.SEND_GRAD: (-1, _GRAD)}  # -> (peer's stage offset, channel)
_RECVS = {InstrKind.RECV_ACT: -1, InstrKind.RECV_GRAD: 1}


def _relower(plan: Plan, worker: Worker, after: Topology, orders: dict[Worker, list[Op]]) -> dict[Worker, tuple]:
    """Every live worker's stream: lowered again for the peers that took slots and the failed worker's
    neighbours, the same tuple for everyone else."""
    pp, mbs = after.stages, plan.microbatches
    old = plan.streams
    neighbours = {ins.peer for ins in old[worker] if ins.peer is not None}
    redo = {w: orders.get(w) or _compute_ops(old[w]) for w in sorted({*orders, *neighbours})}

    def slot(op: Op) -> int:
        return (op.pipeline * mbs + op.microbatch) * pp + op.stage

    # Who runs each slot the re-lowered streams touch, read off their own transfers (and the failed
    # worker's, whose slots then move to their new runners).
    runner: dict[int, Worker] = {}
    for w in (*redo, worker):
        for ins in old[w]:
            op, peer = ins.op, ins.peer
            if op is None:
                continue
            if peer is not None:
                if ins.kind in _SENDS:
                    runner[slot(op) + _SENDS[ins.kind][0]] = peer
                elif ins.kind in _RECVS:
                    runner[slot(op) + _RECVS[ins.kind]] = peer
            elif ins.kind in COMPUTE_KINDS and w != worker:
                runner[slot(op)] = w
    for w, ops in redo.items():
        for op in ops:
            runner[slot(op)] = w
    numbers: dict[Worker, int] = {}
    for w in (*redo, *runner.values()):
        numbers.setdefault(w, len(numbers))
    workers = list(numbers)
    runner_no = {t: numbers[w] for t, w in runner.items()}

    def sends_of(ops: list[Op]) -> list[tuple[int, int] | None]:
        out: list[tuple[int, int] | None] = []
        for op in ops:
            t = slot(op)
            if op.kind is OpKind.F and op.stage < pp - 1:
                out.append((t * 2, runner_no[t + 1]))
            elif op.kind in (OpKind.B, OpKind.BW) and op.stage > 0:
                out.append((t * 2 + 1, runner_no[t - 1]))
            else:
                out.append(None)
        return out

    sends = {w: sends_of(ops) for w, ops in redo.items()}
    inbound: dict[Worker, dict[int, list[int]]] = {w: {} for w in redo}
    for w, out in sends.items():  # channels from a re-lowered sender: its new order
        for sent in out:
            if sent is not None and workers[sent[1]] in inbound:
                inbound[workers[sent[1]]].setdefault(numbers[w], []).append(sent[0])
    for w, ops in redo.items():  # channels from a sender kept as it was: its stream's order
        senders = {runner[t] for t in (_source(op, slot(op), pp) for op in ops) if t is not None}
        for x in senders - redo.keys():
            inbound[w][numbers[x]] = [slot(ins.op) * 2 + _SENDS[ins.kind][1] for ins in old[x]
                                      if ins.peer == w and ins.kind in _SENDS and ins.op is not None]
    streams = {}
    for w, stream in old.items():
        if w == worker:
            continue
        if w in redo:
            me = numbers[w]
            stream = _stream(me, tuple(redo[w]), pp, mbs, runner_no, workers, sends[w], inbound[w])
        streams[w] = stream
    return streams


def _source(op: Op, slot: int, pp: int) -> int | None:
    """The slot whose tensor `op` reads from another stage: an F the previous stage's, a B (or BW) the next's."""
    if op.kind is OpKind.F:
        return slot - 1 if op.stage > 0 else None
    if op.kind is OpKind.W:
        return None
    return slot + 1 if op.stage < pp - 1 else None
