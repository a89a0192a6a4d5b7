"""Re-cut: size a failed worker's micro-batches for the peers that take them (`compile(..., recut=True)`).

Whole micro-batches cap re-routing: with pp = 4, dp = 8, M = 8 and worker 3:1 failed, 8 micro-batches
over 7 peers leave one peer with 2 extra (a period of 30 in the unit model) where the work would allow
8/7 each (27.43). Samples are interchangeable within a global batch, so the failed pipeline's share may
be cut into M micro-batches of unequal sizes (`schedcomp.cut.Cut`), each routed to one peer:

1. per place s with failed workers, the live peers' loads (own M micro-batches, all-reduce, step, each
   by its speed factor) are water-filled with the failed pipelines' work (`bounds._water_level`), which
   gives each peer its share of the work in micro-batches;
2. McNaughton's wrap-around rule lays the failed pipelines' shares end to end over the peers in rank
   order, so each pipeline's share splits into at most one part per peer it meets; the M micro-batches
   of a pipeline are then dealt to its parts (each part at least one, the rest to the part whose
   micro-batches are largest), equal within a part, and interleaved so each peer's arrive spread over
   the iteration;
3. a pipeline already re-cut at an earlier place (several of its workers failed) is routed there whole
   micro-batch by whole micro-batch, largest first to the peer that finishes first (LPT).

Under a memory limit the peers' own whole micro-batches still leave a bubble: between a peer's first
forward of an iteration and its first backward, only forwards can run, and the limit caps how much
forward work it may hold. `halve_the_rest` also cuts the pipelines the re-cut leaves whole into half
micro-batches (`HALVES`), which halves that wait and what each forward holds: at pp = 4, dp = 8, M = 8
with 3:1 failed, under ZB-H1's per-stage peaks, 31.67 -> 27.43, the work bound. It is another
candidate, kept only where it is at least 1% faster (`HALVES_MIN_GAIN`: more, smaller ops, priced by the
cost model at their share of a micro-batch's time, as every re-cut piece is, which small kernels do not
reach on a device) and tried only on problems of up to `HALVES_MAX_OPS` ops.

The result is the cut and the routing of every re-routed piece ((pipeline, piece, stage) -> worker id), which the greedy
scheduler ("static" routing: a piece is sized for its peer) and CP-SAT keep. One stage per worker only.
"""

from __future__ import annotations

import heapq
import math

from schedcomp.cut import Cut
from schedcomp.errors import ScheduleError
from schedcomp.solvers.bounds import _water_level
from schedcomp.solvers.problem import Problem

_TOL = 1e-9
PIECES = (2.0, 0.5)
"""The largest piece, in micro-batches, of the cuts `adaptive_order` tries. Smaller pieces hold less
activation, so under a memory limit they fill a peer's bubbles better; larger ones keep fewer ops."""
# Quarter pieces would schedule better under a memory limit (pp = 4, dp = 8, M = 8 with 3:1 failed, under
# ZB-H1's per-stage peaks: 31.67 -> 31.29), but a piece must get at least one row of its micro-batch at run
# time (`runtime.data`), and that case's quarter cut needs 5 rows per micro-batch where the half cut needs 3:
# a plan that a failure switches to must not be refused then, so they are not tried.


def recut(problem: Problem, piece: float = PIECES[0]) -> tuple[Cut, dict[tuple[int, int, int], int]]:
    """The cut and the routing of `problem`'s failed workers' micro-batches (see the module docstring), in
    pieces of at most `piece` micro-batches."""
    topology = problem.topology
    if topology.chunks > 1:
        raise ScheduleError("re-cut micro-batches run one stage per worker, not chunks="
                            f"{topology.chunks}: drop recut or the virtual stages")
    m = problem.microbatches
    costs = problem.costs
    # A piece runs at every stage of its pipeline: no larger than what each stage's limit holds alone.
    piece = min([piece, *(costs.limit_at(s) / costs.activation[s] for s in range(problem.pp) if costs.activation[s])])
    bounds: dict[int, tuple[float, ...]] = {}
    routing: dict[tuple[int, int, int], int] = {}  # (pipeline, piece, stage) -> worker id
    failed_at = [sorted(w.pipeline for w in topology.failed if w.stage == s) for s in range(problem.pp)]
    for s, group in enumerate(problem.survivors):
        if not failed_at[s]:
            continue
        wids = [problem.worker_id(w) for w in group]
        speed = {wid: problem.costs.speed.get(problem.worker_of(wid), 1.0) for wid in wids}
        # (A stage of no compute time shares its micro-batches out as though they took one unit each.)
        work = problem.costs.forward[s] + problem.costs.backward_input[s] + problem.costs.backward_weight[s] or 1.0
        fixed = problem.allreduce_times[s]
        # Loads in time: own micro-batches, all-reduce and step, each divided by the speed factor.
        load = {wid: (m * work + problem.costs.optimizer[s]) / speed[wid] + fixed for wid in wids}
        for d in (d for d in failed_at[s] if d in bounds):  # re-cut at an earlier place: route it whole
            sizes = [bounds[d][k + 1] - bounds[d][k] for k in range(len(bounds[d]) - 1)]
            heap = [(load[wid], wid) for wid in wids]
            heapq.heapify(heap)
            for k in sorted(range(len(sizes)), key=lambda k: (-sizes[k], k)):
                t, wid = heapq.heappop(heap)
                routing[(d, k, s)] = wid
                load[wid] = t + sizes[k] * work / speed[wid]
                heapq.heappush(heap, (load[wid], wid))
        new = [d for d in failed_at[s] if d not in bounds]
        if not new:
            continue
        level = _water_level({problem.worker_of(w): load[w] for w in wids},
                             {problem.worker_of(w): speed[w] for w in wids}, len(new) * m * work)
        share = {wid: max(0.0, (level - load[wid]) * speed[wid] / work) for wid in wids}  # in micro-batches
        for d, parts in zip(new, _wrap_around(share, len(new), m), strict=True):
            bounds[d], owners = _deal(parts, m, piece)
            for k, wid in enumerate(owners):
                routing[(d, k, s)] = wid
    return Cut.of(bounds), routing


HALVES = 0.5
"""The size of the pieces `halve_the_rest` cuts the pipelines a re-cut leaves whole into."""
HALVES_MIN_GAIN = 0.01
"""A cut with the rest halved doubles those pipelines' ops, each with its launch and its p2p latency, and
runs smaller kernels that the cost model prices at their share of a micro-batch's time: it is kept only
where it is at least this much (relatively) faster than the best plan without it."""
HALVES_MAX_OPS = 60_000
"""Halved cuts are tried only up to this many ops (the size past which the list scheduler tries one
variant, `adaptive.portfolio`): beyond it they double compile time for a gain the one variant rarely finds."""


def halve_the_rest(cut: Cut, dp: int, microbatches: int) -> Cut:
    """`cut` with every pipeline it leaves whole cut into half micro-batches (see the module docstring)."""
    halves = tuple(HALVES * i for i in range(round(microbatches / HALVES) + 1))
    return Cut.of({**{d: halves for d in range(dp)}, **cut.pipelines})


def _wrap_around(share: dict[int, float], pipelines: int, m: int) -> list[list[tuple[int, float]]]:
    """McNaughton's rule: `pipelines` shares of `m` micro-batches laid end to end over the peers' shares
    (in rank order); per pipeline its parts (worker id, micro-batches), none empty."""
    peers = [(wid, x) for wid, x in sorted(share.items()) if x > _TOL * m]
    out: list[list[tuple[int, float]]] = []
    i, room = 0, peers[0][1]
    for _ in range(pipelines):
        left, parts = float(m), []
        while left > _TOL * m:
            if room <= _TOL * m and i + 1 < len(peers):
                i, room = i + 1, peers[i + 1][1]
            take = left if i + 1 == len(peers) else min(left, room)  # the last peer takes any rounding left
            parts.append((peers[i][0], take))
            left, room = left - take, room - take
        out.append(parts)
    return out


def _deal(parts: list[tuple[int, float]], m: int, piece: float) -> tuple[tuple[float, ...], list[int]]:
    """One pipeline's share of `m` micro-batches cut into pieces over its parts: the pieces' boundaries, and
    each one's worker. A part is cut into equal pieces of at most `piece` micro-batches."""
    count = [max(1, math.ceil(x / piece - _TOL)) for _, x in parts]
    # Interleaved: piece i of a part of n comes at (i + 1/2) / n of the iteration.
    pieces = sorted(((i + 0.5) / n, j) for j, n in enumerate(count) for i in range(n))
    sizes = [parts[j][1] / count[j] for _, j in pieces]
    bounds = [0.0]
    for x in sizes[:-1]:
        bounds.append(bounds[-1] + x)
    bounds.append(float(m))
    return tuple(bounds), [parts[j][0] for _, j in pieces]
