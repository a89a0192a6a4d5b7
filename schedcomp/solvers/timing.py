"""Op-level timing of per-worker compute sequences over several iterations (the solvers' own clock).

Same semantics as the plan simulator (docs/design.md), on the compute graph alone: each worker runs its
ops in order; an op starts when its worker is free and its inputs have arrived (a transfer between
workers takes `costs.p2p`; F -> B -> W of a slot are local, as is a hand-off between two chunks of one
worker); after its last op a worker joins its stage's all-reduce, which starts when every live worker of
the stage has arrived, then steps; with a staggered optimizer the worker starts its next iteration right
after its own stage's step, with a synchronous one after every stage's step (an all-reduce over one
worker is free; a step is divided by the worker's speed factor; the period is the mean time between
iteration ends over the second half of the run, as in `schedcomp.timeline`). Sequences are lists of op
ids (see `problem.py`), so the solvers can score candidates without building `Order`s. The graph is
timed level by level (nodes of one topological level are independent) with numpy, so one iteration of a
100k-op schedule takes milliseconds. """

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from schedcomp.memory import stage_deltas
from schedcomp.solvers.problem import Problem
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
    peaks = {}
    for wid, seq in seqs.items():
        if len(seq):
            ops = np.asarray(seq, dtype=np.int64)
            peaks[wid] = float(np.cumsum(table[(ops // nk) % stages, ops % nk]).max())
    return peaks


def peak_memory(problem: Problem, seqs: Mapping[int, Sequence[int]]) -> float:
    """Largest activation memory any worker holds."""
    return max(worker_peaks(problem, seqs).values(), default=0.0)


def within_limits(problem: Problem, seqs: Mapping[int, Sequence[int]]) -> bool:
    """Whether every worker stays within its stage's memory limit (with the validator's tolerance)."""
    return all(peak <= problem.limit_of(wid) * (1 + 1e-9) for wid, peak in worker_peaks(problem, seqs).items())


def time_sequences(
    problem: Problem,
    seqs: Mapping[int, Sequence[int]],
    iterations: int = 4,
    synchronous: bool = False,
) -> Timing:
    """Time per-worker op sequences (worker id -> op ids) over `iterations`; `DEADLOCK` if they cannot run."""
    pp, nk, costs = problem.pp, len(problem.kinds), problem.costs
    live = [problem.worker_id(w) for w in problem.topology.live_workers]
    n_ops = problem.n_slots * nk
    lists = [np.asarray(seqs.get(wid, ()), dtype=np.int64) for wid in live]
    ops = np.concatenate(lists) if lists else np.zeros(0, dtype=np.int64)
    n = len(ops)
    if n != n_ops or (n and len(np.unique(ops)) != n_ops) or (n and (ops.min() < 0 or ops.max() >= n_ops)):
        return DEADLOCK  # an op is missing or repeated: not a complete schedule
    lens = np.array([len(x) for x in lists], dtype=np.int64)
    owner = np.repeat(np.arange(len(live)), lens)  # index into `live`
    node_of = np.empty(n_ops, dtype=np.int64)
    node_of[ops] = np.arange(n)

    # Predecessor indices into the `end` array; index n + i holds worker i's release time (its first op's
    # "previous end"), index n + len(live) is -inf (no predecessor).
    base_at = n + np.arange(len(live))
    none = n + len(live)
    starts_at = np.concatenate(([0], np.cumsum(lens)[:-1])) if len(lens) else np.zeros(0, dtype=np.int64)
    prev = np.arange(n) - 1
    firsts = starts_at[lens > 0]
    prev[firsts] = base_at[lens > 0]
    kind = ops % nk
    slot = ops // nk
    stage = slot % problem.stages
    p1 = np.full(n, none)
    p2 = np.full(n, none)
    l1 = np.zeros(n)
    l2 = np.zeros(n)
    f = (kind == 0) & (stage > 0)
    p1[f] = node_of[(slot[f] - 1) * nk]
    # A tensor between two chunks of one worker is handed off locally: no transfer latency.
    l1[f] = np.where(owner[p1[f]] == owner[f], 0.0, costs.p2p)
    b = kind == 1
    p1[b] = node_of[slot[b] * nk]
    b2 = b & (stage < problem.stages - 1)
    p2[b2] = node_of[(slot[b2] + 1) * nk + 1]
    l2[b2] = np.where(owner[p2[b2]] == owner[b2], 0.0, costs.p2p)
    w = kind == 2
    p1[w] = node_of[slot[w] * nk + 1]
    levels = _levels(n, prev, p1, p2)
    if levels is None:
        return DEADLOCK

    durations = np.array([problem.durations(wid) for wid in live]).reshape(len(live), problem.stages, nk)
    dur = durations[owner, stage, kind]
    wstage = np.array([wid % pp for wid in live], dtype=np.int64)
    last_of = starts_at + lens - 1
    has_ops = lens > 0
    allreduce = np.array(problem.allreduce_times)
    step = np.array([problem.step_time(wid) for wid in live])

    end = np.zeros(n + len(live) + 1)
    end[none] = -INF
    start = np.zeros(n)
    first = start
    ends: list[float] = []
    for it in range(iterations):
        for idx in levels:
            t = np.maximum(end[prev[idx]], end[p1[idx]] + l1[idx])
            t = np.maximum(t, end[p2[idx]] + l2[idx])
            start[idx] = t
            end[idx] = t + dur[idx]
        if it == 0:
            first = start.copy()
        finish = end[base_at].copy()
        finish[has_ops] = end[last_of[has_ops]]
        arrive = np.zeros(pp)
        np.maximum.at(arrive, wstage, finish)
        step_end = arrive[wstage] + allreduce[wstage] + step
        ends.append(max(float(step_end.max()), ends[-1] if ends else 0.0))
        end[base_at] = ends[-1] if synchronous else step_end
    return Timing(period_from_ends(ends), ends[0], tuple(ends), ops, first, start.copy())


def _levels(n: int, prev: np.ndarray, p1: np.ndarray, p2: np.ndarray) -> list[np.ndarray] | None:
    """Nodes grouped by topological level (Kahn's algorithm, a frontier at a time); None on a cycle."""
    src = np.concatenate((prev, p1, p2))
    dst = np.concatenate((np.arange(n),) * 3)
    real = src < n
    src, dst = src[real], dst[real]
    indeg = np.bincount(dst, minlength=n)
    order = np.argsort(src, kind="stable")
    succ = dst[order]
    bounds = np.searchsorted(src[order], np.arange(n + 1))
    frontier = np.flatnonzero(indeg == 0)
    levels: list[np.ndarray] = []
    done = 0
    while len(frontier):
        levels.append(frontier)
        done += len(frontier)
        lo, hi = bounds[frontier], bounds[frontier + 1]
        counts = hi - lo
        if not counts.sum():
            break
        idx = np.repeat(lo - np.cumsum(np.concatenate(([0], counts[:-1]))), counts) + np.arange(counts.sum())
        targets = succ[idx]
        np.subtract.at(indeg, targets, 1)
        cand = np.unique(targets)
        frontier = cand[indeg[cand] == 0]
    return levels if done == n else None
