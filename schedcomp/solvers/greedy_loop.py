"""The list scheduler's event loop in Python (`greedy.list_schedule_steps` prepares its tables, `LoopInputs`):
the reference for the compiled one (`greedy_native`, `_listloop.c`), and the loop that runs where that was not
built. See `solvers.greedy` for what it decides."""

from __future__ import annotations

import heapq
import math
from array import array
from dataclasses import dataclass

import numpy as np

from schedcomp.solvers.greedy_tables import queues

TOLERANCE = 1e-9
"""The tolerance of the loop's comparisons of times and memory (the compiled loop is handed it)."""


@dataclass(frozen=True)
class LoopInputs:
    """What either loop reads, prepared once by `greedy.list_schedule_steps` (neither loop changes these lists:
    the Python one copies `runner` and `left_f` before it writes them). Per worker id: `limits`, `window_open`,
    `admit`, `dur` (op times, index stage * nk + kind; empty for a dead worker), `cap`, `left_f`; per stage:
    `first`, `reserve`, `d_f`, `d_b`, `d_w`, `place`; per place: `unit`, `room`, `held` (its stages), `peers`
    (its live workers); per slot number (`SlotTables`): `runner`, `home`, `size`; `starts` the slots delivered
    at time 0, in order."""

    n_workers: int
    pp: int
    stages: int
    nk: int
    n_slots: int
    n_ops: int
    split: bool
    eager: bool
    idle: bool
    use_pool: bool
    capped: bool
    fill: bool
    ahead: bool
    cut: bool
    p2p: float
    limits: list[float]
    window_open: list[float]
    admit: list[float]
    dur: list[list[float]]
    cap: list[int]
    left_f: list[int]
    live: list[int]
    first: list[bool]
    d_f: list[float]
    reserve: list[float]
    d_b: list[float]
    d_w: list[float]
    place: tuple[int, ...]
    unit: list[float]
    room: list[float]
    held: list[tuple[int, ...]]
    peers: list[list[int]]
    runner: list[int]
    home: list[int]
    size: list[float] | None
    starts: list[int]


def python_loop(tables: LoopInputs) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """The op log (slot number * nk + kind position, in scheduling order), the steps (where each time of the
    clock begins in the log) and every slot's runner after the loop (pool routing hands slots out)."""
    n_workers, pp, stages, nk = tables.n_workers, tables.pp, tables.stages, tables.nk
    split, eager, idle, use_pool, capped = tables.split, tables.eager, tables.idle, tables.use_pool, tables.capped
    fill, ahead, cut, p2p = tables.fill, tables.ahead, tables.cut, tables.p2p
    limits, window_open, admit, dur, cap = tables.limits, tables.window_open, tables.admit, tables.dur, tables.cap
    first, d_f, reserve, d_b, d_w = tables.first, tables.d_f, tables.reserve, tables.d_b, tables.d_w
    place = tables.place
    unit, room, held, peers, home, size = tables.unit, tables.room, tables.held, tables.peers, tables.home, tables.size
    runner, left_f = list(tables.runner), list(tables.left_f)
    # A slot's B needs its F and the next stage's B; the F always comes first (the next stage's F, hence
    # its B, waits for it), so this holds the F's end until the gradient arrives.
    f_end = [0.0] * tables.n_slots
    taken = [0] * n_workers  # re-routed slots each worker took ("quota" routing)
    # Lookahead: the B each worker waits for, the time of its pending W.
    open_b = [0] * n_workers
    w_time = [0.0] * n_workers
    free = [0.0] * n_workers
    # Micro-batches between F and B, a re-cut piece counting its size (whole ones count as the int 1: small
    # ints are shared objects, and they compare with the windows as the floats would).
    infl: list[float] = [0] * n_workers
    mem = [0.0] * n_workers
    reserved = [0.0] * n_workers
    # Ready queues, heaps of (ready time, slot): equal times go to the earliest micro-batch, then the lowest
    # pipeline, then the lowest stage.
    fq: list[list[tuple[float, int]]] = [[] for _ in range(n_workers)]  # first chunk: admitted
    bq: list[list[tuple[float, int]]] = [[] for _ in range(n_workers)]
    wq: list[list[int]] = [[] for _ in range(n_workers)]  # B done, W not yet: a few slots, in order
    # Later chunks (reserved) and pinned pieces ("fill"): one empty list shared by every worker where there
    # are none (one chunk; no fill), which nothing pushes to.
    lq: list[list[tuple[float, int]]] = queues(n_workers, not all(first))
    xq: list[list[tuple[float, int]]] = queues(n_workers, fill)
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
    last_stage = stages - 1

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

    for slot in tables.starts:
        deliver_f(slot, 0.0)
    for wid in tables.live:
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
                        piece = piece if t + took * size[piece[1]] <= fqw[0][0] + TOLERANCE else None
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
                        <= nxt + TOLERANCE
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
    return np.frombuffer(log, dtype=np.int64), np.frombuffer(batches, dtype=np.int64), runner
