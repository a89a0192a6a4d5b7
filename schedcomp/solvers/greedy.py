"""A memory-aware list scheduler over the compute graph, with its own op-level clock.

Workers are simulated in time order. A worker that is free at time t picks, among the ops whose inputs
have arrived by t:

1. a B (or fused BW): input gradients are on the critical path, so they go first;
2. an F, if the worker has fewer than `window[stage]` micro-batches between F and B and the activation
   fits under the memory limit; its own pipeline's F and the stage's re-routed F compete first-come
   first-served (with virtual stages the window and the memory admit a micro-batch at its first chunk
   on the worker and reserve its later chunks there, whose F then always run);
3. a W, deferred into the time nothing else is ready (policy "idle"), or only where it ends before the
   next known arrival (policy "fit"); a W always runs when memory blocks an F, since it frees memory.
   Policy "eager" runs each W right after its B instead (1F1B's order, the split kept for the bubbles
   between B and the next forward only).
   W left over after the last B fill the tail bubble before the next iteration's forwards reach the
   worker.

With `lookahead` (static routing, one stage per worker: each worker knows how many F it runs) a worker
also plans for the iteration's boundary. With a staggered step that boundary is a chain: a stage's last
B climbs the stages, each upper stage runs its W and steps, and the next iteration's forwards come back
down (`greedy_tables.boundary_room`). So once a worker has run its last F, it keeps as many W pending for
after its last B as fill that chain (W run before it would only leave the worker idle after it), runs a W
whenever it is otherwise idle (its step waits for every W, a "fit" policy included), and a pinned
piece ("fill") runs only where it, and at the last stage its B, which follows at once, ends before the
worker's next own F arrives (a piece delaying the pipeline's own round trip delays every stage above).

Re-routed F (of a failed home worker) are placed by one of three routings:
- "static": a fixed assignment computed up front (`route.assign_orphans`: balanced by speed factors);
- "pool": any live worker of the stage takes one when it is free and has nothing better, so the
  re-routed work lands where the bubbles are and fast workers take more;
- "quota": the pool, but each worker takes at most its balanced share.
The B and W of a slot follow its F to the same worker. Returns per-worker op-id sequences.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from schedcomp.errors import ScheduleError
from schedcomp.memory import stage_deltas
from schedcomp.solvers.greedy_loop import TOLERANCE, LoopInputs, python_loop
from schedcomp.solvers.greedy_native import engine, native_loop
from schedcomp.solvers.greedy_tables import boundary_room, interned, per_worker, slot_tables
from schedcomp.solvers.problem import Problem

ROUTINGS = ("pool", "quota", "static")
W_POLICIES = ("idle", "fit", "eager")


@dataclass(frozen=True)
class GreedyParams:
    """One variant of the list scheduler (see the module docstring)."""

    window: tuple[int, ...]
    w_policy: str = "idle"
    routing: str = "pool"
    scale_window: bool = False
    """Scale a worker's window by its load (own + balanced share of re-routed slots, over own)."""
    fill: bool = False
    """With re-cut pieces pinned to peers (`schedcomp.recut`): a peer runs a piece's F only when none of
    its own pipeline's is ready, so the pieces fill its bubbles instead of delaying its own round trip."""
    lookahead: bool = False
    """Plan for the iteration's boundary and the next own F (see the module docstring)."""

    def __str__(self) -> str:
        scaled = "x" if self.scale_window else ""
        fill = "/fill" if self.fill else ""
        ahead = "/ahead" if self.lookahead else ""
        return f"{self.routing}/{self.w_policy}/w{scaled}{','.join(map(str, self.window))}{fill}{ahead}"


def list_schedule(
    problem: Problem,
    params: GreedyParams,
    assignment: Mapping[int, int] | None = None,
    quota: Mapping[int, int] | None = None,
    loop: str | None = None,
) -> dict[int, list[int]]:
    """Schedule every op of `problem`; `assignment` (orphan slot -> worker id) is needed for "static"
    routing and `quota` (worker id -> most re-routed slots it takes) for "quota". `loop` picks the event loop
    that runs ("native" or "python": `greedy_native.engine`); both give the same schedule."""
    return list_schedule_steps(problem, params, assignment, quota, loop)[0]


def list_schedule_steps(
    problem: Problem,
    params: GreedyParams,
    assignment: Mapping[int, int] | None = None,
    quota: Mapping[int, int] | None = None,
    loop: str | None = None,
) -> tuple[dict[int, list[int]], np.ndarray]:
    """`list_schedule`, and per op id the step of the scheduler's clock that ran it (ops of one step start at
    one time): a layering the timing core may take instead of working one out (`time_sequences`'s `steps`)."""
    pp, stages, nk = problem.pp, problem.stages, len(problem.kinds)
    split = nk == 3
    costs = problem.costs
    p2p = costs.p2p
    n_workers = problem.dp * pp
    # Per-worker numbers are shared objects where equal (`interned`): the loop visits 8,000 workers in turn,
    # and reading a few shared floats stays in cache where 8,000 copies of each did not.
    limits = [0.0] * n_workers
    for w in problem.topology.live_workers:
        lim = problem.limit_of(problem.worker_id(w))
        limits[problem.worker_id(w)] = lim + TOLERANCE * max(1.0, lim if math.isfinite(lim) else 1.0)
    limits = interned(limits)
    # What each op kind (position in `problem.kinds`) adds to held memory at each stage: the one model.
    delta = [[d[k] for k in problem.kinds] for d in (stage_deltas(costs, s) for s in range(stages))]
    place = problem.place
    held = [problem.topology.chunks_of(p) for p in range(pp)]
    # With virtual stages a micro-batch is admitted to a worker at its first chunk there (window and
    # memory), which reserves the activations of its later chunks there: they then always fit, so a
    # worker never blocks the micro-batches it already holds (with one chunk nothing is reserved).
    first = [s == held[place[s]][0] for s in range(stages)]
    unit = [sum(delta[c][0] for c in held[p]) for p in range(pp)]
    window = [params.window[wid % pp] for wid in range(n_workers)]
    if params.scale_window and quota is not None:
        mb = problem.microbatches * problem.topology.chunks
        window = [math.ceil(win * (mb + quota.get(wid, 0)) / mb) for wid, win in enumerate(window)]
    use_pool = params.routing in ("pool", "quota")
    eager = params.w_policy == "eager"
    if params.routing == "static" and assignment is None:
        raise ScheduleError("static routing needs an assignment of the re-routed micro-batches")
    if params.routing == "quota" and quota is None:
        raise ScheduleError("quota routing needs a quota per worker")
    ahead = params.lookahead
    if ahead and (params.routing != "static" or problem.topology.chunks > 1):
        raise ScheduleError("lookahead needs static routing and one stage per worker (each worker counts its F)")

    live = [problem.worker_id(w) for w in problem.topology.live_workers]
    # Op times per worker (index stage * nk + kind): one list shared by the workers alike (`Problem.op_times`).
    dur: list[list[float]] = [[] for _ in range(n_workers)]
    for wid in live:
        dur[wid] = problem.op_times[wid]
    peers = [[problem.worker_id(w) for w in group] for group in problem.survivors]
    cut = problem.slot_sizes is not None  # re-cut micro-batches
    big = max(problem.slot_sizes) if problem.slot_sizes else 1.0  # admission reserves for the largest micro-batch

    # The loop numbers slots in (micro-batch, pipeline, stage) order, not as slot ids (`SlotTables`): the ready
    # queues' tie-break is then the number itself, and the slots that workers side by side run at one time
    # lie side by side in the tables below.
    slots = slot_tables(problem, None if use_pool else assignment)
    runner = slots.runner
    size = slots.sizes  # re-cut micro-batches: time and activation scale with the size (None: all whole)
    # Re-routed slots each worker takes at most ("quota" routing; 0 for a worker outside the quota).
    capped = params.routing == "quota" and quota is not None
    cap = [quota.get(wid, 0) for wid in range(n_workers)] if capped and quota is not None else []
    # Lookahead: the F each worker has left.
    left_f = [0] * n_workers
    room = boundary_room(problem) if ahead else []
    if ahead:
        for r in runner:
            if r >= 0:
                left_f[r] += 1
    fill = params.fill and cut
    d_f = [row[0] for row in delta]
    # (Per worker: its window less the tolerance, and the memory admitting one (largest) micro-batch takes.)
    tables = LoopInputs(
        n_workers=n_workers, pp=pp, stages=stages, nk=nk, n_slots=slots.n_slots, n_ops=problem.n_present * nk,
        split=split, eager=eager, idle=params.w_policy == "idle", use_pool=use_pool, capped=capped, fill=fill,
        ahead=ahead, cut=cut, p2p=p2p, limits=limits, window_open=interned([win - TOLERANCE for win in window]),
        admit=interned([unit[wid % pp] * big for wid in range(n_workers)]), dur=dur, cap=cap, left_f=left_f,
        live=live, first=first, d_f=d_f,
        reserve=[unit[place[st]] - d_f[st] for st in range(stages)],  # admitted at a first chunk: the later ones
        d_b=[row[1] for row in delta], d_w=[row[2] for row in delta] if split else [], place=place, unit=unit,
        room=room, held=held, peers=peers, runner=runner, home=slots.home if fill else [], size=size,
        starts=[(m * problem.dp + d) * stages for d in range(problem.dp) for m in range(problem.count(d))])
    log, steps, ran = (native_loop if engine(loop) == "native" else python_loop)(tables)
    if len(log) != tables.n_ops:
        raise ScheduleError(
            f"list scheduler stalled after {len(log)} of {tables.n_ops} ops (a bug): "
            "report it with the topology and cost model"
        )
    return per_worker(log, nk, ran, slots, live, steps, slots.n_slots * nk)
