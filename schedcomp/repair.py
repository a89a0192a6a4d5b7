"""Plan repair: the plan in use and one more failed worker in, a valid plan out at once.

`repair(plan, worker)` re-routes only the failed worker's work and keeps everything else. It works on one
global timeline, the start times of the plan in use (`optimes.op_times`): every stream runs its ops in the
order of their times, and every op starts after the ops it reads from. So

1. the failed worker's slots (each micro-batch it ran at its stage), in the order of their F, go to live
   peers of its stage, each op at its time on the failed worker: inserted into the peer's compute order
   where that time falls, its W right after its B (which frees the memory soonest). Every touched stream
   stays sorted by time and every moved op keeps a time between its producers' and its consumers', so one
   global order is consistent with all streams and all dependencies, and the plan cannot deadlock (the
   standard list-scheduling argument);
2. where the peer would exceed the memory limit, the F waits (a later time, but before its consumer at the
   next stage) and the backward comes as early as its producers allow; never against the timeline. Where
   every peer (of the `TRIALS` least loaded) is full all that while (adaptive plans fill the fault-free
   limit), the F waits for memory past its consumer's time: the times are then no longer a timeline, so
   the result is timed, which finds any wait cycle, and one is a `RecoveryError`: only the ops the edit
   can move, from the kept timeline (`OpTimes.edited`, `conetime`: 0.1-0.2 s at pp = 32, dp = 256, where
   timing the whole plan took 0.5-0.7 s). Memory is thus the only reason to refuse (compile for the new
   failure set);
3. the streams of the peers that took slots and of the failed worker's neighbours are lowered again
   (`lower`'s per-worker step, over their new compute orders, with who runs each neighbouring slot read
   off the streams' own transfers); every other stream is the very tuple it was.

The work is that of the few streams touched, not of the job, once the timeline is known: timing a plan at
pp = 32, dp = 256 takes seconds, so it is kept with the plan (the runtime can time the plan in use before
any failure) and a repaired plan carries its own, so repairs chain with no timing unless memory made an
F wait (2.; each repair 0.1-0.4 s, `bench/bench_compile_speed.py --scale`). The result is still checked
(`check`, seconds at that scale) unless `validate=False`; a check that fails is a `RecoveryError`. The
repaired plan is a stop-gap: its period is worse than a full compile's for the new failure set, which
replaces it at an iteration boundary.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from schedcomp.check import check, peak_memory
from schedcomp.costs import CostModel
from schedcomp.errors import RecoveryError, SchedcompTypeError, ScheduleError, TopologyError, ValidationError
from schedcomp.ir import COMPUTE_KINDS, Instruction, Op, OpKind, Plan
from schedcomp.lower import _stream
from schedcomp.memory import FAULT_FREE, MemoryLimit, is_fault_free, resolve_limit, stage_deltas, stage_peak_memory
from schedcomp.optimes import OpTimes, op_times, remember, retimed
from schedcomp.semantics import InstrKind
from schedcomp.topology import Topology, Worker, as_workers

__all__ = ["lookup_or_repair", "repair"]

TRIALS = 16
"""Least-loaded peers tried for a slot when none has memory to spare all along: bounds a repair's time
whatever the job's width."""


@dataclass(frozen=True)
class _Slot:
    """One (pipeline, micro-batch) the failed worker ran: its ops and their times on the plan's timeline."""

    ops: tuple[Op, ...]  # F, then B and W (or BW), in the failed worker's order
    times: tuple[float, ...]  # each op's start in the plan in use


def repair(plan: Plan, failed: Worker | tuple[int, int] | str, *, validate: bool = True,
           memory_limit: MemoryLimit = FAULT_FREE) -> Plan:
    """`plan` with `failed` dead too, by a local re-route (see the module docstring); checked unless
    `validate=False`. `memory_limit`: by default the plan's own limit, or for a fault-free plan (which
    carries none) its own per-stage peaks, so a peer never holds more than its stage held before the
    failure (the memory the job was sized for); a plan with failures compiled with no limit keeps none.
    Any other value is `compile`'s (`memory_limit=None`: no limit). Raises `TopologyError` for a
    worker outside the job or already failed, `RecoveryError` when its stage has no live worker left or
    no peer has the memory for a slot, `ScheduleError` for plans with virtual stages, re-cut
    micro-batches or streams `lower` did not make."""
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
    times = op_times(plan)
    if times is None:
        raise ScheduleError("repair edits plans as `lower` makes them (compute, transfers, then all-reduce and "
                            "step): compile the plan for the new failure set instead")
    costs = _repair_costs(plan, after, memory_limit)  # its memory limit binds the re-route
    taken, moved, late = _place(worker, _slots(plan.streams[worker], times), plan.streams, peers, costs, times,
                                topo.pp)
    # Its timeline, kept with it so a further repair needs no timing: where forwards waited, timing the cone
    # of the edit is the deadlock check (before lowering anything).
    timed = retimed(times, after, costs, taken) if late else times.moved(after, taken, moved)
    if timed is None:
        raise RecoveryError(f"the local re-route around {worker} needs forwards to wait for memory past their "
                            "consumers, and that deadlocks: compile the plan for the new failure set instead")
    repaired = Plan(after, costs, plan.microbatches, _relower(plan, worker, after, taken), plan.family, "repair",
                    None, dict(plan.meta), partition=plan.partition)
    remember(repaired, timed)
    if validate:
        try:
            check(repaired)
        except ValidationError as exc:  # not expected (see the module docstring): a bug, so never run it
            raise RecoveryError(f"the local re-route around {worker} does not validate ({exc}): compile the plan "
                                "for the new failure set instead") from None
    return repaired


def lookup_or_repair(plans: Any, failed: Iterable[Worker | tuple[int, int]] | Topology, *,
                     validate: bool = True, memory_limit: MemoryLimit = FAULT_FREE) -> Plan:
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
                plan = repair(plan, w, validate=validate, memory_limit=memory_limit)
            return plan
        raise miss from None


def _repair_costs(plan: Plan, after: Topology, memory_limit: MemoryLimit) -> CostModel:
    """The plan's costs with the limit a repair keeps to (see `repair`)."""
    if not is_fault_free(memory_limit):
        return resolve_limit(memory_limit, after, plan.microbatches, plan.costs)
    if plan.costs.memory_limit is not None or plan.topology.failed:
        return plan.costs
    return plan.costs.with_memory_limit(stage_peak_memory(peak_memory(plan), plan.topology.pp))


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


def _slots(stream: Sequence[Instruction], times: OpTimes) -> list[_Slot]:
    """The failed worker's slots, in the order of their F."""
    ops: dict[tuple[int, int], list[Op]] = {}
    for op in _compute_ops(stream):
        ops.setdefault((op.pipeline, op.microbatch), []).append(op)
    return [_Slot(tuple(group), tuple(times.of(op) for op in group)) for group in ops.values()]


class _Peer:
    """A peer's compute order while slots are placed on it: each op's time on the plan's timeline (sorted:
    the peer runs its ops in that order), and the memory it holds after each op."""

    def __init__(self, ops: list[Op], times: list[float], deltas: dict[object, float], need: float,
                 top: float) -> None:
        self.ops, self.times, self.deltas, self.need, self.top = ops, times, deltas, need, top
        self._levels()

    def _levels(self) -> None:
        """The memory held after each op, and for each op the first at or after it (len: none) after which
        the memory has no room for `need` more under `top`: a slot fits from op j to op k iff none of j - 1
        .. k - 1 is full (max(levels) + need <= top, one level at a time, as float sums are monotone)."""
        levels = np.cumsum([self.deltas[op.kind] for op in self.ops]) if self.ops else np.zeros(0)
        n = len(levels)
        full = levels + self.need > self.top
        self.full = full.tolist()
        self.full_from = [*np.minimum.accumulate(np.where(full, np.arange(n), n)[::-1])[::-1].tolist(), n]
        self.room_from = [*np.minimum.accumulate(np.where(full, n, np.arange(n))[::-1])[::-1].tolist(), n]

    def _gap(self, i: int, lo: float, hi: float) -> tuple[float, float] | None:
        """The times an op inserted before op i may take within (lo, hi), or None where they do not meet."""
        a = max(lo, self.times[i - 1] if i else -math.inf)
        b = min(hi, self.times[i] if i < len(self.times) else math.inf)
        return (a, b) if a < b else None

    def window(self, slot: _Slot, f_span: tuple[float, float],
               b_span: tuple[float, float]) -> tuple[int, int, float, float] | None:
        """Where the slot's F and backward go (before op j and before op k, j <= k) and their times. Each keeps
        its time on the failed worker where memory allows; where it does not, the F waits (later, but before
        its consumer) and the backward comes as early as its producers allow, never against the timeline.
        None when no place within the spans has `need` to spare from the F to the backward. (The first j
        that has a place; the scan stops early once no later j can have one: past the F's consumer, or no
        gap left for the backward, which only shrinks as the F comes later.)"""
        times, n, full, full_from, room_from = self.times, len(self.times), self.full, self.full_from, self.room_from
        f_at, b_at = slot.times[0], slot.times[1] if len(slot.times) > 1 else slot.times[0]
        (f_lo, f_hi), (b_min, b_hi) = f_span, b_span
        inf = math.inf
        j0 = bisect.bisect(times, f_at)
        j = j0
        while j <= n:  # (the gaps inlined: tens of thousands of places tried at pp = 32, dp = 256)
            if j and full[j - 1]:  # no room from op j - 1 on: skip to the next op with room
                j = room_from[j - 1] + 1
                continue
            a = max(f_lo, times[j - 1] if j else -inf)
            b = min(f_hi, times[j] if j < n else inf)
            if not a < b:
                if j > j0 and times[j - 1] >= f_hi:
                    return None  # past the F's consumer
                j += 1
                continue
            f_time = f_at if a < f_at < b else _inside((a, b))
            b_lo = max(b_min, f_time)
            # (no gap before the first op after b_lo: start the scan there)
            first = max(j, bisect.bisect_right(times, b_lo))
            room = full_from[max(j - 1, 0)] if j or self.need <= self.top else -1  # the last k that fits
            if room < first:  # no room up to the backward's first gap: none until op `room` either
                j = max(j + 1, room + 1)
                continue
            k_min = next((k for k in range(first, n + 1) if self._gap(k, b_lo, b_hi) is not None), None)
            if k_min is None:
                return None
            for k in dict.fromkeys((max(k_min, bisect.bisect(times, b_at)), k_min)):
                gap_b = self._gap(k, b_lo, b_hi)
                if gap_b is not None and k <= room:
                    return j, k, f_time, b_at if gap_b[0] < b_at < gap_b[1] else _inside(gap_b)
            j += 1
        return None

    def take(self, slot: _Slot, j: int, k: int, f_time: float, b_time: float) -> dict[Op, float]:
        """Insert the slot (its W, if any, right after its B) and return the moved ops' times."""
        f_op, *backward = slot.ops
        after = self.times[k] if k < len(self.times) else b_time + 1.0
        back_times = [b_time] + [_inside((b_time, after))] * (len(backward) - 1)
        self.ops = [*self.ops[:j], f_op, *self.ops[j:k], *backward, *self.ops[k:]]
        self.times = [*self.times[:j], f_time, *self.times[j:k], *back_times, *self.times[k:]]
        self._levels()
        return dict(zip(slot.ops, (f_time, *back_times), strict=True))


def _inside(gap: tuple[float, float]) -> float:
    a, b = gap
    if math.isinf(b):
        return a + 1.0
    return (a + b) / 2


def _spans(slot: _Slot, times: OpTimes, pp: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """The times the slot's F and backward may take: after what they read from other stages, before what
    reads them there (the timeline of the plan in use; the failed worker's times lie within)."""
    f_op, b_op = slot.ops[0], slot.ops[1] if len(slot.ops) > 1 else None
    p, m, s = f_op.pipeline, f_op.microbatch, f_op.stage
    f_lo = times.of(Op(OpKind.F, p, m, s - 1)) if s > 0 else -math.inf
    f_hi = times.of(Op(OpKind.F, p, m, s + 1)) if s < pp - 1 else math.inf
    if b_op is None:
        return (f_lo, f_hi), (-math.inf, math.inf)
    b_lo = times.of(Op(b_op.kind, p, m, s + 1)) if s < pp - 1 else -math.inf
    b_hi = times.of(Op(b_op.kind, p, m, s - 1)) if s > 0 else math.inf
    return (f_lo, f_hi), (b_lo, b_hi)


def _place(worker: Worker, slots: list[_Slot], streams: Mapping[Worker, Sequence[Instruction]],
           candidates: Sequence[Worker], costs: CostModel, times: OpTimes,
           pp: int) -> tuple[dict[Worker, list[Op]], dict[Op, float], bool]:
    """The new compute orders of the peers (of `candidates`) that take slots (the others keep theirs), the
    moved ops' times on the timeline, and whether an F had to wait past its consumer's time for memory (then
    the times are not a timeline of the result: `repair` times it)."""
    deltas = stage_deltas(costs, worker.stage)
    limit = costs.limit_at(worker.stage)
    top = limit * (1 + 1e-9) + 1e-9 if math.isfinite(limit) else math.inf
    need = deltas[OpKind.F]  # the most one slot adds (F holds it; B and W only free)
    speed = costs.speed
    wid = {g: g.pipeline * pp + g.stage for g in candidates}
    load = {g: len(times.seqs[wid[g]]) / speed.get(g, 1.0) for g in candidates}  # (its compute ops)
    rank = {g: i for i, g in enumerate(sorted(candidates))}  # ties by worker, compared as ints
    peers: dict[Worker, _Peer] = {}  # made for the peers tried only (a few of hundreds)

    def peer(g: Worker) -> _Peer:
        if g not in peers:
            peers[g] = _Peer(_compute_ops(streams[g]), times.start[times.seqs[wid[g]]].tolist(), deltas, need, top)
        return peers[g]

    taken: set[Worker] = set()
    moved: dict[Op, float] = {}
    late = False
    for slot in slots:
        spans = _spans(slot, times, pp)
        ranked = heapq.nsmallest(TRIALS, candidates, key=lambda g: (load[g], rank[g]))
        windows = {g: w for g in ranked if (w := peer(g).window(slot, *spans)) is not None}
        if not windows:  # every peer full while the slot's neighbours run it: the F waits for memory
            (f_lo, _), (b_lo, _) = spans
            spans = (f_lo, math.inf), (b_lo, math.inf)
            windows = {g: w for g in ranked if (w := peer(g).window(slot, *spans)) is not None}
            late = True
        if not windows:
            raise RecoveryError(
                f"no live peer of {worker} at stage {worker.stage} has the memory to take micro-batch "
                f"{slot.ops[0].microbatch} of pipeline {slot.ops[0].pipeline} in a local re-route: compile the plan "
                "for the new failure set instead")
        # The least loaded of the peers where the F waits least.
        g = min(windows, key=lambda c: (windows[c][2] - slot.times[0], load[c], c))
        moved.update(peers[g].take(slot, *windows[g]))
        load[g] += len(slot.ops) / speed.get(g, 1.0)
        taken.add(g)
    return {g: peers[g].ops for g in sorted(taken)}, moved, late


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
    offset = {**{kind: step for kind, (step, _) in _SENDS.items()}, **_RECVS}  # the peer's slot, from ours
    computes = COMPUTE_KINDS
    for w in (*redo, worker):
        for ins in old[w]:  # (the slot inlined: a few hundred thousand instructions at pp = 32, dp = 256)
            op, peer = ins.op, ins.peer
            if op is None:
                continue
            if peer is not None:
                step = offset.get(ins.kind)
                if step is not None:
                    runner[(op.pipeline * mbs + op.microbatch) * pp + op.stage + step] = peer
            elif w != worker and ins.kind in computes:
                runner[(op.pipeline * mbs + op.microbatch) * pp + op.stage] = w
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
    kept: dict[Worker, dict[Worker, list[int]]] = {}  # sender kept as it was -> receiver -> its channels
    for w, ops in redo.items():  # channels from a sender kept as it was: its stream's order
        senders = {runner[t] for t in (_source(op, slot(op), pp) for op in ops) if t is not None}
        for x in senders - redo.keys():
            if x not in kept:
                kept[x] = _channels(old[x], mbs, pp)
            inbound[w][numbers[x]] = kept[x].get(w, [])
    streams = {}
    for w, stream in old.items():
        if w == worker:
            continue
        if w in redo:
            me = numbers[w]
            stream = _stream(me, tuple(redo[w]), pp, mbs, runner_no, workers, sends[w], inbound[w])
        streams[w] = stream
    return streams


def _channels(stream: Sequence[Instruction], mbs: int, pp: int) -> dict[Worker, list[int]]:
    """The tensors (slot * 2 + channel) a stream sends, per receiver, in its order."""
    out: dict[Worker, list[int]] = {}
    for ins in stream:
        sent = _SENDS.get(ins.kind)
        op = ins.op
        if sent is not None and op is not None and ins.peer is not None:
            out.setdefault(ins.peer, []).append(((op.pipeline * mbs + op.microbatch) * pp + op.stage) * 2 + sent[1])
    return out


def _source(op: Op, slot: int, pp: int) -> int | None:
    """The slot whose tensor `op` reads from another stage: an F the previous stage's, a B (or BW) the next's."""
    if op.kind is OpKind.F:
        return slot - 1 if op.stage > 0 else None
    if op.kind is OpKind.W:
        return None
    return slot + 1 if op.stage < pp - 1 else None
