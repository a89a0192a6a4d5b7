"""The simulator's fast path for lowered plans: `time_lowered(plan, iterations, synchronous)`.

A plan that `check` passed and whose every stream ends in its only ALLREDUCE and STEP (what `lower`
makes: compute, loads and transfers, then the tail) is timed exactly by the solvers' engine,
`solvers.timing.time_sequences` (numpy, `timecore.run_levels`): its compute order is the graph, and
a receive only says where the producer's data comes from, which `check` proved is where the op
dependencies say. The timing core's tests show both engines give the same iteration ends, period and
makespan (`tests/compiler/test_timecore.py`); this module only reads the compute order off the
streams, as op ids, so a plan of 3.6 million instructions (pp = 32, dp = 256) is timed in a few
seconds instead of the worklist's tens. Anything else (hand-made tails, a registered kind, a
gradient check, a re-cut plan) returns None and takes the general path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from schedcomp.costs import CostModel
from schedcomp.ir import OpKind, Plan
from schedcomp.opcolumns import OP_CODES
from schedcomp.semantics import InstrKind
from schedcomp.solvers.problem import FUSED_KINDS, SPLIT_KINDS, Problem
from schedcomp.solvers.timing import Timing, flat_sequences, time_sequences, worker_peaks
from schedcomp.streamcolumns import StreamColumns, columns_of
from schedcomp.timeline import period_from_ends
from schedcomp.topology import Topology, Worker

_TAIL = (InstrKind.ALLREDUCE, InstrKind.STEP)
_PLAIN = frozenset({InstrKind.LOAD, InstrKind.SEND_ACT, InstrKind.SEND_GRAD, InstrKind.RECV_ACT,
                    InstrKind.RECV_GRAD, InstrKind.F, InstrKind.B, InstrKind.W, InstrKind.BW})


@dataclass(frozen=True)
class FastTiming:
    """What `simulate` reports, computed without its per-instruction graph."""

    iteration_ends: tuple[float, ...]
    makespan: float
    period: float
    bubble_ratio: float
    busy: dict[Worker, float]
    memory: dict[Worker, float]


@dataclass(frozen=True)
class SolverTiming:
    """A solver's timing of a plan's compute order, with what its problem was timed for (see `remember`; not
    the problem itself, whose cached tables would stay alive with the plan)."""

    topology: Topology
    microbatches: int
    costs: CostModel
    iterations: int
    synchronous: bool
    timing: FastTiming


_TIMED = "_schedcomp_timed"  # the plan's `SolverTiming`, there once `remember` kept it


def solver_timing(problem: Problem, seqs: Mapping[int, Sequence[int]], timing: Timing, iterations: int,
                  synchronous: bool) -> SolverTiming | None:
    """What `simulate` reports of the plan lowered from `seqs`, which the solver timed as `timing` over
    `iterations` (optimizer as `synchronous`); None where the fast path would not time that plan."""
    if problem.cut or not timing.ok:
        return None
    return SolverTiming(problem.topology, problem.microbatches, problem.costs, iterations, synchronous,
                        _fast_timing(problem, seqs, timing))


def remember(plan: Plan, timed: SolverTiming | None) -> None:
    """Keep on `plan` the solver's timing of its compute order: `time_lowered` then reads it instead of timing
    the plan again (at pp = 32, dp = 256 that is 1.5 million ops read off the streams and re-timed).
    Only for the very plan lowered from the timed sequences (plans are immutable by contract; a copy made with
    `dataclasses.replace` does not carry it) and only where `compute_sequences` would build the same problem."""
    if timed is None or plan.cut or timed.topology != plan.topology or timed.costs is not plan.costs \
            or timed.microbatches != plan.microbatches:
        return
    object.__setattr__(plan, _TIMED, timed)


def time_lowered(plan: Plan, iterations: int, synchronous: bool) -> FastTiming | None:
    """Time a checked, lowered `plan` (see the module docstring), or None when it is not one."""
    timed = plan.__dict__.get(_TIMED)
    if timed is not None and timed.iterations == iterations and timed.synchronous == synchronous:
        return timed.timing  # type: ignore[no-any-return]
    seqs = compute_sequences(plan)
    if seqs is None:
        return None
    problem, by_wid = seqs
    timing = time_sequences(problem, by_wid, iterations, synchronous)
    if not timing.ok:
        return None  # (a checked plan cannot deadlock; the general path says where if it ever did)
    return _fast_timing(problem, by_wid, timing)


def _fast_timing(problem: Problem, by_wid: Mapping[int, Sequence[int]], timing: Timing) -> FastTiming:
    """What `simulate` reports of sequences `timing` timed: ends, period, bubbles, busy time and peak memory."""
    ends = timing.iteration_ends
    pp, snk = problem.pp, problem.stages * len(problem.kinds)
    wids = sorted(by_wid)  # rank order: the workers' sorted order, as `simulate` gives
    ops, lens = flat_sequences(by_wid, wids)
    rows = np.array([problem.op_times[wid] for wid in wids]).reshape(len(wids), snk)
    durations = rows[np.repeat(np.arange(len(wids)), lens), ops % snk]
    stops = np.cumsum(lens).tolist()
    # Added in stream order by `sum`, as the general path adds them (the same float); a worker's floats made
    # when it is summed (all at once were 1.5 million objects at pp = 32, dp = 256).
    busy = {Worker(*divmod(wid, pp)): sum(durations[stop - n:stop].tolist())
            for wid, n, stop in zip(wids, lens.tolist(), stops, strict=True)}
    peaks = worker_peaks(problem, by_wid)
    memory = {w: max(0.0, peaks.get(w.pipeline * pp + w.stage, 0.0)) for w in busy}
    period = period_from_ends(ends, ends[0])
    capacity = period * len(busy)
    bubble = 1.0 - sum(busy.values()) / capacity if capacity > 0 else 0.0
    return FastTiming(tuple(ends), ends[0], period, bubble, busy, memory)


def compute_sequences(plan: Plan) -> tuple[Problem, dict[int, list[int]]] | None:
    """The plan's compute order as op ids per worker id (`solvers.problem`), or None when a stream has
    anything but compute, loads and transfers before an ALLREDUCE, STEP tail, or mixes BW with B/W."""
    if plan.cut or plan.partitions is not None:  # re-cut pieces (op times by size), re-formed pipelines (their
        return None  # segments' all-reduce): the general path reads them
    topo, mbs = plan.topology, plan.microbatches
    stages, pp = topo.stages, topo.pp
    columns = columns_of(plan.streams)
    if columns is not None:
        return _column_sequences(plan, columns)
    fused = split = False
    packed: dict[int, list[int]] = {}  # op ids with 4 kinds per slot, renumbered once the kinds are known
    position, plain, bw, w_kind = KIND_POSITION.get, _PLAIN, InstrKind.BW, InstrKind.W
    for w, stream in plan.streams.items():
        if len(stream) < 2 or stream[-2].kind is not _TAIL[0] or stream[-1].kind is not _TAIL[1]:
            return None
        ops: list[int] = []
        for ins in stream[:-2]:
            kind = ins.kind
            if kind not in plain:
                return None
            pos = position(kind)
            if pos is not None:
                op = ins.op
                fused |= kind is bw
                split |= kind is w_kind
                ops.append(((op.pipeline * mbs + op.microbatch) * stages + op.stage) * 4 + pos)
        packed[w.pipeline * pp + w.stage] = ops
    if fused and split:
        return None
    nk = len(FUSED_KINDS if fused else SPLIT_KINDS)
    by_wid = {wid: ((a >> 2) * nk + (a & 3)).tolist() for wid, ops in packed.items()
              for a in (np.asarray(ops, dtype=np.int64),)}
    return Problem(topo, mbs, plan.costs, not fused), by_wid


def _column_sequences(plan: Plan, columns: StreamColumns) -> tuple[Problem, dict[int, list[int]]] | None:
    """`compute_sequences` of a lowered plan, read off its columns (`schedcomp.streamcolumns`): its rows are
    compute, loads and transfers by construction, so only its tail and its kinds of backward are tested."""
    if tuple(ins.kind for ins in columns.tail) != _TAIL or any(ins.op is not None for ins in columns.tail):
        return None
    topo, mbs = plan.topology, plan.microbatches
    compute = columns.kinds < len(OP_CODES)
    kinds = columns.kinds[compute].astype(np.int64)
    fused, split = bool((kinds == OP_CODES.index(OpKind.BW)).any()), bool((kinds == OP_CODES.index(OpKind.W)).any())
    if fused and split:
        return None
    problem_kinds = FUSED_KINDS if fused else SPLIT_KINDS
    position = np.array([problem_kinds.index(k) if k in problem_kinds else -1 for k in OP_CODES], np.int64)
    ops = columns.ops
    op = columns.op_of[compute]
    ids = ((ops.pipeline[op] * mbs + ops.microbatch[op]) * topo.stages + ops.stage[op]) * len(problem_kinds) \
        + position[kinds]
    n = len(columns.workers)
    worker_of_row = np.repeat(np.arange(n), np.diff(columns.ends, prepend=0))
    ends = np.cumsum(np.bincount(worker_of_row[compute], minlength=n)).tolist()  # (rows are in worker order)
    by_wid = {w.pipeline * topo.pp + w.stage: ids[a:b].tolist()
              for w, a, b in zip(columns.workers, [0, *ends[:-1]], ends, strict=True)}
    return Problem(topo, mbs, plan.costs, not fused), by_wid


# Each compute instruction kind's position in its problem's kinds: F, B, W (split) or F, BW (fused).
KIND_POSITION = {InstrKind(k.value): i for kinds in (SPLIT_KINDS, FUSED_KINDS) for i, k in enumerate(kinds)}
