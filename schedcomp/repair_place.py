"""Where a repair puts the failed worker's slots (`place`): on which live peer of its stage, and where in that
peer's compute order, on the plan's timeline (`schedcomp.repair` says why that keeps the plan deadlock-free).

Each slot (a micro-batch the failed worker ran) goes to one of the `TRIALS` least loaded peers, at its time
on the failed worker: its F between its producer's and its consumer's times, its backward as early as its
producers allow, its W right after it, all where the peer's memory has room; where no peer has room all
along, the F waits for memory (`place` then says so, and `repair` times the result).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate

import numpy as np

from schedcomp.costs import CostModel
from schedcomp.errors import RecoveryError
from schedcomp.ir import COMPUTE_KINDS, Instruction, Op, OpKind
from schedcomp.memory import stage_deltas
from schedcomp.optimes import OpTimes
from schedcomp.topology import Topology, Worker

__all__ = ["TRIALS", "compute_ops", "pipelines_last", "place", "slots_of"]

TRIALS = 16
"""Least-loaded peers tried for a slot when none has memory to spare all along: bounds a repair's time
whatever the job's width."""


@dataclass(frozen=True)
class _Slot:
    """One (pipeline, micro-batch) the failed worker ran: its ops and their times on the plan's timeline."""

    ops: tuple[Op, ...]  # F, then B and W (or BW), in the failed worker's order
    times: tuple[float, ...]  # each op's start in the plan in use


def compute_ops(stream: Sequence[Instruction]) -> list[Op]:
    """The compute ops of `stream`, in its order."""
    return [ins.op for ins in stream if ins.kind in COMPUTE_KINDS and ins.op is not None]


def slots_of(stream: Sequence[Instruction], times: OpTimes) -> list[_Slot]:
    """The failed worker's slots, in the order of their F."""
    ops: dict[tuple[int, int], list[Op]] = {}
    for op in compute_ops(stream):
        ops.setdefault((op.pipeline, op.microbatch), []).append(op)
    return [_Slot(tuple(group), tuple(times.of(op) for op in group)) for group in ops.values()]


class _Peer:
    """A peer's compute order while slots are placed on it: each op's time on the plan's timeline (sorted:
    the peer runs its ops in that order), and the memory it holds after each op."""

    def __init__(self, ops: list[Op], times: list[float], deltas: dict[object, float], need: float,
                 top: float) -> None:
        self.ops, self.times, self.deltas, self.need, self.top = ops, times, deltas, need, top
        self._mark_full()

    def _mark_full(self) -> None:
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
        self._mark_full()
        return dict(zip(slot.ops, (f_time, *back_times), strict=True))


def _top(limit: float) -> float:
    """The most a peer may hold under `limit` in a repair (a tolerance for float sums; inf: no limit)."""
    return limit * (1 + 1e-9) + 1e-9 if math.isfinite(limit) else math.inf


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


def place(worker: Worker, slots: list[_Slot], streams: Mapping[Worker, Sequence[Instruction]],
           candidates: Sequence[Worker], costs: CostModel, times: OpTimes,
           pp: int) -> tuple[dict[Worker, list[Op]], dict[Op, float], bool]:
    """The new compute orders of the peers (of `candidates`) that take slots (the others keep theirs), the
    moved ops' times on the timeline, and whether an F had to wait past its consumer's time for memory (then
    the times are not a timeline of the result: `repair` times it)."""
    deltas = stage_deltas(costs, worker.stage)
    limit = costs.limit_at(worker.stage)
    top = _top(limit)
    need = deltas[OpKind.F]  # the most one slot adds (F holds it; B and W only free)
    speed = costs.speed
    wid = {g: g.pipeline * pp + g.stage for g in candidates}
    load = {g: len(times.seqs[wid[g]]) / speed.get(g, 1.0) for g in candidates}  # (its compute ops)
    rank = {g: i for i, g in enumerate(sorted(candidates))}  # ties by worker, compared as ints
    peers: dict[Worker, _Peer] = {}  # made for the peers tried only (a few of hundreds)

    def peer(g: Worker) -> _Peer:
        if g not in peers:
            peers[g] = _Peer(compute_ops(streams[g]), times.start[times.seqs[wid[g]]].tolist(), deltas, need, top)
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


def pipelines_last(worker: Worker, slots: list[_Slot], streams: Mapping[Worker, Sequence[Instruction]],
                   candidates: Sequence[Worker], costs: CostModel, times: OpTimes,
                   after: Topology) -> dict[Worker, list[Op]]:
    """The fallback where `place` leaves a wait cycle: the failed worker's slots each on the least loaded peer,
    and on every lane that runs ops of the slots' pipelines beside others' (their live workers, and the peers
    of the stages where they lost workers) those pipelines' ops after the rest, in the order of their times.

    No other pipeline's op then waits for one of these (an op reads only its own pipeline's), and these ones
    run in the order of a valid timeline, so no wait cycle can form; a lane's memory over the rest is what it
    held, over these the level of whole micro-batches in a timeline's order, checked against the limit
    (`RecoveryError` where it does not fit). The slower plan for these pipelines is a stop-gap until the plan
    compiled for the new failure set replaces it."""
    pp = after.pp
    pipelines = sorted({op.pipeline for slot in slots for op in slot.ops})
    speed = costs.speed
    load = {g: len(times.seqs[g.pipeline * pp + g.stage]) / speed.get(g, 1.0) for g in candidates}
    extra: dict[Worker, list[Op]] = {}
    for slot in slots:
        g = min(candidates, key=lambda c: (load[c], c))
        extra.setdefault(g, []).extend(slot.ops)
        load[g] += len(slot.ops) / speed.get(g, 1.0)
    per_pipeline = times.microbatches * times.stages * times.kinds  # (a pipeline's op ids are one range)
    moving = np.zeros(after.dp, dtype=bool)
    moving[pipelines] = True
    lanes = {w for d in pipelines for w in (Worker(d, s) for s in range(pp)) if w not in after.failed}
    for s in {w.stage for w in after.failed if moving[w.pipeline]}:
        lanes.update(after.stage_group(s))
    orders: dict[Worker, list[Op]] = {}
    for w in sorted(lanes):
        ours = moving[times.seqs[w.pipeline * pp + w.stage] // per_pipeline]
        if w not in extra and (ours.all() or not ours.any()):
            continue  # (its order stays)
        ops = compute_ops(streams[w])
        later = sorted([op for op in ops if moving[op.pipeline]] + extra.get(w, []), key=times.of)
        orders[w] = [op for op in ops if not moving[op.pipeline]] + later
        if w in extra:
            deltas, limit = stage_deltas(costs, w.stage), costs.limit_at(w.stage)
            if max(accumulate(deltas[op.kind] for op in orders[w])) > _top(limit):
                raise RecoveryError(
                    f"no live peer of {worker} at stage {worker.stage} has the memory to take its micro-batches "
                    "after its own in a local re-route: compile the plan for the new failure set instead")
    return orders
