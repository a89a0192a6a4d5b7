"""Op-level timing of per-worker compute sequences over several iterations (the solvers' view of the timing core).

Same semantics as the plan simulator (docs/design.md "Timing core"), on the compute graph alone: each worker
runs its ops in order; an op starts when its worker is free and its inputs have arrived (`op_dependencies`:
a transfer between workers takes `costs.p2p`; F -> B -> W of a slot are local, and so is a hand-off between
two chunks that run on one worker, which the core sees from the lanes); after its last op a worker joins
its place's all-reduce, then steps. Sequences are lists of op ids (see `problem.py`), so the solvers can
score candidates without building `Order`s. `time_sequences` hands the graph to
`schedcomp.timecore.run_levels` (numpy, a topological level at a time: one iteration of a 100k-op schedule
takes milliseconds); `improve.FastTimer` to `run_lanes` (faster on the small schedules it polishes).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import chain

import numpy as np

from schedcomp.memory import stage_deltas
from schedcomp.runsums import running_sums
from schedcomp.solvers.problem import Problem
from schedcomp.timecore import run_levels
from schedcomp.timeline import period_from_ends

INF = math.inf


@dataclass(frozen=True)
class Timing:
    """Result of timing sequences: `period` (steady state), `makespan` (first iteration end), the end of
    every iteration, and start times of the first and last iteration (`ops[i]` started at `first[i]`)."""

    period: float
    makespan: float
    iteration_ends: tuple[float, ...]
    ops: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64), repr=False)
    first: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    last: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)

    @property
    def ok(self) -> bool:
        return math.isfinite(self.period)

    def first_starts(self) -> dict[int, float]:
        return dict(zip(self.ops.tolist(), self.first.tolist(), strict=True))

    def last_starts(self) -> dict[int, float]:
        return dict(zip(self.ops.tolist(), self.last.tolist(), strict=True))


DEADLOCK = Timing(INF, INF, ())


def worker_peaks(problem: Problem, seqs: Mapping[int, Sequence[int]]) -> dict[int, float]:
    """The most activation memory each worker (id) holds running its sequence (memory depends on the
    order only)."""
    nk, stages = len(problem.kinds), problem.stages
    table = np.array([[d[k] for k in problem.kinds] for d in (stage_deltas(problem.costs, s) for s in range(stages))])
    wids = [wid for wid, seq in seqs.items() if len(seq)]
    ops, lens = flat_sequences(seqs, wids)
    deltas = table[(ops // nk) % stages, ops % nk]
    if problem.slot_sizes is not None:  # re-cut micro-batches: activation scales with the size
        deltas = deltas * np.asarray(problem.slot_sizes)[ops // nk]
    owner = np.repeat(np.arange(len(wids)), lens)
    starts = np.cumsum(lens) - lens
    held = running_sums(deltas, owner, len(wids))
    return dict(zip(wids, np.maximum.reduceat(held, starts).tolist() if wids else [], strict=True))


def flat_sequences(seqs: Mapping[int, Sequence[int]], wids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """The sequences of workers `wids` (none: empty) end to end, and each one's length (one pass in C, not an
    array each)."""
    picked = [seqs.get(wid, ()) for wid in wids]
    lens = np.fromiter(map(len, picked), np.int64, len(wids))
    return np.fromiter(chain.from_iterable(picked), np.int64, int(lens.sum())), lens


def peak_memory(problem: Problem, seqs: Mapping[int, Sequence[int]]) -> float:
    """Largest activation memory any worker holds."""
    return max(worker_peaks(problem, seqs).values(), default=0.0)


def within_limits(problem: Problem, seqs: Mapping[int, Sequence[int]]) -> bool:
    """Whether every worker stays within its stage's memory limit (with the validator's tolerance)."""
    return all(peak <= problem.limit_of(wid) * (1 + 1e-9) for wid, peak in worker_peaks(problem, seqs).items())


def op_dependencies(problem: Problem) -> tuple[np.ndarray, np.ndarray]:
    """Every op's producers (op ids, two columns, -1 for none) and their latencies: an F reads the previous
    (virtual) stage's F (a transfer), a B (or BW) its own F and the next stage's B (a transfer), a W its own
    B. A transfer between two chunks that end up on one worker is a local hand-off: the timing core drops its
    latency, since only the lanes say where each op runs. They do not depend on the failed set, so the last
    shape's are kept (read-only arrays, about 50 MB at pp = 32, dp = 256, M = 64): a repair re-times without
    rebuilding them."""
    return _dependencies(problem.stages, len(problem.kinds), problem.n_slots, problem.costs.p2p)


@lru_cache(maxsize=1)
def _dependencies(stages: int, nk: int, n_slots: int, p2p: float) -> tuple[np.ndarray, np.ndarray]:
    pred, lat = dependencies_of(np.arange(n_slots * nk), stages, nk, p2p)
    pred.flags.writeable = lat.flags.writeable = False
    return pred, lat


def dependencies_of(ops: np.ndarray, stages: int, nk: int, p2p: float) -> tuple[np.ndarray, np.ndarray]:
    """`op_dependencies`' rows of the op ids `ops` (one schedule's ops need no table of every op id: a third of
    the timing's memory at pp = 32, dp = 256)."""
    slot, kind = np.divmod(ops, nk)
    stage = slot % stages
    pred = np.full((len(ops), 2), -1, dtype=np.int64)
    lat = np.zeros((len(ops), 2))
    f = (kind == 0) & (stage > 0)
    pred[f, 0], lat[f, 0] = (slot[f] - 1) * nk, p2p
    b = kind == 1
    pred[b, 0] = slot[b] * nk
    b2 = b & (stage < stages - 1)
    pred[b2, 1], lat[b2, 1] = (slot[b2] + 1) * nk + 1, p2p
    w = kind == 2
    pred[w, 0] = slot[w] * nk + 1
    return pred, lat


def time_sequences(
    problem: Problem,
    seqs: Mapping[int, Sequence[int]],
    iterations: int = 4,
    synchronous: bool = False,
    steps: np.ndarray | None = None,
) -> Timing:
    """Time per-worker op sequences (worker id -> op ids) over `iterations`; `DEADLOCK` if they cannot run.

    Each live worker is a lane of the timing core (`schedcomp.timecore.run_levels`): its ops, then its
    place's all-reduce and its step. `steps` (per op id, as `greedy.list_schedule_steps` gives them): levels
    the core may take where every dependency goes to a later step (the same times: see `run_levels`)."""
    pp, nk = problem.pp, len(problem.kinds)
    live = [problem.worker_id(w) for w in problem.topology.live_workers]
    n_ops = problem.n_slots * nk  # op ids (absent slots' included: a re-cut pipeline may run fewer)
    ops, lens = flat_sequences(seqs, live)
    n, present = len(ops), problem.n_present * nk
    # An op missing or repeated: not a complete schedule (present ids in range, none twice, is every op
    # once; a count, not `np.unique`, which took 2 s of a million-op schedule).
    if n != present or (n and (ops.min() < 0 or ops.max() >= n_ops or np.bincount(ops, minlength=n_ops).max() > 1)):
        return DEADLOCK
    owner = np.repeat(np.arange(len(live)), lens)  # index into `live`
    node_of = np.full(n_ops + 1, -1, dtype=np.int32 if n < 2**31 else np.int64)  # (int32: see `run_levels`)
    node_of[ops] = np.arange(n)
    op_pred, op_lat = dependencies_of(ops, problem.stages, nk, problem.costs.p2p)
    pred = node_of[op_pred]  # (no producer, -1, reads the last entry: -1)
    del node_of, op_pred
    snk = problem.stages * nk  # op % snk = (virtual) stage * nk + kind
    durations = np.array([problem.op_times[wid] for wid in live]).reshape(len(live), snk)
    group = np.array([wid % pp for wid in live], dtype=np.int64)
    tail = np.column_stack((np.array(problem.allreduce_times)[group], [problem.step_time(wid) for wid in live]))
    op_durations = durations[owner, ops % snk]
    del owner
    if problem.slot_sizes is not None:  # re-cut micro-batches: time scales with the size
        op_durations = op_durations * np.asarray(problem.slot_sizes)[ops // nk]
    run = run_levels(lens, pred, op_lat, op_durations, group, tail, iterations, synchronous,
                     None if steps is None else steps[ops])
    if run is None:
        return DEADLOCK
    ends = run.iteration_ends
    return Timing(period_from_ends(ends), ends[0], ends, ops, run.first, run.last)
