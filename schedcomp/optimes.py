"""One global timeline of a lowered plan's compute ops: `op_times(plan)`, for `repair`.

Each op's start time in the plan's first iteration (the simulator's fast path: `simfast`'s op ids and
`solvers.timing.time_sequences`). Every stream runs its ops in the order of these times and every op
starts after the ops it reads from, so any edit that keeps every stream sorted by them, and gives a moved
op a time between its producers' and its consumers', leaves a plan with no wait cycle (`repair`). A
pp = 32, dp = 256 plan's timeline takes about 2.5 s (reading its compute orders off the streams, then
timing them: 0.5-0.7 s of it), so a plan's timeline is kept while the plan lives (the runtime can
compute it while the plan is in use, before any failure) and `repair` hands its result the edited one.
Where a repair must time its result, only the ops its edit can move are timed again, from the kept times
(`retimed`, `schedcomp.conetime`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field, replace

import numpy as np

from schedcomp.conetime import Deps, cone_times, successors
from schedcomp.costs import CostModel
from schedcomp.ir import Op, Plan
from schedcomp.semantics import InstrKind
from schedcomp.simfast import KIND_POSITION, compute_sequences
from schedcomp.solvers.problem import Problem
from schedcomp.solvers.timing import op_dependencies, time_sequences
from schedcomp.topology import Topology, Worker

__all__ = ["OpTimes", "op_times", "remember", "retimed", "timeline"]


@dataclass(frozen=True)
class OpTimes:
    """Start time per op id (NaN for ops the plan does not run); `of(op)` reads one."""

    start: np.ndarray
    microbatches: int
    stages: int
    kinds: int  # 3 (F, B, W) or 2 (F, BW)
    problem: Problem = field(repr=False, compare=False)
    seqs: dict[int, np.ndarray] = field(repr=False, compare=False)  # worker id -> its compute order (op ids)
    exact: bool = True  # the plan's own timing, which `retimed` re-times a cone of (not `moved`'s placements)
    table: np.ndarray | None = field(default=None, repr=False, compare=False)  # `_durations`, shared by edits

    def op_id(self, op: Op) -> int:
        slot = (op.pipeline * self.microbatches + op.microbatch) * self.stages + op.stage
        return slot * self.kinds + KIND_POSITION[InstrKind(op.kind.value)]

    def of(self, op: Op) -> float:
        return float(self.start[self.op_id(op)])

    def moved(self, topology: Topology, orders: dict[Worker, list[Op]], times: dict[Op, float]) -> OpTimes:
        """These times with some ops' replaced: those of the plan these are of with workers failed (`topology`)
        and some compute orders changed to `orders` (a repaired plan)."""
        start = self.start.copy()
        for op, t in times.items():
            start[self.op_id(op)] = t
        return OpTimes(start, self.microbatches, self.stages, self.kinds, self.problem,
                       self._seqs_of(topology, orders), exact=False, table=self.table)

    def edited(self, problem: Problem, seqs: dict[int, np.ndarray]) -> OpTimes | None:
        """The timeline of compute orders `seqs` (worker id -> op ids) under `problem` (this timeline's with
        workers failed), which are this timeline's orders with some changed or gone; None when they cannot run
        (a wait cycle). Where these times are the plan's own timing, only the ops the change can move are
        timed again (`conetime`): the same floats as timing them all, in a fraction of the time. The arrays
        of `seqs` are made read-only (the result keeps them, and so will its edits)."""
        _freeze(seqs)
        if not self.exact or not _same_job(self.problem, problem, seqs):
            return timeline(problem, seqs)  # (another job's costs or lanes: nothing of these times holds)
        table = _durations(problem) if self.table is None else self.table  # (failures keep the others' op times)
        start = cone_times(self.start, self.seqs, seqs, Deps(*_edges(problem), table, self.kinds, _sizes(problem)))
        return None if start is None else OpTimes(start, self.microbatches, self.stages, self.kinds, problem, seqs,
                                                  table=table)

    def _seqs_of(self, topology: Topology, orders: dict[Worker, list[Op]]) -> dict[int, np.ndarray]:
        pp, failed = topology.pp, topology.failed
        seqs = {wid: ops for wid, ops in self.seqs.items() if Worker(*divmod(wid, pp)) not in failed}
        for w, ops in orders.items():
            seqs[w.pipeline * pp + w.stage] = np.array([self.op_id(op) for op in ops], dtype=np.int64)
        return _freeze(seqs)


def _freeze(seqs: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """Make the lanes read-only: a timeline shares them with every edit of it, and an edit is found by the
    lane not being the very array it was (`conetime`), which an in-place change would hide."""
    for ops in seqs.values():
        if isinstance(ops, np.ndarray):
            ops.flags.writeable = False
    return seqs


def _same_job(was: Problem, now: Problem, seqs: dict[int, np.ndarray]) -> bool:
    """Whether `now` is `was` with more workers failed (the same costs but for the memory limit, the same
    micro-batches and cut) and `seqs` names only its live workers: what re-timing a cone assumes."""
    a, b = was.topology, now.topology
    if (a.pp, a.dp, a.chunks, a.placement) != (b.pp, b.dp, b.chunks, b.placement) or not a.failed <= b.failed:
        return False
    if (was.microbatches, was.cut, was.split) != (now.microbatches, now.cut, now.split):
        return False
    if replace(was.costs, memory_limit=None) != replace(now.costs, memory_limit=None):
        return False
    live = {now.worker_id(w) for w in b.live_workers}
    return set(seqs) <= live


_KEPT: dict[int, OpTimes] = {}  # id(plan) -> its timeline, while the plan lives


def remember(plan: Plan, times: OpTimes) -> None:
    """Keep `times` as `plan`'s timeline (dropped when the plan is)."""
    if id(plan) not in _KEPT:
        weakref.finalize(plan, _KEPT.pop, id(plan), None)
    _KEPT[id(plan)] = times


def op_times(plan: Plan) -> OpTimes | None:
    """`plan`'s timeline (see the module docstring), or None for a plan that is not lowered as `lower`
    makes them (hand-made tails, re-cut pieces) or cannot run."""
    kept = _KEPT.get(id(plan))
    if kept is not None:
        return kept
    seqs = compute_sequences(plan)
    if seqs is None:
        return None
    problem, by_wid = seqs
    times = timeline(problem, {wid: np.asarray(ops, dtype=np.int64) for wid, ops in by_wid.items()})
    if times is not None:
        remember(plan, times)
        _edges(problem)  # what re-timing after a repair reads, built now rather than then
    return times


def retimed(times: OpTimes, topology: Topology, costs: CostModel, orders: dict[Worker, list[Op]]) -> OpTimes | None:
    """The timeline of the plan `times` is of with workers failed (`topology`, `costs`: its costs but for the
    memory limit) and some compute orders changed to `orders`; None when it cannot run (a wait cycle). Only
    the changed orders are read off (keep the result with the plan once it is built: `remember`)."""
    return times.edited(times.problem.with_failed(topology, costs), times._seqs_of(topology, orders))


def timeline(problem: Problem, seqs: dict[int, np.ndarray]) -> OpTimes | None:
    """The timeline of compute orders `seqs` (worker id -> op ids) under `problem`, all of them timed; None
    when they cannot run. The arrays of `seqs` are made read-only (the timeline keeps them)."""
    _freeze(seqs)
    timing = time_sequences(problem, seqs, iterations=1)
    if not timing.ok:
        return None
    start = np.full(problem.n_slots * len(problem.kinds), np.nan)
    start[timing.ops] = timing.first
    return OpTimes(start, problem.microbatches, problem.stages, len(problem.kinds), problem, seqs,
                   table=_durations(problem))


_EDGES: dict[tuple[int, int, int, float], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}


def _edges(problem: Problem) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The op dependencies both ways, kept for the last shape timed (like `op_dependencies`, whose arrays
    they are): `op_times` builds them, before any failure, so a repair does not."""
    key = (problem.stages, len(problem.kinds), problem.n_slots, problem.costs.p2p)
    if key not in _EDGES:
        pred, lat = op_dependencies(problem)
        _EDGES.clear()
        _EDGES[key] = (pred, lat, successors(pred))
    return _EDGES[key]


def _durations(problem: Problem) -> np.ndarray:
    """Every live worker's op times as a table (worker id -> stage * kinds + kind), for `cone_times`."""
    table = np.zeros((problem.pp * problem.topology.dp, problem.stages * len(problem.kinds)))
    rows = problem.op_times
    if rows:
        table[list(rows)] = np.array(list(rows.values()))
    return table


def _sizes(problem: Problem) -> np.ndarray | None:
    return None if problem.slot_sizes is None else np.asarray(problem.slot_sizes)
