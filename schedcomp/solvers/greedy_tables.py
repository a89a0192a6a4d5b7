"""The list scheduler's tables (`solvers.greedy.list_schedule`), built and read as numpy columns, and the
per-stage figures its variants use (`default_windows`, `boundary_room`).

The scheduler numbers slots in (micro-batch, pipeline, stage) order, number (m * dp + d) * stages + s, not as
slot ids: its ready queues then break ties on the number itself (earliest micro-batch, lowest pipeline, lowest
stage), the next stage's slot is still the next number, and the slots that workers side by side run at one
time lie side by side in its tables. It logs every op it schedules in one array, split per worker at the end.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from schedcomp.solvers.problem import Problem


@dataclass(frozen=True)
class SlotTables:
    """Per slot number (see the module docstring): its `slot_id`, who runs it (`runner`, -1 for a re-routed slot
    its stage's pool hands out), its home worker (`home`, live or not) and its size (`sizes`, None when every
    micro-batch is whole)."""

    n_slots: int
    slot_id: np.ndarray
    runner: list[int]
    home: list[int]
    sizes: list[float] | None


def slot_tables(problem: Problem, assignment: Mapping[int, int] | None) -> SlotTables:
    """The slot tables of `problem`, re-routed slots on the workers `assignment` names (None: on the pool);
    built as columns (half a million slots at pp = 32, dp = 256)."""
    pp, stages, width, dp = problem.pp, problem.stages, problem.width, problem.dp
    rest, stage = np.divmod(np.arange(problem.n_slots, dtype=np.int64), stages)
    microbatch, pipeline = np.divmod(rest, dp)
    slot_id = (pipeline * width + microbatch) * stages + stage
    home = pipeline * pp + np.asarray(problem.place, dtype=np.int64)[stage]
    live = np.zeros(dp * pp, dtype=bool)
    live[[problem.worker_id(w) for w in problem.topology.live_workers]] = True
    present = microbatch < np.asarray([problem.count(d) for d in range(dp)], dtype=np.int64)[pipeline]
    runner = np.where(live[home] & present, home, -1)
    if assignment:
        rest, stage = np.divmod(np.fromiter(assignment.keys(), dtype=np.int64, count=len(assignment)), stages)
        pipeline, microbatch = np.divmod(rest, width)
        runner[(microbatch * dp + pipeline) * stages + stage] = np.fromiter(assignment.values(), dtype=np.int64,
                                                                          count=len(assignment))
    sizes = None if problem.slot_sizes is None else np.asarray(problem.slot_sizes)[slot_id].tolist()
    # Worker ids as one int object per worker (`tolist` makes one per slot: half a million, out of cache).
    wids = np.array(range(-1, dp * pp), dtype=object)
    return SlotTables(problem.n_slots, slot_id, wids[runner + 1].tolist(), wids[home + 1].tolist(), sizes)


def interned(values: list[float]) -> list[float]:
    """`values` with equal numbers as one object each (the same numbers: the loop only reads them)."""
    first: dict[float, float] = {}
    return [first.setdefault(v, v) for v in values]


def queues(n_workers: int, used: bool) -> list[list[tuple[float, int]]]:
    """One ready queue per worker, or where the queue is never `used`, one empty list they all share."""
    if used:
        return [[] for _ in range(n_workers)]
    return [[]] * n_workers


def per_worker(log: np.ndarray, nk: int, runner: Sequence[int] | np.ndarray, slots: SlotTables, live: list[int],
               batches: np.ndarray, n_ops: int) -> tuple[dict[int, list[int]], np.ndarray]:
    """Each live worker's op ids in the order it runs them, from the log of every op (slot number * nk +
    kind position) in scheduling order (an op runs on its slot's `runner`, as the loop left them); and per op
    id (of `n_ops`) the scheduler's step that ran it, `batches[k]` being where the log's k-th step (one time of
    its clock) begins."""
    # (int32 columns where the numbers fit: half the fresh memory, which is most of the cost here.)
    small = np.int32 if n_ops < 2**31 else np.int64
    number, kind = np.divmod(log.astype(small), small(nk))
    worker = np.asarray(runner, dtype=small)[number]
    logged = slots.slot_id.astype(small)[number] * small(nk) + kind
    del number, kind
    steps = np.zeros(n_ops, small)
    steps[logged] = np.repeat(np.arange(len(batches), dtype=small),
                              np.diff(np.append(batches, len(log))))
    # (A stable sort of 16-bit keys is a radix sort: a fifth of the time of 64-bit ones at 1.5 million ops.)
    order = np.argsort(worker.astype(np.int16) if max(live, default=0) < 2**15 else worker, kind="stable")
    ops, worker = logged[order], worker[order]
    del order, logged
    wids = np.asarray(live, dtype=small)
    starts = np.searchsorted(worker, wids, side="left").tolist()
    stops = np.searchsorted(worker, wids, side="right").tolist()
    return {wid: ops[a:b].tolist() for wid, a, b in zip(live, starts, stops, strict=True)}, steps


def boundary_room(problem: Problem) -> list[float]:
    """Per stage s, the time from the end of its last B to the next iteration's first F reaching it, at
    the least, less its own all-reduce and step: for some stage j < s, the B climbing from s - 1 to j,
    j's W, all-reduce and step, then the forwards from j to s - 1, each hop a p2p transfer (the
    staggered step: stage j's next F waits for its own step). What a worker's W may fill after its
    last B without delaying its next F (one stage per worker, base costs)."""
    c, ar = problem.costs, problem.allreduce_times
    out = []
    for s in range(problem.pp):
        chain = max((sum(c.backward_input[i] + c.forward[i] + 2 * c.p2p for i in range(j, s))
                     + c.backward_weight[j] + ar[j] + c.optimizer[j] for j in range(s)), default=0.0)
        out.append(chain - ar[s] - c.optimizer[s])
    return out


def default_windows(problem: Problem) -> dict[str, tuple[int, ...]]:
    """In-flight windows to try, per place: 1F1B's (pp - s: the memory of 1F1B), ZB-H2's (2(pp - s) - 1),
    and "rtt": as many forwards as fit in the round trip from a stage's F to its gradient coming back.
    With virtual stages a window counts micro-batches (admitted at their first chunk on the worker), and
    the round trip runs from that chunk through every later stage and back, in units of the worker's
    forwards of one micro-batch over all its chunks."""
    pp, stages, costs = problem.pp, problem.stages, problem.costs
    rtt = []
    for s in range(pp):
        held = problem.topology.chunks_of(s)
        s0 = held[0]
        trip = sum(costs.forward[j] + costs.backward_input[j] for j in range(s0 + 1, stages))
        trip += 2 * (stages - 1 - s0) * costs.p2p + costs.backward_input[s0]
        rtt.append(1 + math.ceil(trip / max(sum(costs.forward[c] for c in held), 1e-9) - 1e-9))
    return {
        "1f1b": tuple(pp - s for s in range(pp)),
        "h2": tuple(2 * (pp - s) - 1 for s in range(pp)),
        "rtt": tuple(rtt),
    }
