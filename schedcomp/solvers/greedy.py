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

import heapq
import math
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from schedcomp.errors import ScheduleError
from schedcomp.memory import stage_deltas
from schedcomp.solvers.greedy_native import engine, run_native
from schedcomp.solvers.greedy_tables import (
    SlotTables,
    boundary_room,
    interned,
    per_worker,
    queues,
    slot_tables,
)
from schedcomp.solvers.problem import Problem

ROUTINGS = ("pool", "quota", "static")
W_POLICIES = ("idle", "fit", "eager")
_EPS = 1e-9


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
        limits[problem.worker_id(w)] = lim + _EPS * max(1.0, lim if math.isfinite(lim) else 1.0)
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
    # A slot's B needs its F and the next stage's B; the F always comes first (the next stage's F, hence
    # its B, waits for it), so this holds the F's end until the gradient arrives.
    f_end = [0.0] * slots.n_slots
    # Re-routed slots each worker took, and at most ("quota" routing; 0 for a worker outside the quota).
    capped = params.routing == "quota" and quota is not None
    taken = [0] * n_workers
    cap = [quota.get(wid, 0) for wid in range(n_workers)] if capped and quota is not None else []
    # Lookahead: the F each worker has left, the B it waits for, the time of its pending W.
    left_f = [0] * n_workers
    open_b = [0] * n_workers
    w_time = [0.0] * n_workers
    room = boundary_room(problem) if ahead else []
    if ahead:
        for r in runner:
            if r >= 0:
                left_f[r] += 1

    free = [0.0] * n_workers
    # Micro-batches between F and B, a re-cut piece counting its size (whole ones count as the int 1: small
    # ints are shared objects, and they compare with the windows as the floats would).
    infl: list[float] = [0] * n_workers
    mem = [0.0] * n_workers
    reserved = [0.0] * n_workers
    # Ready queues, heaps of (ready time, slot): equal times go to the earliest micro-batch, then the lowest
    # pipeline, then the lowest stage.
    fill = params.fill and cut
    fq: list[list[tuple[float, int]]] = [[] for _ in range(n_workers)]  # first chunk: admitted
    bq: list[list[tuple[float, int]]] = [[] for _ in range(n_workers)]
    wq: list[list[int]] = [[] for _ in range(n_workers)]  # B done, W not yet: a few slots, in order
    # Later chunks (reserved) and pinned pieces ("fill"): one empty list shared by every worker where there
    # are none (one chunk; no fill), which nothing pushes to.
    lq: list[list[tuple[float, int]]] = queues(n_workers, not all(first))
    xq: list[list[tuple[float, int]]] = queues(n_workers, fill)
    home = slots.home if fill else []
    pool: list[list[tuple[float, int]]] = [[] for _ in range(pp)]
    inf = math.inf
    wake = [inf] * n_workers  # when each worker is due next (inf: when a delivery wakes it)
    # The event queue, (time, worker id) in order: a heap of the distinct times, and per time the worker
    # ids due then (float and int comparisons, not tuple ones: those were a third of the loop).
    times: list[float] = []
    due: dict[float, list[int]] = {}
    # The ops in the order they are scheduled: one list appended to in turn, split per worker at the end
    # (each op's worker is its slot's runner then), is cheaper than 8,000 lists scattered over memory.
    log = array("q")  # (machine ints: a million int objects kept alive would crowd the cache)
    record = log.append
    batches = array("q")  # where each time's ops begin in `log`

    # Bound once: the loop below runs once per op (1.5 million at pp = 32, dp = 256), and a global or
    # attribute lookup per call was a tenth of its time.
    heappush, heappop = heapq.heappush, heapq.heappop
    idle = params.w_policy == "idle"
    last_stage = stages - 1
    # Per worker: its window less the tolerance, and the memory admitting one (largest) micro-batch takes.
    window_open = interned([win - _EPS for win in window])
    admit = interned([unit[wid % pp] * big for wid in range(n_workers)])
    d_f = [row[0] for row in delta]
    reserve = [unit[place[st]] - d_f[st] for st in range(stages)]  # admitted at a first chunk: the later ones
    d_b = [row[1] for row in delta]
    d_w = [row[2] for row in delta] if split else []
    starts = [(m * problem.dp + d) * stages for d in range(problem.dp) for m in range(problem.count(d))]
    n_ops = problem.n_present * nk

    if engine(loop) == "native":  # the same loop as below, compiled (`_listloop.c`)
        logged, steps, ran = run_native(
            n_workers=n_workers, pp=pp, stages=stages, nk=nk, n_slots=slots.n_slots, split=int(split),
            eager=int(eager), idle=int(idle), use_pool=int(use_pool), capped=int(capped), fill=int(fill),
            ahead=int(ahead), cut=int(cut), p2p=float(p2p), eps=_EPS, limits=limits, window_open=window_open,
            admit=admit, dur=dur, cap=cap, left_f=left_f, live=live, first=first, reserve=reserve, d_f=d_f,
            d_b=d_b, d_w=d_w, place=place, unit=unit, room=room, held=held, peers=peers, runner=runner, home=home,
            size=size, starts=starts, n_ops=n_ops)
        return _split_log(logged, steps, ran, nk, slots, live, n_ops)

    def push(at: float, wid: int) -> None:
        ids = due.get(at)
        if ids is None:
            due[at] = [wid]
            heappush(times, at)
        else:
            ids.append(wid)  # (sorted when its time comes)

    def deliver_f(slot: int, ready: float) -> None:
        """The F of `slot` can run from `ready` on (its input arrives then)."""
        entry = (ready, slot)
        r = runner[slot]
        if r >= 0:
            heappush(xq[r] if fill and home[slot] != r else fq[r] if first[slot % stages] else lq[r], entry)
            at = ready if ready > free[r] else free[r]
            if at < wake[r]:
                wake[r] = at
                push(at, r)
        else:  # re-routed, on its stage's pool: every peer that may still take one is told
            p = place[slot % stages]
            heappush(pool[p], entry)
            for q in peers[p]:
                if not capped or taken[q] < cap[q]:
                    at = ready if ready > free[q] else free[q]
                    if at < wake[q]:
                        wake[q] = at
                        push(at, q)

    def deliver_b(slot: int, ready: float) -> None:
        """The B of `slot` can run from `ready` on."""
        r = runner[slot]
        heappush(bq[r], (ready, slot))
        at = ready if ready > free[r] else free[r]
        if at < wake[r]:
            wake[r] = at
            push(at, r)

    for slot in starts:
        deliver_f(slot, 0.0)
    for wid in live:
        if wake[wid] == inf:
            wake[wid] = 0.0
            push(0.0, wid)

    # Every push while the workers due at `t` run is at `t` or later (op times and latencies are not negative,
    # and a worker sleeps only until a time past `t`), so one time is done before the next is taken. Its workers
    # run in id order, sorted once (popping each from a heap of 8,000 cost more). Only an op of zero time makes
    # workers due at `t` itself while they run (it and its deliveries end at `t`): they are merged in after it.
    while times:
        t = heappop(times)
        batches.append(len(log))
        batch = due[t]
        batch.sort(reverse=True)
        late: list[int] = []
        due[t] = late
        last_end, ending = -1.0, late  # the end of the last op scheduled (none yet: ends are >= 0) and its list
        while batch:
            w = batch.pop()
            if wake[w] != t:
                continue  # woken earlier since: this entry is stale
            # (`wake[w]` is set below on every path: the op's end, the time to look again, or never.)
            bqw, wqw = bq[w], wq[w]
            if bqw and bqw[0][0] <= t:
                slot = heappop(bqw)[1]
                kind = 1
            elif wqw and eager:
                slot = wqw.pop(0)
                kind = 2
            else:
                kind = -1
                s = w % pp
                fqw, lqw = fq[w], lq[w]
                held_now = mem[w] + reserved[w]
                mem_ok = held_now + admit[w] <= limits[w]
                # Re-cut pieces are admitted by their own activation, not the largest micro-batch's.
                f_ok = infl[w] < window_open[w] and (mem_ok or cut)
                pool_s = pool[s]
                pool_ok = use_pool and pool_s and (not capped or taken[w] < cap[w])
                later = lqw[0] if lqw and lqw[0][0] <= t else None
                own = fqw[0] if f_ok and fqw and fqw[0][0] <= t else None
                other = pool_s[0] if f_ok and pool_ok and pool_s[0][0] <= t else None
                if size is not None:
                    own = own if own is None or held_now + unit[s] * size[own[1]] <= limits[w] else None
                    other = other if other is None or held_now + unit[s] * size[other[1]] <= limits[w] else None
                    xqw = xq[w]  # pinned pieces run only where nothing of the worker's own is ready ("fill")
                    piece = xqw[0] if f_ok and xqw and xqw[0][0] <= t else None
                    piece = piece if piece is None or held_now + unit[s] * size[piece[1]] <= limits[w] else None
                    if piece is not None and ahead and fqw and fqw[0][0] > t:
                        ps = piece[1] % stages
                        took = dur[w][ps * nk] + (dur[w][ps * nk + 1] if ps == last_stage else 0.0)
                        piece = piece if t + took * size[piece[1]] <= fqw[0][0] + _EPS else None
                    if piece is not None and own is None and other is None and later is None:
                        slot = heappop(xqw)[1]
                        kind = 0
                if kind == 0:
                    pass
                elif later is not None and (own is None or later <= own) and (other is None or later <= other):
                    slot = heappop(lqw)[1]
                    kind = 0
                elif own is not None and (other is None or own <= other):
                    slot = heappop(fqw)[1]
                    kind = 0
                elif other is not None:
                    slot = heappop(pool_s)[1]
                    # The micro-batch's later chunks here follow it (see `route.assign_orphans`).
                    of_microbatch = slot - slot % stages
                    for c in held[s]:
                        runner[of_microbatch + c] = w
                    taken[w] += len(held[s])
                    kind = 0
                elif wqw and not (hold := ahead and split and left_f[w] == 0 and open_b[w] == 1
                                  and w_time[w] + dur[w][s * nk + 2] <= room[s]) \
                        and (idle or not mem_ok or (ahead and left_f[w] == 0)):
                    # (Lookahead: with one B left, W that fit the boundary's chain wait for after it: `hold`.)
                    slot = wqw.pop(0)
                    kind = 2
                else:
                    nxt = bqw[0][0] if bqw else inf
                    if lqw and lqw[0][0] < nxt:
                        nxt = lqw[0][0]
                    if f_ok:
                        # (With pieces, one ready now but not fitting waits for this worker's next op or delivery.)
                        if fqw and fqw[0][0] < nxt and (size is None or fqw[0][0] > t):
                            nxt = fqw[0][0]
                        if xq[w] and xq[w][0][0] < nxt and xq[w][0][0] > t:
                            nxt = xq[w][0][0]
                        if pool_ok and pool_s[0][0] < nxt and (size is None or pool_s[0][0] > t):
                            nxt = pool_s[0][0]
                    if wqw and not hold and (
                        nxt == inf
                        or t + dur[w][(wqw[0] % stages) * nk + 2] * (1.0 if size is None else size[wqw[0]])
                        <= nxt + _EPS
                    ):
                        slot = wqw.pop(0)
                        kind = 2
                    elif nxt < inf:
                        wake[w] = nxt
                        push(nxt, w)
                        continue
                    else:
                        wake[w] = inf
                        continue  # nothing known yet: a delivery will wake this worker
            st = slot % stages
            scale = 1 if size is None else size[slot]
            end = t + dur[w][st * nk + kind] * scale  # (x * 1 is x: whole micro-batches are not rounded)
            if end == last_end:  # (`push`, inlined: once per op; most ops of one time end together)
                end = last_end  # (one float object for them all: see `interned`)
                ending.append(w)
            else:
                ending = due.get(end)
                if ending is None:
                    ending = due[end] = [w]
                    heappush(times, end)
                else:
                    ending.append(w)
                last_end = end
            free[w] = end
            wake[w] = end
            record(slot * nk + kind)
            if kind == 0:
                if ahead:
                    left_f[w] -= 1
                    open_b[w] += 1
                if first[st]:
                    infl[w] += scale
                    if reserve[st]:  # (nothing with one chunk: adding 0.0 would change no value)
                        reserved[w] += reserve[st] * scale
                else:
                    reserved[w] -= d_f[st] * scale
                mem[w] += d_f[st] * scale
                if st == last_stage:
                    deliver_b(slot, end)
                else:
                    f_end[slot] = end
                    nxt_slot = slot + 1
                    r = runner[nxt_slot]
                    ready = end + p2p if p2p and r != w else end  # (end + 0.0 is end)
                    if r < 0 or fill or not first[nxt_slot % stages]:
                        deliver_f(nxt_slot, ready)
                    else:  # (`deliver_f` to a worker's first chunk, inlined: once per F)
                        heappush(fq[r], (ready, nxt_slot))
                        at = ready if ready > free[r] else free[r]
                        if at < wake[r]:
                            wake[r] = at
                            push(at, r)
            elif kind == 1:
                if first[st]:
                    infl[w] -= scale
                mem[w] += d_b[st] * scale
                if split:
                    wqw.append(slot)
                    if ahead:
                        w_time[w] += dur[w][st * nk + 2] * scale
                if ahead:
                    open_b[w] -= 1
                if st > 0:
                    up = slot - 1
                    ready = end + p2p if p2p and runner[up] != w else end
                    deliver_b(up, f_end[up] if f_end[up] > ready else ready)
            else:
                mem[w] += d_w[st] * scale
                if ahead:
                    w_time[w] -= dur[w][st * nk + 2] * scale
            if end == t and late:  # an op of zero time: the workers it made due now run in id order too
                batch.extend(late)
                late.clear()
                batch.sort(reverse=True)
        del due[t]
    return _split_log(np.frombuffer(log, dtype=np.int64), np.frombuffer(batches, dtype=np.int64), runner, nk, slots,
                      live, n_ops)


def _split_log(log: np.ndarray, batches: np.ndarray, runner: Sequence[int] | np.ndarray, nk: int, slots: SlotTables,
               live: list[int], n_ops: int) -> tuple[dict[int, list[int]], np.ndarray]:
    """Either loop's log split per worker (`per_worker`), once every op of the problem is in it."""
    if len(log) != n_ops:
        raise ScheduleError(
            f"list scheduler stalled after {len(log)} of {n_ops} ops (a bug): "
            "report it with the topology and cost model"
        )
    return per_worker(log, nk, runner, slots, live, batches, slots.n_slots * nk)
