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
down (`boundary_room`). So once a worker has run its last F, it keeps as many W pending for after its
last B as fill that chain (W run before it would only leave the worker idle after it), runs a W
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
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from schedcomp.errors import ScheduleError
from schedcomp.memory import stage_deltas
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
) -> dict[int, list[int]]:
    """Schedule every op of `problem`; `assignment` (orphan slot -> worker id) is needed for "static"
    routing and `quota` (worker id -> most re-routed slots it takes) for "quota"."""
    pp, stages, nk = problem.pp, problem.stages, len(problem.kinds)
    split = nk == 3
    costs = problem.costs
    p2p = costs.p2p
    n_workers = problem.dp * pp
    limits = [0.0] * n_workers
    for w in problem.topology.live_workers:
        lim = problem.limit_of(problem.worker_id(w))
        limits[problem.worker_id(w)] = lim + _EPS * max(1.0, lim if math.isfinite(lim) else 1.0)
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
    dur: list[list[float]] = [[] for _ in range(n_workers)]
    for wid in live:
        dur[wid] = problem.op_times[wid]  # stage * nk + kind
    peers = [[problem.worker_id(w) for w in group] for group in problem.survivors]
    sizes = problem.slot_sizes  # re-cut micro-batches: time and activation scale with the size
    big = 1.0 if sizes is None else max(sizes)  # admission reserves for the largest micro-batch

    n_slots = problem.n_slots
    runner = [-1] * n_slots
    for wid in live:
        d, p = divmod(wid, pp)
        for m in range(problem.count(d)):
            for s in held[p]:
                runner[problem.slot_id(d, m, s)] = wid
    if not use_pool:
        for slot, wid in (assignment or {}).items():
            runner[slot] = wid
    need = [1 if (slot % stages) == stages - 1 else 2 for slot in range(n_slots)]
    # Lookahead: the F each worker has left, the B it waits for, the time of its pending W.
    left_f = [0] * n_workers
    open_b = [0] * n_workers
    w_time = [0.0] * n_workers
    room = boundary_room(problem) if ahead else []
    if ahead:
        for r in runner:
            if r >= 0:
                left_f[r] += 1
    b_ready = [0.0] * n_slots
    taken = dict.fromkeys(live, 0)
    cap = dict(quota) if params.routing == "quota" and quota is not None else {}

    free = [0.0] * n_workers
    infl = [0.0] * n_workers  # micro-batches between F and B, a re-cut piece counting its size
    mem = [0.0] * n_workers
    reserved = [0.0] * n_workers
    fq: list[list[tuple[float, int, int, int]]] = [[] for _ in range(n_workers)]  # first chunk: admitted
    lq: list[list[tuple[float, int, int, int]]] = [[] for _ in range(n_workers)]  # later chunks: reserved
    bq: list[list[tuple[float, int, int, int]]] = [[] for _ in range(n_workers)]
    wq: list[deque[int]] = [deque() for _ in range(n_workers)]
    xq: list[list[tuple[float, int, int, int]]] = [[] for _ in range(n_workers)]  # pinned pieces ("fill")
    home = [problem.home_of(slot) for slot in range(n_slots)] if params.fill and sizes is not None else []
    pool: list[list[tuple[float, int, int, int]]] = [[] for _ in range(pp)]
    wake: list[float | None] = [None] * n_workers
    # The event queue, (time, worker id) in order: a heap of the distinct times, and per time a heap of the
    # worker ids due then. Same order as one heap of (time, id) tuples, but its comparisons are of floats and
    # of ints, not of tuples: they were a third of the loop with 8,000 workers.
    times: list[float] = []
    due: dict[float, list[int]] = {}
    seqs: dict[int, list[int]] = {wid: [] for wid in live}
    mb = problem.width  # slot ids' stride (re-cut pipelines may run more micro-batches than M)

    # Bound once: the loop below runs once per op (1.5 million at pp = 32, dp = 256), and a global or
    # attribute lookup per call was a tenth of its time.
    heappush, heappop, inf = heapq.heappush, heapq.heappop, math.inf
    fill = params.fill and sizes is not None
    idle = params.w_policy == "idle"
    last_stage = stages - 1

    def push(at: float, wid: int) -> None:
        ids = due.get(at)
        if ids is None:
            due[at] = [wid]
            heappush(times, at)
        else:
            heappush(ids, wid)

    def notify(wid: int, ready: float) -> None:
        at = ready if ready > free[wid] else free[wid]
        cur = wake[wid]
        if cur is None or at < cur:
            wake[wid] = at
            push(at, wid)

    def deliver_f(slot: int, ready: float) -> None:
        rest = slot // stages
        entry = (ready, rest % mb, rest // mb, slot)
        r = runner[slot]
        if r >= 0:
            heappush(xq[r] if fill and home[slot] != r else fq[r] if first[slot % stages] else lq[r], entry)
            notify(r, ready)
        else:
            p = place[slot % stages]
            heappush(pool[p], entry)
            for q in peers[p]:
                if not cap or taken[q] < cap.get(q, 0):
                    notify(q, ready)

    def deliver_b(slot: int, ready: float) -> None:
        r = runner[slot]
        rest = slot // stages
        heappush(bq[r], (ready, rest % mb, rest // mb, slot))
        # (`notify`, inlined: once per slot)
        at = ready if ready > free[r] else free[r]
        cur = wake[r]
        if cur is None or at < cur:
            wake[r] = at
            push(at, r)

    for d in range(problem.dp):
        for m in range(problem.count(d)):
            deliver_f(problem.slot_id(d, m, 0), 0.0)
    for wid in live:
        if wake[wid] is None:
            wake[wid] = 0.0
            push(0.0, wid)

    scheduled = 0
    while times:
        t = times[0]
        ids = due[t]
        w = heappop(ids)
        if not ids:
            heappop(times)
            del due[t]
        if wake[w] != t:
            continue
        wake[w] = None
        s = w % pp
        bqw, fqw, lqw, wqw = bq[w], fq[w], lq[w], wq[w]
        kind = -1
        slot = -1
        if bqw and bqw[0][0] <= t:
            slot = heappop(bqw)[3]
            kind = 1
        elif wqw and eager:
            slot = wqw.popleft()
            kind = 2
        else:
            held_now = mem[w] + reserved[w]
            mem_ok = held_now + unit[s] * big <= limits[w]
            # Re-cut pieces are admitted by their own activation, not the largest micro-batch's.
            f_ok = infl[w] < window[w] - _EPS and (mem_ok or sizes is not None)
            pool_s = pool[s]
            pool_ok = use_pool and bool(pool_s) and (not cap or taken[w] < cap.get(w, 0))
            later = lqw[0] if lqw and lqw[0][0] <= t else None
            own = fqw[0] if f_ok and fqw and fqw[0][0] <= t else None
            other = pool_s[0] if f_ok and pool_ok and pool_s[0][0] <= t else None
            if sizes is not None:
                own = own if own is None or held_now + unit[s] * sizes[own[3]] <= limits[w] else None
                other = other if other is None or held_now + unit[s] * sizes[other[3]] <= limits[w] else None
                xqw = xq[w]  # pinned pieces run only where nothing of the worker's own is ready ("fill")
                piece = xqw[0] if f_ok and xqw and xqw[0][0] <= t else None
                piece = piece if piece is None or held_now + unit[s] * sizes[piece[3]] <= limits[w] else None
                if piece is not None and ahead and fqw and fqw[0][0] > t:
                    ps = piece[3] % stages
                    took = dur[w][ps * nk] + (dur[w][ps * nk + 1] if ps == last_stage else 0.0)
                    piece = piece if t + took * sizes[piece[3]] <= fqw[0][0] + _EPS else None
                if piece is not None and own is None and other is None and later is None:
                    slot = heappop(xqw)[3]
                    kind = 0
            if kind == 0:
                pass
            elif later is not None and (own is None or later <= own) and (other is None or later <= other):
                slot = heappop(lqw)[3]
                kind = 0
            elif own is not None and (other is None or own <= other):
                slot = heappop(fqw)[3]
                kind = 0
            elif other is not None:
                slot = heappop(pool_s)[3]
                # The micro-batch's later chunks here follow it (see `route.assign_orphans`).
                d, m, _ = problem.slot_key(slot)
                for c in held[s]:
                    runner[problem.slot_id(d, m, c)] = w
                taken[w] += len(held[s])
                kind = 0
            if kind < 0:
                nxt = bqw[0][0] if bqw else inf
                if lqw and lqw[0][0] < nxt:
                    nxt = lqw[0][0]
                if f_ok:
                    # (With pieces, one ready now but not fitting waits for this worker's next op or delivery.)
                    if fqw and fqw[0][0] < nxt and (sizes is None or fqw[0][0] > t):
                        nxt = fqw[0][0]
                    if xq[w] and xq[w][0][0] < nxt and xq[w][0][0] > t:
                        nxt = xq[w][0][0]
                    if pool_ok and pool_s[0][0] < nxt and (sizes is None or pool_s[0][0] > t):
                        nxt = pool_s[0][0]
                # (Lookahead: with one B left, W that fit the boundary's chain wait for after it.)
                hold = (ahead and split and left_f[w] == 0 and open_b[w] == 1
                        and w_time[w] + dur[w][s * nk + 2] <= room[s])
                if wqw and not hold and (
                    idle
                    or (ahead and left_f[w] == 0)
                    or not mem_ok
                    or nxt == inf
                    or t + dur[w][(wqw[0] % stages) * nk + 2] * (1.0 if sizes is None else sizes[wqw[0]]) <= nxt + _EPS
                ):
                    slot = wqw.popleft()
                    kind = 2
                elif nxt < inf:
                    wake[w] = nxt
                    push(nxt, w)
                    continue
                else:
                    continue  # nothing known yet: a delivery will wake this worker
        st = slot % stages
        end = t + (dur[w][st * nk + kind] if sizes is None else dur[w][st * nk + kind] * sizes[slot])
        free[w] = end
        wake[w] = end
        ids = due.get(end)  # (`push`, inlined: once per op)
        if ids is None:
            due[end] = [w]
            heappush(times, end)
        else:
            heappush(ids, w)
        seqs[w].append(slot * nk + kind)
        scheduled += 1
        scale = 1.0 if sizes is None else sizes[slot]
        if kind == 0:
            left_f[w] -= 1
            open_b[w] += 1
            if first[st]:
                infl[w] += scale
                reserved[w] += (unit[s] - delta[st][0]) * scale
            else:
                reserved[w] -= delta[st][0] * scale
            mem[w] += delta[st][0] * scale
            if st < last_stage:
                deliver_f(slot + 1, end if runner[slot + 1] == w else end + p2p)
            need[slot] -= 1
            if end > b_ready[slot]:
                b_ready[slot] = end
            if need[slot] == 0:
                deliver_b(slot, b_ready[slot])
        elif kind == 1:
            open_b[w] -= 1
            if first[st]:
                infl[w] -= scale
            mem[w] += delta[st][1] * scale
            if split:
                wqw.append(slot)
                w_time[w] += dur[w][st * nk + 2] * scale
            if st > 0:
                up = slot - 1
                need[up] -= 1
                ready = end if runner[up] == w else end + p2p
                if ready > b_ready[up]:
                    b_ready[up] = ready
                if need[up] == 0:
                    deliver_b(up, b_ready[up])
        else:
            mem[w] += delta[st][2] * scale
            w_time[w] -= dur[w][st * nk + 2] * scale
    if scheduled != problem.n_present * nk:
        raise ScheduleError(
            f"list scheduler stalled after {scheduled} of {problem.n_present * nk} ops (a bug): "
            "report it with the topology and cost model"
        )
    return seqs


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
