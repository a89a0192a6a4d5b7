"""The one timing core: when every node of every worker's lane runs, iteration after iteration.

The simulator (`schedcomp.simulator`, from a lowered plan) and the solvers (`solvers.timing`,
`solvers.improve`, from per-worker op sequences) build the same graph and time it here, so the
rules of docs/design.md are written once:

- A *lane* (one worker) runs its nodes in order, one at a time, once per iteration.
- A node starts when its lane is free and every producer it reads has ended, plus that edge's
  latency when the producer ran on another lane (a transfer between workers takes `costs.p2p`);
  a producer on the node's own lane hands off for nothing, whatever the edge's latency (the
  solvers move ops between workers, so two chunks of a micro-batch may or may not share one).
  It takes its duration on that lane (compute and the step are divided by the worker's speed).
- A *collective* node (an ALLREDUCE) starts when every member of its group has reached it, at the
  latest arrival, and ends for all of them at once.
- Data flows within one iteration only. A lane starts iteration k+1 when it finishes iteration k
  (staggered optimizer) or, with a synchronous one, when every lane that runs anything has.
- Nothing else contends (no link or device sharing), so every time is a max-plus function of
  earlier ones: iterations are timed one after another, and within one the order in which lanes
  are advanced does not matter. When no lane can move with one unfinished, the lanes deadlock.

Two engines apply these rules. `run_lanes` is a worklist in plain Python: collectives anywhere,
it says where a deadlock is, and with a fixed `Graph` only the lanes change between calls (what
the local search needs). `run_levels` is numpy, a topological level at a time, for graphs of
100k nodes; it takes the collective as each lane's tail (all-reduce, then step), which is all the
solvers' sequences have. Both return the same `iteration_ends`; the period is read off them by
`schedcomp.timeline.period_from_ends`.
"""

from __future__ import annotations

import itertools
from collections.abc import Container, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

__all__ = ["Gate", "Graph", "LaneRun", "LevelRun", "Stuck", "run_lanes", "run_levels"]

SLOW = -2  # `Graph.columns`: a node read off `preds` and `members` (a collective, or many producers)


@dataclass(frozen=True)
class Graph:
    """What stays fixed while lanes are reordered. Nodes are numbered 0..n-1.

    - `preds[v]`: (producer node, latency) pairs v waits for, all in the same iteration; the
      latency counts only when the producer runs on another lane.
    - `members[v]`: for a collective node, every node of its rendezvous (v included), one per
      lane; () for any other node. A collective node has no producers.
    A node's duration is its lane's: `durations[lane][v]` in `run_lanes`.
    """

    preds: Sequence[tuple[tuple[int, float], ...]]
    members: Sequence[tuple[int, ...]]

    @cached_property
    def columns(self) -> tuple[list[int], list[float], list[int], list[float]]:
        """The preds as the worklist reads them fastest: the first producer of every node and its
        latency, the second and its latency (-1: none; `SLOW` first: a collective, or more than two
        producers, read from `preds` and `members`)."""
        first, first_lat, second, second_lat = [], [], [], []
        for ps, group in zip(self.preds, self.members, strict=True):
            if ps and group:
                raise ValueError("a collective node waits for its group only: give it no producers")
            a, la = ps[0] if 0 < len(ps) <= 2 else (SLOW if ps or group else -1, 0.0)
            b, lb = ps[1] if len(ps) == 2 else (-1, 0.0)
            first.append(a)
            first_lat.append(la)
            second.append(b)
            second_lat.append(lb)
        return first, first_lat, second, second_lat


@dataclass(frozen=True)
class Gate:
    """A wait between iterations that spans lanes (post-validation of a global gradient check,
    `schedcomp.gradcheck`): before iteration k > 0, every lane that runs anything waits until
    every node of `nodes` has ended in iteration k - 1, plus `latency`, and then takes
    `extra[lane]` more."""

    nodes: tuple[int, ...]
    latency: float
    extra: tuple[float, ...]


@dataclass(frozen=True)
class Stuck:
    """Where the lanes deadlocked: in `iteration`, lane l waits at `positions[l]` of its sequence
    (its length when it finished); node v has run in that iteration iff `done[v] == iteration`."""

    iteration: int
    positions: tuple[int, ...]
    done: Sequence[int]


@dataclass(frozen=True)
class LaneRun:
    """The result of `run_lanes`.

    - `iteration_ends`: when the last lane finished each iteration (never earlier than the one before).
    - `releases[k][l]`: when lane l began iteration k.
    - `starts[k]`, `ends[k]`: every node's start and end in iteration k, for the kept iterations.
    - `stuck`: None, or where the lanes deadlocked (the other fields then cover what ran before).
    """

    iteration_ends: tuple[float, ...]
    releases: tuple[tuple[float, ...], ...]
    starts: dict[int, list[float]]
    ends: dict[int, list[float]]
    stuck: Stuck | None = None


def run_lanes(
    graph: Graph,
    seqs: Sequence[Sequence[int]],
    durations: Sequence[Sequence[float]],
    iterations: int,
    synchronous: bool = False,
    keep: Container[int] = (),
    gate: Gate | None = None,
) -> LaneRun:
    """Time lanes `seqs` (lane -> its nodes in order) of `graph` over `iterations` (the module's rules).

    Every node must sit in at most one lane; `durations[lane][v]` is node v's duration on that lane
    (lanes may share one list). `keep`: the iterations whose node times to return. `gate`: a wait
    between iterations over lanes (see `Gate`)."""
    first, first_lat, second, second_lat = graph.columns
    preds, members = graph.preds, graph.members
    n_nodes, n_lanes = len(preds), len(seqs)
    lane_of = _lane_of(n_nodes, seqs)
    done = [-1] * n_nodes
    start = [0.0] * n_nodes
    end = [0.0] * n_nodes
    free = [0.0] * n_lanes
    busy = [lane for lane in range(n_lanes) if len(seqs[lane])]
    ends: list[float] = []
    releases: list[tuple[float, ...]] = []
    starts_kept: dict[int, list[float]] = {}
    ends_kept: dict[int, list[float]] = {}
    for it in range(iterations):
        if gate is not None and it > 0:
            opened = max((end[v] for v in gate.nodes), default=-np.inf) + gate.latency
            for lane in busy:
                free[lane] = max(free[lane], opened) + gate.extra[lane]
        releases.append(tuple(free))
        ptr = [0] * n_lanes
        waiting: dict[int, list[int]] = {}  # node -> lanes parked until it ends
        gathered: dict[int, dict[int, tuple[int, float]]] = {}  # collective's first node -> node: (lane, arrival)
        stack = list(busy)
        while stack:
            lane = stack.pop()
            seq, dur = seqs[lane], durations[lane]
            i, t, n = ptr[lane], free[lane], len(seq)
            while i < n:  # the hot path of the local search: the first two producers are unrolled
                op = seq[i]
                p = first[op]
                if p >= 0:
                    if done[p] != it:
                        waiting.setdefault(p, []).append(lane)
                        break
                    a = end[p] + first_lat[op] if lane_of[p] != lane else end[p]
                    if a > t:
                        t = a
                    p = second[op]
                    if p >= 0:
                        if done[p] != it:
                            waiting.setdefault(p, []).append(lane)
                            break
                        a = end[p] + second_lat[op] if lane_of[p] != lane else end[p]
                        if a > t:
                            t = a
                elif p == SLOW:
                    group = members[op]
                    if not group:  # more than two producers
                        p = next((q for q, _ in preds[op] if done[q] != it), -1)
                        if p >= 0:
                            waiting.setdefault(p, []).append(lane)
                            break
                        t = max(t, *(end[q] + lat if lane_of[q] != lane else end[q] for q, lat in preds[op]))
                    else:
                        got = gathered.setdefault(group[0], {})
                        got[op] = (lane, t)
                        if len(got) < len(group):
                            break  # parked here: the last member to arrive moves it on
                        del gathered[group[0]]
                        begin = max(arrival for _, arrival in got.values())
                        t = begin + dur[op]
                        for node, (other, _) in got.items():
                            start[node], end[node], done[node] = begin, t, it
                            woken = waiting.pop(node, None)
                            if woken:
                                stack.extend(woken)
                            if other != lane:
                                ptr[other] += 1
                                free[other] = t
                                stack.append(other)
                        i += 1
                        continue
                t += dur[op]
                end[op] = t
                done[op] = it
                i += 1
                woken = waiting.pop(op, None)
                if woken:
                    stack.extend(woken)
            ptr[lane], free[lane] = i, t
        if any(ptr[lane] < len(seqs[lane]) for lane in busy):
            stuck = Stuck(it, tuple(ptr), done)
            return LaneRun(tuple(ends), tuple(releases), starts_kept, ends_kept, stuck)
        if it in keep:
            _fill_starts(start, end, graph, seqs, releases[it], lane_of)
            starts_kept[it], ends_kept[it] = start[:], end[:]
        last = max((free[lane] for lane in busy), default=0.0)
        ends.append(max(last, ends[-1]) if ends else last)
        if synchronous:
            for lane in busy:
                free[lane] = ends[-1]
    return LaneRun(tuple(ends), tuple(releases), starts_kept, ends_kept)


def _lane_of(n_nodes: int, seqs: Sequence[Sequence[int]]) -> list[int]:
    """The lane of every node (-1: in none), which decides whether an edge's latency counts."""
    lane_of = [-1] * n_nodes
    for lane, seq in enumerate(seqs):
        for v in seq:
            lane_of[v] = lane
    return lane_of


def _fill_starts(start: list[float], end: list[float], graph: Graph, seqs: Sequence[Sequence[int]],
                 releases: Sequence[float], lane_of: Sequence[int]) -> None:
    """Every node's start, from the ends (the worklist keeps only those, to spare its hot path a store):
    the same max over its lane's previous end and its producers' arrivals, so the same float. A
    collective's start is kept by the worklist; nodes that did not run keep their last value."""
    preds, members = graph.preds, graph.members
    for lane, seq in enumerate(seqs):
        t = releases[lane]
        for op in seq:
            if not members[op]:
                begin = t
                for p, lat in preds[op]:
                    a = end[p] + lat if lane_of[p] != lane else end[p]
                    if a > begin:
                        begin = a
                start[op] = begin
            t = end[op]


@dataclass(frozen=True)
class LevelRun:
    """The result of `run_levels`: iteration ends, and every node's start in the first and last iteration."""

    iteration_ends: tuple[float, ...]
    first: np.ndarray
    last: np.ndarray


def run_levels(
    lens: np.ndarray,
    pred: np.ndarray,
    lat: np.ndarray,
    dur: np.ndarray,
    group: np.ndarray,
    tail: np.ndarray,
    iterations: int,
    synchronous: bool = False,
    layers: np.ndarray | None = None,
) -> LevelRun | None:
    """The rules of `run_lanes` on numpy arrays, a topological level at a time; None on a deadlock.

    Nodes 0..n-1 are the lanes' nodes laid end to end (lane l holds `lens[l]` of them, in order).
    `pred[v]`, `lat[v]`: v's producers (one column each; -1 for none) and their latencies (counted
    only from another lane, as in `run_lanes`);
    `dur[v]`: its duration on its lane. After its last node, lane l joins the collective of all
    lanes with its `group[l]` (it takes `tail[l, 0]`) and then runs `tail[l, 1]` (the step).
    `layers[v]` (optional): a number per node that its producers and its lane's previous node may give
    levels instead of Kahn's (a list scheduler's steps); they are taken where every such edge goes to a
    higher number and they are not many more than Kahn's can be. Any levels in which each node's producers
    come first give the same times, each node's the same max over the same numbers."""
    n, n_lanes = len(dur), len(lens)
    # Node numbers as int32 where they fit: a million-node graph's index arrays are then half the memory
    # (fresh memory is most of their cost), the same numbers.
    idx = np.int32 if n + n_lanes < 2**31 - 1 else np.int64
    # Every node's producers as indices into `end`: slot n + l holds lane l's release (its first
    # node's "previous end"), slot n + n_lanes is -inf (no producer).
    release_at = n + np.arange(n_lanes, dtype=idx)
    none = n + n_lanes
    lane_start = np.concatenate(([0], np.cumsum(lens)[:-1])).astype(np.int64) if n_lanes else np.zeros(0, np.int64)
    has_nodes = lens > 0
    prev = np.arange(-1, n - 1, dtype=idx)
    prev[lane_start[has_nodes]] = release_at[has_nodes]
    lane = np.repeat(np.arange(n_lanes, dtype=idx), lens)
    real = pred >= 0
    lat = np.where(real & (lane[np.where(real, pred, 0)] == lane[:, None]), 0.0, lat)  # a hand-off on one lane
    del lane
    pred = np.where(real, pred, none).astype(idx, copy=False)
    del real
    cols = np.column_stack((prev, pred))
    levels = _given_levels(n, cols, layers, int(lens.max(initial=0))) if layers is not None else None
    if levels is None:
        levels = _levels(n, cols)
    del cols
    if levels is None:
        return None
    # Renumber the nodes level by level, so each level is a slice of the arrays (no scatter per level);
    # the release and -inf slots keep their place after them.
    order = np.concatenate(levels) if levels else np.zeros(0, np.int64)
    pos = np.arange(n + n_lanes + 1, dtype=idx)
    pos[order] = np.arange(n, dtype=idx)
    prev_at, dur_at = pos[prev[order]], dur[order]
    pred_at, lat_at = np.ascontiguousarray(pos[pred[order]].T), np.ascontiguousarray(lat[order].T)
    del order, prev, pred, lat
    cuts = np.cumsum([0] + [len(level) for level in levels]).tolist()
    steps = [(slice(lo, hi), prev_at[lo:hi], _producers(pred_at[:, lo:hi], lat_at[:, lo:hi], none))
             for lo, hi in itertools.pairwise(cuts)]
    last_node = pos[lane_start + lens - 1]
    groups = int(group.max()) + 1 if n_lanes else 0
    end = np.zeros(n + n_lanes + 1)
    end[none] = -np.inf
    start = np.zeros(n)
    first = start
    ends: list[float] = []
    for it in range(iterations):
        shown = it == 0 or it == iterations - 1  # the only starts returned
        for level, before, producers in steps:
            t = end[before]
            for p, lat_p in producers:
                np.maximum(t, end[p] if lat_p is None else end[p] + lat_p, out=t)
            if shown:
                start[level] = t
            end[level] = t + dur_at[level]
        if it == 0:
            first = start[pos[:n]]
        finish = end[release_at].copy()
        finish[has_nodes] = end[last_node[has_nodes]]
        arrive = np.full(groups, -np.inf)
        np.maximum.at(arrive, group, finish)
        step_end = (arrive[group] + tail[:, 0]) + tail[:, 1]
        ends.append(max(float(step_end.max()), ends[-1]) if ends else float(step_end.max()))
        end[release_at] = ends[-1] if synchronous else step_end
    return LevelRun(tuple(ends), first, start[pos[:n]])


def _producers(pred: np.ndarray, lat: np.ndarray, none: int) -> tuple[tuple[np.ndarray, np.ndarray | None], ...]:
    """A level's producer columns (node positions, latencies) that matter: a column naming no producer (`none`,
    whose end is -inf) changes no max, and a latency of zero is left out (every end is +0.0 or more, or -inf,
    so adding 0.0 changes none): the same times for fewer passes over the level."""
    return tuple((p, lat_p if lat_p.any() else None) for p, lat_p in zip(pred, lat, strict=True) if (p != none).any())


def _levels(n: int, cols: np.ndarray) -> list[np.ndarray] | None:
    """Nodes grouped by topological level (Kahn's algorithm, a frontier at a time); None on a cycle."""
    src = cols.T.reshape(-1)
    dst = np.tile(np.arange(n), cols.shape[1])
    real = src < n
    src, dst = src[real], dst[real]
    indeg = np.bincount(dst, minlength=n)
    order = np.argsort(src, kind="stable")
    succ = dst[order]
    bounds = np.searchsorted(src[order], np.arange(n + 1))
    frontier = np.flatnonzero(indeg == 0)
    stamp = np.zeros(n, dtype=np.int64)
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
        frontier = once(targets[indeg[targets] == 0], stamp)  # a node freed by two producers at once: keep it once
    return levels if done == n else None


def _given_levels(n: int, cols: np.ndarray, layers: np.ndarray, longest: int) -> list[np.ndarray] | None:
    """The nodes grouped by `layers` (each group's nodes in order), or None where a producer (`cols`, >= n:
    none) is not in a lower layer, or where the layers are more than twice as many as the longest lane (a
    lower bound of Kahn's levels: each is a chain), which would cost the engine more steps than it saves."""
    for col in cols.T:  # (a producer column at a time: a third of the memory)
        real = col < n
        if not (layers[col[real]] < layers[real]).all():
            return None
    keys = layers - int(layers.min(initial=0))
    counts = np.bincount(keys)
    if np.count_nonzero(counts) > 2 * longest + 16:
        return None
    # (A stable sort of 16-bit keys is a radix sort.)
    order = np.argsort(keys.astype(np.int16) if len(counts) < 2**15 else keys, kind="stable")
    return [level for level in np.split(order, np.cumsum(counts)[:-1]) if len(level)]


def once(nodes: np.ndarray, stamp: np.ndarray) -> np.ndarray:
    """`nodes` without repeats: each keeps the place whose index `stamp` (scratch, one per node) holds last."""
    at = np.arange(len(nodes))
    stamp[nodes] = at
    return nodes[stamp[nodes] == at]
