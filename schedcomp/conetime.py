"""Re-time only what a local edit can move: `cone_times(start, old, new, deps)`, for `optimes.retimed`.

A plan's first-iteration start times (`optimes.op_times`) are a max-plus function of its graph: every lane
(a worker's compute order) runs its ops one after another, and an op starts once its lane's previous op and
every op it reads from have ended, plus the transfer latency where that one ran on another lane
(`timecore.run_levels`, which sets the rules). After an edit that changes a few lanes (a repair moves a failed
worker's ops onto peers), only the *cone* can move: the ops of the changed lanes from their first changed
position on, and everything that waits for them through lanes or dependencies. Every other op keeps its
producers, lane neighbour, duration and latencies, so its start is the very float it was. The cone is

1. found by a breadth-first walk over the successors (numpy, a frontier at a time), then
2. timed in topological order, a Kahn frontier at a time: an op of the cone starts once its producers in the
   cone have, and the ends of those outside are read off the kept times (the same max and sum as
   `run_levels`, so the same floats).

Every wait cycle of the edited graph passes through an edited lane (the graph before it was acyclic), so it
lies in the cone: where the walk of 2. stops short of the whole cone, the edit deadlocks (None).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from schedcomp.timecore import once

__all__ = ["Deps", "cone_times", "successors"]


@dataclass(frozen=True)
class Deps:
    """What the timing reads besides the lanes, all indexed by op id (`solvers.problem`'s numbering).

    - `pred`, `lat`: each op's producers (-1: none) and their latencies (`solvers.timing.op_dependencies`);
      a latency counts only from another lane;
    - `succ`: the same edges the other way (`successors(pred)`);
    - `durations[lane, op % durations.shape[1]]`: an op's duration on a lane, times `slot_sizes[op // kinds]`
      where given (re-cut micro-batches, as `solvers.timing.time_sequences` scales them)."""

    pred: np.ndarray
    lat: np.ndarray
    succ: np.ndarray
    durations: np.ndarray
    kinds: int
    slot_sizes: np.ndarray | None = None


@dataclass(frozen=True)
class _Layout:
    """The new lanes end to end as nodes 0..n-1 (two more: n is a lane's release, at 0, n + 1 no producer)."""

    ops: np.ndarray  # node -> op id
    node_of: np.ndarray  # op id -> node (-1: not run)
    owner: np.ndarray  # node -> lane id (n + 2 long)
    first: np.ndarray  # node -> whether it starts its lane (n + 2 long)
    last: np.ndarray  # node -> whether it ends its lane (n + 2 long)


def cone_times(start: np.ndarray, old: Mapping[int, np.ndarray], new: Mapping[int, np.ndarray],
               deps: Deps) -> np.ndarray | None:
    """The start times of lanes `new` (lane id -> op ids in order), which are lanes `old` timed as `start` (op
    id -> first-iteration start, NaN for ops not run) with some lanes edited and those missing from `new` gone
    (their ops moved to edited ones); None when the new lanes cannot run (a wait cycle, an op missing or run
    twice). A lane is edited where its array is not `old`'s very array and differs from it."""
    layout = _layout(new, len(start))
    if layout is None:
        return None  # an op id this plan does not have
    n = len(layout.ops)
    present = int(np.count_nonzero(~np.isnan(start)))
    if n != present or (n and ((layout.node_of[layout.ops] != np.arange(n)).any()
                               or np.isnan(start[layout.ops]).any())):
        return None  # an op repeated (its first place is left unmapped) or one missing
    cone = _reach(_edited(old, new, layout), layout, deps.succ)
    begins = _longest(_cone_graph(cone, layout, deps, start))
    if begins is None:
        return None
    out = start.copy()
    out[layout.ops[cone]] = begins
    return out


def successors(pred: np.ndarray) -> np.ndarray:
    """`pred` (op -> its producers, -1 for none) the other way round: op -> the ops that read it, -1 padded
    (as many columns as the most read op has readers)."""
    n_ops, width = pred.shape
    src = pred.reshape(-1)
    dst = np.repeat(np.arange(n_ops, dtype=np.int64), width)
    real = src >= 0
    order = np.argsort(src[real], kind="stable")
    src, dst = src[real][order], dst[real][order]
    bounds = np.searchsorted(src, np.arange(n_ops + 1))
    counts = np.diff(bounds)
    out = np.full((n_ops, int(counts.max(initial=0))), -1, dtype=np.int64)
    out[src, np.arange(len(src)) - np.repeat(bounds[:-1], counts)] = dst  # each reader's place among its op's
    out.flags.writeable = False
    return out


def _layout(new: Mapping[int, np.ndarray], n_ops: int) -> _Layout | None:
    """The lanes `new` end to end, or None where one names an op id outside 0..n_ops - 1."""
    lanes = sorted(new)
    arrays = [np.asarray(new[lane], dtype=np.int64) for lane in lanes]
    lens = np.array([len(a) for a in arrays], dtype=np.int64)
    ops = np.concatenate(arrays) if arrays else np.zeros(0, np.int64)
    n = len(ops)
    if n and (ops.min() < 0 or ops.max() >= n_ops):
        return None
    node_of = np.full(n_ops, -1, dtype=np.int64)
    node_of[ops] = np.arange(n)
    owner = np.full(n + 2, -1, dtype=np.int64)
    owner[:n] = np.repeat(np.array(lanes, dtype=np.int64), lens)
    begins = np.cumsum(lens) - lens
    first, last = np.zeros(n + 2, dtype=bool), np.zeros(n + 2, dtype=bool)
    first[begins[lens > 0]] = True
    last[(begins + lens - 1)[lens > 0]] = True
    return _Layout(ops, node_of, owner, first, last)


def _edited(old: Mapping[int, np.ndarray], new: Mapping[int, np.ndarray], layout: _Layout) -> np.ndarray:
    """The nodes of the edited lanes from their first changed position on: every op whose lane neighbour,
    lane or producers' lanes may have changed is one of them or waits for one."""
    seeds = []
    for lane, now in new.items():
        was = old.get(lane)
        if now is was:
            continue
        was = np.zeros(0, np.int64) if was is None else np.asarray(was)
        common = min(len(was), len(now))
        differ = np.flatnonzero(was[:common] != np.asarray(now[:common]))
        k = int(differ[0]) if len(differ) else common
        if k < len(now):
            begin = int(layout.node_of[now[0]])
            seeds.append(np.arange(begin + k, begin + len(now), dtype=np.int64))
    return np.concatenate(seeds) if seeds else np.zeros(0, np.int64)


def _reach(seeds: np.ndarray, layout: _Layout, succ: np.ndarray) -> np.ndarray:
    """Every node that waits for `seeds`, directly or not, and the seeds themselves: sorted."""
    seen = np.zeros(len(layout.ops), dtype=bool)
    seen[seeds] = True
    stamp = np.zeros(len(layout.ops), dtype=np.int64)
    frontier = seeds
    while len(frontier):
        reached = _waiting(frontier, layout, succ)
        reached = once(reached[~seen[reached]], stamp)
        seen[reached] = True
        frontier = reached
    return np.flatnonzero(seen)


@dataclass(frozen=True)
class _ConeGraph:
    """The cone as a graph of its own, nodes 0..m-1 (m: none, or outside the cone), a column per edge kind: each
    node's producers in the cone (`pred`: its lane predecessor, then those it reads from) with their latencies
    (`lat`, for those it reads from: 0 on one lane), its readers in the cone (`succ`: its lane successor, then
    those that read it), its duration, and `base`, the latest arrival from outside the cone."""

    pred: tuple[np.ndarray, ...]
    lat: tuple[np.ndarray, ...]
    succ: tuple[np.ndarray, ...]
    duration: np.ndarray
    base: np.ndarray


def _cone_graph(cone: np.ndarray, layout: _Layout, deps: Deps, start: np.ndarray) -> _ConeGraph:
    n, m = len(layout.ops), len(cone)
    at = np.full(n + 2, m, dtype=np.int64)  # node -> its place in the cone (m: outside)
    at[cone] = np.arange(m)
    ops, owner, first = layout.ops[cone], layout.owner[cone], layout.first[cone]

    def arrive(nodes: np.ndarray, inside: np.ndarray, extra: np.ndarray | float) -> None:
        """Fold the ends of producers outside the cone (real nodes, not in it) into `base`."""
        out = (inside == m) & (nodes < n)
        if out.any():
            known = nodes[out]
            late = start[layout.ops[known]] + _durations(known, layout, deps)
            base[out] = np.maximum(base[out], late + extra[out] if isinstance(extra, np.ndarray) else late)

    base = np.where(first, 0.0, -np.inf)  # a lane's first op: released at 0 in the first iteration
    prev = np.where(first, n, cone - 1)
    pred, lat = [at[prev]], []
    arrive(prev, pred[0], 0.0)
    for col in range(deps.pred.shape[1]):
        read = deps.pred[ops, col]
        nodes = np.where(read >= 0, layout.node_of[read], n + 1)
        lat.append(np.where(layout.owner[nodes] == owner, 0.0, deps.lat[ops, col]))  # one lane: a hand-off
        pred.append(at[nodes])
        arrive(nodes, pred[-1], lat[-1])
    succ = [at[np.where(layout.last[cone], n + 1, cone + 1)]]
    for col in range(deps.succ.shape[1]):
        readers = deps.succ[ops, col]
        succ.append(at[np.where(readers >= 0, layout.node_of[readers], n + 1)])
    return _ConeGraph(tuple(pred), tuple(lat), tuple(succ), _durations(cone, layout, deps), base)


def _longest(graph: _ConeGraph) -> np.ndarray | None:
    """Every node's start in the cone graph, a Kahn frontier at a time (the same max and sum as
    `timecore.run_levels`, so the same floats); None when part of it waits on itself (a cycle)."""
    m = len(graph.base)
    end = np.full(m + 1, -np.inf)  # end[m]: no producer in the cone
    begin = np.empty(m)
    final = np.zeros(m + 1, dtype=bool)  # timed (m: no producer in the cone, so never waited for)
    final[m] = True
    stamp = np.zeros(m + 1, dtype=np.int64)
    prev, *data = graph.pred
    frontier = np.flatnonzero(_all(final, graph.pred, np.arange(m)))
    timed = 0
    while len(frontier):
        timed += len(frontier)
        t = np.maximum(graph.base[frontier], end[prev[frontier]])  # (a lane hand-off: no latency)
        for pred, lat in zip(data, graph.lat, strict=True):
            np.maximum(t, end[pred[frontier]] + lat[frontier], out=t)
        begin[frontier] = t
        end[frontier] = t + graph.duration[frontier]
        final[frontier] = True
        waiting = np.concatenate([succ[frontier] for succ in graph.succ])
        waiting = once(waiting[waiting < m], stamp)  # (not timed yet: one of their producers just was)
        frontier = waiting[_all(final, graph.pred, waiting)]
    return begin if timed == m else None


def _all(final: np.ndarray, pred: tuple[np.ndarray, ...], nodes: np.ndarray) -> np.ndarray:
    """Whether every producer of each node in the cone is timed."""
    ready = final[pred[0][nodes]]
    for column in pred[1:]:
        ready &= final[column[nodes]]
    return ready


def _waiting(nodes: np.ndarray, layout: _Layout, succ: np.ndarray) -> np.ndarray:
    """The nodes that wait for `nodes`: each one's lane successor and its readers (repeats kept)."""
    readers = succ[layout.ops[nodes]].reshape(-1)
    return np.concatenate((nodes[~layout.last[nodes]] + 1, layout.node_of[readers[readers >= 0]]))


def _durations(nodes: np.ndarray, layout: _Layout, deps: Deps) -> np.ndarray:
    """Each node's duration on its lane (as `solvers.timing.time_sequences` times it)."""
    ops = layout.ops[nodes]
    dur = deps.durations[layout.owner[nodes], ops % deps.durations.shape[1]]
    return dur * deps.slot_sizes[ops // deps.kinds] if deps.slot_sizes is not None else dur
