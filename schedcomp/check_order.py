"""The validator's order rules: whether the checked streams can run, and the grid its errors show.

`OrderRules` is the half of `check._Checker` that looks at order rather than at single
instructions: local hand-offs between two chunks of one worker (the producer first), FIFO per
channel (NCCL pairs a channel's messages in posting order), the ALLREDUCE
then STEP tail, and the deadlock pass (how far each stream runs, in rounds over columns, which also
records the deadlock-free order the `PlanIndex` keeps). It reads the tables the scan and the transfer rules
built (`plan`, `pp`, `nw`, `workers`, `lengths`, `tail`, `channels`, `transfer_events`, `sent`,
`received`, `consumer`, `order_ranks`, `order_stops`, `comp`, `ns`, `local`) and reports through `fail`
and `where`.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

from schedcomp.check_reformed import segments_passed
from schedcomp.ir import Instruction, Plan, staged_text
from schedcomp.partitions import segments
from schedcomp.topology import Worker

if TYPE_CHECKING:
    from numpy.typing import NDArray

    Tensor = int
    Where = tuple[Worker, int]

_LOW = (1 << 32) - 1  # the index part of a packed place (see `check`)


class OrderRules:
    """Hand-offs, FIFO, tails and deadlock, mixed into `check._Checker` (which provides the tables above)."""

    plan: Plan
    pp: int
    workers: list[Worker]
    event_places: tuple[Any, list[int]]
    tail: list[Any]
    nw: int
    channels: tuple[Any, ...]
    transfer_events: tuple[Any, ...]
    sent: Mapping[int, int]
    received: Mapping[int, int]
    consumer: Mapping[int, int]
    order_ranks: Any
    order_stops: Any
    lengths: list[int]  # the streams' lengths by rank
    by_rank: list[Worker | None]  # the streams' workers by rank, None for failed ones
    comp: Any  # op id -> where it runs, packed as rank << 32 | index, -1 for none (see `check._Checker`)
    ns: int  # virtual stages per pipeline
    local: set[int]  # tensors handed off between two chunks of one worker (filled by `handoffs`)

    def fail(self, worker: Worker | None, index: int | None, problem: str) -> NoReturn:
        raise NotImplementedError

    def where(self, at: int) -> Where:
        raise NotImplementedError

    def placed(self) -> list[tuple[int, int]]:
        raise NotImplementedError

    def handoffs(self) -> None:
        """With virtual stages: find the tensors whose producer and consumer run on the same worker (no
        transfer carries them) and prove the producer runs first, which is all a local hand-off needs."""
        comp, ns, local, streams = self.comp, self.ns, self.local, self.plan.streams
        for cid, at in self.placed():
            k, slot = cid & 3, cid >> 2
            s = slot % ns
            if k == 0 and s < ns - 1:
                to = comp[(slot + 1) * 4]  # the next chunk's F
                tensor, why = slot * 2, "it consumes the activation"
            elif (k == 1 or k == 3) and s > 0:
                to = comp[(slot - 1) * 4 + 1]  # the previous chunk's B, or else its BW
                if to < 0:
                    to = comp[(slot - 1) * 4 + 3]
                tensor, why = slot * 2 + 1, "it consumes the input gradient"
            else:
                continue
            if to < 0 or to >> 32 != at >> 32:
                continue
            if to < at:
                w, i = self.where(at)
                self.fail(*self.where(to), f"runs before {staged_text(streams[w][i])} (instruction {i}) of the "
                                           f"neighbouring chunk: {why} that op hands off here")
            local.add(tensor)

    def fifo(self) -> None:
        """NCCL pairs sends and receives between two ranks in posting order: both ends must agree."""
        send_channels, send_tensors, recv_channels, recv_tensors = self.channels
        # The sound case in a few array operations: every channel receives exactly what it sends, in order
        # (stable sorts by channel keep each side's stream order within a channel).
        by_send, by_recv = np.argsort(send_channels, kind="stable"), np.argsort(recv_channels, kind="stable")
        if (len(by_send) == len(by_recv) and np.array_equal(send_channels[by_send], recv_channels[by_recv])
                and np.array_equal(send_tensors[by_send], recv_tensors[by_recv])):
            return
        out: dict[int, list[int]] = {}  # channel -> tensors in send order
        into: dict[int, list[int]] = {}  # channel -> tensors in receive order
        for table, channels, tensors in ((out, send_channels, send_tensors), (into, recv_channels, recv_tensors)):
            for key, tensor in zip(channels.tolist(), tensors.tolist(), strict=True):
                table.setdefault(key, []).append(tensor)
        topo = self.plan.topology
        nw = topo.dp * topo.pp
        # Compare every channel in one comparison each; only when some disagree, report the first of them
        # in (sender, receiver) order (sorting all channels up front cost more than comparing them).
        bad = [key for key, got in into.items() if got != out[key][: len(got)]]
        for key in sorted(bad):
            got, expected = into[key], out[key]
            x, y = topo.worker_of_rank(key // nw), topo.worker_of_rank(key % nw)
            for n, tensor in enumerate(got):
                if expected[n] != tensor:
                    j = self.received[tensor] & _LOW
                    send = self.plan.streams[x][self.sent[expected[n]] & _LOW]
                    self.fail(y, j, f"is receive #{n} from {x}, but {x}'s send #{n} to {y} is {send}: "
                                    "post receives in the order the peer sends")

    def tails(self) -> None:
        tail, pp, lengths = self.tail, self.pp, self.lengths
        for w in self.workers:
            rank = w.pipeline * pp + w.stage
            n = lengths[rank]
            reduce, step = tail[rank]
            rule = "a stream ends with exactly one ALLREDUCE then one STEP, after all its other instructions"
            if not reduce or not step:
                self.fail(w, n - 1 if n else None, f"no {'ALLREDUCE' if not reduce else 'STEP'}: {rule}")
            if len(reduce) > 1 or len(step) > 1:
                self.fail(w, reduce[1] if len(reduce) > 1 else step[1], f"repeated: {rule}")
            if step[0] < reduce[0]:
                self.fail(w, step[0], f"STEP before ALLREDUCE: {rule}")
            if (reduce[0], step[0]) != (n - 2, n - 1):
                extra = reduce[0] + 1 if step[0] != reduce[0] + 1 else step[0] + 1
                self.fail(w, extra, f"comes after ALLREDUCE: {rule}")

    def event_index(self, r: int, e: int) -> int:
        """The instruction of event `e` of rank `r` (one past the stream's STEP for one past its events)."""
        index, bounds = self.event_places
        at = bounds[r] + e
        if at < bounds[r + 1]:
            return index[at]
        return self.tail[r][0][0] if at == bounds[r + 1] else self.tail[r][1][0] + 1

    def event_indexes(self, ranks: Any, passed: Any) -> Any:
        """`event_index` of each (rank, events passed) pair of two int64 arrays, as one array (a walk of
        half a million steps at pp = 32, dp = 256: one numpy expression, not a call each)."""
        if not len(ranks):
            return array("q")
        index, bounds = self.event_places
        r, e = np.frombuffer(ranks, dtype=np.int64), np.frombuffer(passed, dtype=np.int64)
        starts = np.asarray(bounds, dtype=np.int64)
        at, end = starts[r] + e, starts[r + 1]
        events = np.frombuffer(index, dtype=np.int64) if len(index) else np.zeros(1, np.int64)
        reduce_at = np.array([t[0][0] if t[0] else -1 for t in self.tail], dtype=np.int64)
        after_step = np.array([t[1][0] + 1 if t[1] else -1 for t in self.tail], dtype=np.int64)
        found = np.where(at < end, events[np.minimum(at, len(events) - 1)],
                         np.where(at == end, reduce_at[r], after_step[r]))
        return array("q", found.astype(np.int64).tobytes())

    def deadlock(self) -> None:
        """Whether every stream runs to its end, and a deadlock-free order of it (for the `PlanIndex`).

        A worker passes a compute op once the sends of its inputs are posted (their senders passed those
        SEND instructions), and its ALLREDUCE once its whole stage group reached theirs; sends never wait.
        How far each worker gets is the least fixpoint of those rules, whatever the order of the walk: it is
        found in rounds over all workers at once (numpy columns, not a step per event: two million events at
        pp = 32, dp = 256), each round letting every worker pass its next op if that op's inputs were sent by
        the end of the round before (one op a round: looking further ahead made the rounds dearer than the
        ones it saved). Each round's moves are segments of the order. A worker that does not reach its
        ALLREDUCE waits on a cycle, which `report_cycle` names.
        """
        pp, nw, workers = self.pp, self.nw, self.workers
        ranks = [w.pipeline * pp + w.stage for w in workers]  # in rank order, as `workers`
        rank, index, code, tensor = self.transfer_events
        # Events (a receive's is its consumer's: one per instruction) in stream order: (rank, index) as one key.
        by = np.argsort(rank * (int(index.max(initial=0)) + 1) + index, kind="stable")
        ev_rank, ev_tensor, is_send = rank[by], tensor[by], code[by] == 1
        bounds = np.searchsorted(ev_rank, np.arange(nw + 1))
        self.event_places = (array("q", index[by].astype(np.int64).tobytes()), bounds.tolist())
        ev_pos = np.arange(len(by)) - bounds[ev_rank]  # each event's number in its rank's events
        sender = np.full(len(self.comp) // 2 + 1, -1, np.int64)  # per tensor (two per slot): who sends it, where
        sent_at = np.zeros(len(sender), np.int64)
        sender[ev_tensor[is_send]], sent_at[ev_tensor[is_send]] = ev_rank[is_send], ev_pos[is_send]
        needs = ~is_send
        # Per need, in stream order: where it is (one more, read past a rank's last), who sends its input, where.
        need_pos = np.append(ev_pos[needs], 0)
        need_from, need_after = sender[ev_tensor[needs]], sent_at[ev_tensor[needs]]
        need_bounds = np.searchsorted(ev_rank[needs], np.arange(nw + 1))
        cur, end = need_bounds[:-1].copy(), need_bounds[1:]  # each rank's next need, and one past its last
        reduce_event = bounds[1:] - bounds[:-1]  # each rank's ALLREDUCE: events are its transfers, then it

        def stops(r: NDArray[np.int64]) -> NDArray[np.int64]:
            """Events passed by ranks `r`: up to their next need, or up to their ALLREDUCE."""
            return np.where(cur[r] < end[r], need_pos[cur[r]], reduce_event[r])

        live = np.zeros(nw, bool)
        live[ranks] = True
        everyone = np.flatnonzero(live)
        at = np.zeros(nw, np.int64)
        at[everyone] = stops(everyone)  # sends before the first need wait for nothing
        moves_r, moves_at = [everyone], [at[everyone]]  # (a rank with no transfers is at its ALLREDUCE now: pp = 1)
        active = everyone[cur[everyone] < end[everyone]]
        while len(active):
            k = cur[active]
            x = need_from[k]
            ready = (x >= 0) & (at[np.maximum(x, 0)] > need_after[k])  # its send was passed by the round before
            if not ready.any():
                break  # nobody can move: those left wait on a cycle
            r = active[ready]
            cur[r] += 1
            at[r] = stops(r)
            moves_r.append(r)
            moves_at.append(at[r])
            active = active[cur[active] < end[active]]
        arrived_mask = live & (cur == end)  # at their ALLREDUCE
        stage = np.arange(nw) % pp
        if self.plan.partitions is None:
            complete = np.bincount(stage[arrived_mask], minlength=pp) == np.bincount(stage[live], minlength=pp)
            through = everyone[complete[stage[everyone]]]  # whole stage groups at ALLREDUCE pass it, and STEP
        else:  # per-pipeline partitions: each segment's holders, in the one layer order
            passed = segments_passed(self.plan, {self.by_rank[r] for r in np.flatnonzero(arrived_mask).tolist()})
            through = np.array(sorted(w.pipeline * pp + w.stage for w in passed), np.int64)
        at[through] = reduce_event[through] + 1
        moves_r.append(through)
        moves_at.append(at[through])
        self.order_ranks = array("q", np.concatenate(moves_r).astype(np.int64).tobytes())
        self.order_stops = array("q", np.concatenate(moves_at).astype(np.int64).tobytes())
        if len(through) == len(everyone):
            return
        # A worker that did not pass its ALLREDUCE waits at the instruction of its next event.
        stuck_ranks = everyone[at[everyone] <= reduce_event[everyone]].tolist()
        by_rank, streams = self.by_rank, self.plan.streams
        pos: dict[Worker, int] = {by_rank[r]: self.event_index(r, int(at[r])) for r in stuck_ranks}  # type: ignore[misc]
        waiting = {s: {by_rank[r] for r in np.flatnonzero(arrived_mask & (stage == s)).tolist()} for s in range(pp)}
        inputs: dict[Worker, dict[int, Tensor]] = {w: {} for w in streams}
        for t, where in self.received.items():
            inputs[self.where(where)[0]][self.consumer[t]] = t
        self.report_cycle(set(pos), pos, inputs, waiting)

    def report_cycle(self, stuck: set[Worker], pos: dict[Worker, int], inputs: dict[Worker, dict[int, Tensor]],
                     arrived: dict[int, set[Worker]]) -> NoReturn:
        """Follow 'waits for' from stuck worker to stuck worker until one repeats, and name that cycle."""
        streams = self.plan.streams

        def blocker(w: Worker) -> tuple[Worker, str]:
            i = pos[w]
            tensor = inputs[w].get(i)
            if tensor is not None:
                x, j = self.where(self.sent[tensor])
                return x, f"{x} instruction {j} ({streams[x][j]})"
            if self.plan.partitions is None:
                late = min(v for v in stuck if v.stage == w.stage and v not in arrived[w.stage])
                return late, f"{late} to reach ALLREDUCE"
            # Per-pipeline partitions: a holder of one of its segments that is not at ALLREDUCE. There always is
            # one, for every layer: a stuck op of pipeline d leaves an op of d stuck at every one of its stages
            # (later ones lack its activation, earlier ones its gradient), and the worker running it holds that
            # stage's layers (the span rule), so it is one of their holders, and not at ALLREDUCE.
            at_reduce = set().union(*arrived.values())
            late = min(h for seg in segments(self.plan.partitions, self.plan.topology.failed) if w in seg.holders
                       for h in seg.holders if h in stuck and h not in at_reduce)
            return late, f"{late} to reach ALLREDUCE"

        w, walk = min(stuck), []
        while w not in walk:
            walk.append(w)
            w = blocker(w)[0]
        cycle = walk[walk.index(w) :]
        first = cycle.index(min(cycle))
        cycle = cycle[first:] + cycle[:first]
        steps = [f"{v} instruction {pos[v]} ({streams[v][pos[v]]}) waits for {blocker(v)[1]}" for v in cycle]
        self.fail(cycle[0], pos[cycle[0]],
                  f"deadlock: {'; '.join(steps)}; each of those comes after the next one's wait in its stream: "
                  "reorder the ops")


def text_of(plan: Plan) -> Callable[[Instruction], str]:
    """How errors show the plan's instructions: with their ops' virtual stages when workers hold several chunks."""
    return staged_text if plan.topology.chunks > 1 else str


def error_grid(plan: Plan, worker: Worker | None, index: int | None, rows: int = 6, cols: int = 3) -> str:
    """A step x worker picture of the streams around the bad cell, which is marked >>like this<<."""
    show = text_of(plan)
    workers = sorted(w for w in plan.streams if isinstance(w, Worker))
    if not workers:
        return ""
    at = workers.index(worker) if worker in plan.streams else 0
    shown = workers[max(0, at - cols) : at + cols + 1]
    mid = index if index is not None else 0
    steps = range(max(0, mid - rows), min(max(len(plan.streams[w]) for w in shown), mid + rows + 1))

    def cell(w: Worker, i: int) -> str:
        stream = plan.streams[w]
        text = show(stream[i]) if i < len(stream) else ""
        return f">>{text}<<" if (w == worker and i == index) else text

    table = [[str(i), *(cell(w, i) for w in shown)] for i in steps]
    header = ["step", *(str(w) for w in shown)]
    widths = [max(len(r[c]) for r in [header, *table]) for c in range(len(header))]

    def line(row: list[str]) -> str:
        return " | ".join(text.ljust(width) for text, width in zip(row, widths, strict=True)).rstrip()

    rule = "-" * (sum(widths) + 3 * (len(widths) - 1))
    return "\n".join([line(header), rule, *(line(r) for r in table)])
