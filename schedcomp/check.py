"""The validator: proves a `Plan` keeps the semantics in docs/design.md, or says where it does not.

`check(plan)` raises `ValidationError(message, worker, index, grid)` at the first rule broken,
in this order: live workers and stages; exactly one F, B and W (or BW) per (pipeline,
micro-batch, stage), on one worker, in dependency order; loads; transfers (each send after its
producer, each receive before its consumer, right peers, matched one to one); FIFO order per
channel; ALLREDUCE then STEP at the end; no deadlock; memory within the limit.

The scan is one pass over the streams into plain dicts keyed by integers (op, slot, tensor and
channel ids: hashing dataclasses dominated the run), and per-worker tables are lists indexed by
rank; the checks that hold for every sound plan (every output sent, every send received, FIFO per
channel) compare counts or whole sets first and only walk item by item to name the first failure.

Virtual stages (`Topology.chunks` > 1): an op's stage is its chunk and must be one its worker holds
(`Topology.place_of`); every rule above holds per virtual stage, slots count `Topology.stages`; a
tensor between two chunks of the same worker is handed off locally: no SEND or RECV (a send to
oneself is refused), and its producer must come first in the stream. ALLREDUCE and STEP stay one
per worker: one gradient reduction over the worker's stage group covers all its chunks (the
workers at one place of each pipeline hold the same chunks, so each chunk's replicas are that group).
The deadlock check is a Kahn pass over the wait-for graph (stream order, send -> consumer, one node
per stage's ALLREDUCE), walked stream by stream over each stream's waits and posts only. A send
counts as posted when its stream reaches the SEND instruction (the runtime posts it there), which is
never earlier than its producer.
"""

from __future__ import annotations

from array import array
from collections import defaultdict
from typing import NoReturn

from schedcomp.check_order import OrderRules, error_grid, text_of
from schedcomp.errors import SchedcompTypeError, ValidationError
from schedcomp.gcpause import paused_gc
from schedcomp.ir import Instruction, OpKind, Plan
from schedcomp.memory import memory_levels, show_memory, stage_deltas, stream_deltas
from schedcomp.planindex import PlanIndex
from schedcomp.semantics import (
    ROLE_ALLREDUCE,
    ROLE_COMPUTE,
    ROLE_LOAD,
    ROLE_RECV,
    ROLE_SEND,
    ROLE_STEP,
    SEMANTICS,
    roles,
    semantics_of,
)
from schedcomp.topology import Worker

Key = tuple[int, int, int]  # (pipeline, microbatch, stage)
Tensor = int  # producing slot * 2 + (0 for an activation, 1 for a gradient): see `_Checker`
Where = tuple[Worker, int]  # (worker, instruction index)

__all__ = ["check", "index_of", "is_checked", "memory_profile", "peak_memory"]

_EPS = 1e-9
_KIND_ID = {OpKind.F: 0, OpKind.B: 1, OpKind.W: 2, OpKind.BW: 3}
_NO_DELTAS: defaultdict[object, float] = defaultdict(float)  # no limit: memory is not tracked
_INF = float("inf")
_LOW = (1 << 32) - 1  # the index part of a packed place


def check(plan: Plan) -> None:
    """Raise `ValidationError` if `plan` breaks a rule the runtime relies on; return None if it is sound.

    A sound plan is marked, so `simulate` and the plan cache do not validate the same object twice
    (plans are immutable by contract: build a new one rather than editing `streams`)."""
    if not isinstance(plan, Plan):
        raise SchedcompTypeError(f"check needs a Plan, got {type(plan).__name__}")
    with paused_gc():  # the indexes are many small acyclic objects: see `schedcomp.gcpause`
        checker = _Checker(plan)
        checker.run()
        index = checker.index()
        # Free the scan's tables while the collector is still paused: alive when it resumes, they
        # would be walked by a collection (seconds on a 200k-row plan) just before they die.
        del checker
    object.__setattr__(plan, _MARK, index)


_MARK = "_schedcomp_index"  # the plan's `PlanIndex`, there once `check` passed


def is_checked(plan: Plan) -> bool:
    """Whether `check(plan)` passed on this very object."""
    return _MARK in plan.__dict__


def index_of(plan: Plan) -> PlanIndex | None:
    """The `PlanIndex` `check` left on this plan, or None (read it through `schedcomp.planindex.plan_index`)."""
    return plan.__dict__.get(_MARK)


def memory_profile(plan: Plan, worker: Worker) -> tuple[float, ...]:
    """Activation memory `worker` holds after each instruction of its stream."""
    return memory_levels(stream_deltas(plan.costs, plan.streams[worker], worker.stage))


def peak_memory(plan: Plan) -> dict[Worker, float]:
    """The most activation memory each worker holds at any point of an iteration."""
    return {w: max((0.0, *memory_profile(plan, w))) for w in plan.workers}


class _Roles(dict):  # type: ignore[type-arg]
    """kind -> role, -1 for a kind the table does not know (a subscript is cheaper than `.get` per instruction)."""

    def __missing__(self, kind: object) -> int:
        return -1


class _Checker(OrderRules):
    """One validation run: the scan's indexes, then one method per rule.

    Ops and tensors are keyed by integers, not by dataclasses (hashing those in Python dominated the
    run): a slot (pipeline d, micro-batch m, stage s) is `(d * M + m) * pp + s`, an op of it
    `slot * 4 + _KIND_ID[kind]`, and a tensor `producing slot * 2 + (0 activation | 1 gradient)`.
    """

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.pp = plan.topology.pp  # workers per pipeline: ranks are pipeline * pp + place
        self.ns = plan.topology.stages  # virtual stages per pipeline: slots count these
        self.mbs = plan.microbatches
        self.local: set[int] = set()  # tensors handed off between two chunks of one worker
        # Per-worker state lives in lists indexed by rank (`Topology.rank`), not in dicts keyed by
        # `Worker`: hashing the dataclass cost more than the rules (a 200k-row CSV has 200k workers).
        self.nw = plan.topology.dp * self.pp
        self.workers: list[Worker] = []  # the streams' workers, in rank order (set by `scan`)
        self.comp: dict[int, Where] = {}  # op id -> where it runs
        self.sends: list[tuple[Worker, int, Instruction, int]] = []  # (worker, index, instruction, slot)
        self.recvs: list[tuple[Worker, int, Instruction, int]] = []
        self.loads: dict[int, Where] = {}  # slot -> its LOAD
        self.tail: list[tuple[list[int], list[int]]] = []  # per rank: indexes of ALLREDUCE and of STEP
        self.over: dict[Worker, tuple[int, float]] = {}  # first index above the memory limit
        # Places are packed ints, rank << 32 | index: dicts of ints are not tracked by the cyclic
        # collector, so the `PlanIndex` that keeps them costs it nothing (tuples of workers cost seconds).
        self.sent: dict[int, int] = {}  # tensor -> its send
        self.received: dict[int, int] = {}  # tensor -> its receive
        self.consumer: dict[int, int] = {}  # tensor -> the index of the op that consumes it, on the receiver
        # Channels (sender rank * workers + receiver rank, ranks as in `Topology.rank`): ints, not pairs.
        self.out: dict[int, list[int]] = {}  # channel -> tensors in send order
        self.into: dict[int, list[int]] = {}  # channel -> tensors in receive order
        # Per rank, what the deadlock pass walks: (index, 0 needs / 1 sends, tensor), or (index, 2, -1)
        # for its ALLREDUCE.
        self.events: list[list[tuple[int, int, int]]] = []
        self.order_ranks = array("q")  # the deadlock pass's walk, in order: which rank advanced ...
        self.order_stops = array("q")  # ... and to which instruction (set from events passed by `index`)
        self.by_rank: list[Worker | None] = []  # the streams' workers by rank, None for failed ones

    def run(self) -> None:
        self.scan()
        self.exactly_once()
        self.loads_present()
        self.transfers()
        self.fifo()
        self.tails()
        self.deadlock()
        self.memory()

    def index(self) -> PlanIndex:
        """What this run learnt, for the plan's other consumers (after `run` passed)."""
        events, tail, stops = self.events, self.tail, self.order_stops
        for n, r in enumerate(self.order_ranks):  # events passed -> the instruction the worker stopped at
            ev, e = events[r], stops[n]
            # Past its last event a worker runs to its end: one past its STEP, the last instruction (`tails`).
            stops[n] = ev[e][0] if e < len(ev) else tail[r][1][0] + 1
        streams, by_rank = self.plan.streams, self.by_rank
        return PlanIndex(self.pp, self.mbs, tuple(by_rank), self.sent, self.received, self.consumer,
                         self.order_ranks, stops, streams, self.plan.costs, self.ns)

    def where(self, at: int) -> Where:
        """A packed place (rank << 32 | index) as (worker, index)."""
        return self.by_rank[at >> 32], at & _LOW  # type: ignore[return-value]

    def unknown(self, worker: Worker, index: int, kind: object) -> NoReturn:
        self.fail(worker, index, f"unknown instruction kind {kind!r}: every kind needs a row in schedcomp.semantics")

    def fail(self, worker: Worker | None, index: int | None, problem: str) -> NoReturn:
        where = "" if worker is None else f"worker {worker}"
        if worker is not None and index is not None and worker in self.plan.streams:
            stream = self.plan.streams[worker]
            where += f", instruction {index} ({text_of(self.plan)(stream[index])})" if index < len(stream) \
                else f", instruction {index}"
        message = f"{where}: {problem}" if where else problem
        raise ValidationError(message, worker, index, error_grid(self.plan, worker, index))

    def key_of(self, slot: int) -> Key:
        rest, s = divmod(slot, self.ns)
        d, m = divmod(rest, self.mbs)
        return (d, m, s)

    # ---- the scan -----------------------------------------------------------------------

    def scan(self) -> None:
        plan, topo = self.plan, self.plan.topology
        dp, mbs, pp, ns = topo.dp, plan.microbatches, self.pp, self.ns
        failed = topo.failed
        chunked = ns != pp
        place = [topo.place_of(s) for s in range(ns)] if chunked else []
        if chunked and isinstance(plan.costs.memory_limit, tuple):
            self.fail(None, None, "a memory limit per stage is not defined with virtual stages yet: give one number "
                                  "for every worker, or none")
        for w in plan.streams:
            live = (isinstance(w, Worker) and type(w.pipeline) is int and type(w.stage) is int  # ranks index lists
                    and 0 <= w.pipeline < dp and 0 <= w.stage < pp and not (failed and w in failed))
            if not live:
                who = w if isinstance(w, Worker) else None
                self.fail(who, None, f"stream for {w}, which is not a live worker of the topology: drop it")
        if len(plan.streams) != dp * pp - len(failed):  # distinct live workers: as many as live ones, or one lacks
            for w in topo.live_workers:
                if w not in plan.streams:
                    self.fail(w, None, "live worker has no stream: give it one (at least ALLREDUCE then STEP)")
        self.workers = sorted(plan.streams)
        self.by_rank = [None] * self.nw
        for w in self.workers:
            self.by_rank[w.pipeline * pp + w.stage] = w
        self.tail = [([], [])] * self.nw  # placeholders for failed ranks; live ones get their own below
        comp, loads, sends, recvs, kid = self.comp, self.loads, self.sends, self.recvs, _KIND_ID
        tops = [lim + _EPS * max(1.0, lim) for lim in plan.costs.stage_limits]  # one number if chunked
        role_of = _Roles(roles())  # every kind's role, read off the semantics table once per run
        for w in self.workers:
            ws = w.stage
            top = tops[ws]
            limited = top != _INF  # memory is tracked only under a limit
            deltas, held = (stage_deltas(plan.costs, ws) if limited else _NO_DELTAS), 0.0
            # With virtual stages each chunk has its own activation size: its deltas, by its stage.
            chunk_deltas = {s: stage_deltas(plan.costs, s) for s in topo.chunks_of(ws)} if chunked else {}
            reduce: list[int] = []
            step: list[int] = []
            self.tail[w.pipeline * pp + ws] = (reduce, step)
            for i, ins in enumerate(plan.streams[w]):
                op, kind = ins.op, ins.kind
                role = role_of[kind]
                if op is None:
                    if role == ROLE_ALLREDUCE:
                        reduce.append(i)
                    elif role == ROLE_STEP:
                        step.append(i)
                    elif role < 0:
                        self.unknown(w, i, kind)
                    continue
                d, m, os = op.pipeline, op.microbatch, op.stage
                if os != ws and not (chunked and type(os) is int and 0 <= os < ns and place[os] == ws):
                    held_here = ", ".join(map(str, topo.chunks_of(ws))) if chunked else str(ws)
                    self.fail(w, i, f"names stage {os} but {w} runs stage{'s' if chunked else ''} {held_here}")
                if not (0 <= d < dp and 0 <= m < mbs):
                    self.fail(w, i, f"no such micro-batch: pipelines are 0..{dp - 1}, micro-batches 0..{mbs - 1}")
                slot = (d * mbs + m) * ns + os
                if role == ROLE_SEND:
                    sends.append((w, i, ins, slot))
                elif role == ROLE_RECV:
                    recvs.append((w, i, ins, slot))
                elif role == ROLE_COMPUTE:
                    here = (w, i)
                    first = comp.setdefault(slot * 4 + kid[op.kind], here)  # one lookup: the op's first place
                    if first is not here:
                        self.fail(w, i, f"{op} runs twice (first on {first[0]} at instruction {first[1]}): keep one")
                    if limited:
                        held += chunk_deltas[os][kind] if chunked else deltas[kind]
                        if held > top and w not in self.over:
                            self.over[w] = (i, held)
                elif role == ROLE_LOAD:
                    if op.kind is not OpKind.F or 0 < os < ns - 1:
                        self.fail(w, i, f"{semantics_of(kind).rule}: drop it")
                    if slot in loads:
                        self.fail(w, i, f"{op} is loaded twice (first at instruction {loads[slot][1]})")
                    loads[slot] = (w, i)
                elif role < 0:
                    self.unknown(w, i, kind)

    # ---- exactly once, same worker, dependency order --------------------------------------

    def exactly_once(self) -> None:
        get, streams = self.comp.get, self.plan.streams
        for slot in range(self.plan.topology.dp * self.mbs * self.ns):  # in (pipeline, micro-batch, stage) order
            base = slot * 4
            f, b, w, bw = get(base), get(base + 1), get(base + 2), get(base + 3)
            if f is not None and bw is None and b is not None and w is not None:
                # The common, sound case, checked without building messages.
                fw = f[0]
                if (b[0] is fw or b[0] == fw) and (w[0] is fw or w[0] == fw) and f[1] < b[1] < w[1]:
                    continue
            elif (f is not None and bw is not None and b is None and w is None
                  and (bw[0] is f[0] or bw[0] == f[0]) and f[1] < bw[1]):
                continue
            key = self.key_of(slot)
            d, m, s = key
            name = f"micro-batch {m} of pipeline {d} at stage {s}"
            if f is None:
                self.missing(key, f"no F for {name}: every (pipeline, micro-batch, stage) needs exactly one F")
            if bw is not None and (b is not None or w is not None):
                later = max(x for x in (b, w, bw) if x is not None)
                self.fail(*later, f"{name} has both BW and split B/W: use one or the other")
            if bw is None and (b is None or w is None):
                lack, after = ("B", f) if b is None else ("W", b)
                self.fail(*after, f"no {lack} (nor BW) for {name}: add it after this op, on this worker")
            for other in (b, w, bw):
                if other is not None and other[0] != f[0]:
                    self.fail(*other, f"runs on {other[0]} but its F runs on {f[0]}: activations are local")
            for first, then, why in ((f, b, "a B needs its F's activations"),
                                     (b, w, "a W needs the gradient its B computes"),
                                     (f, bw, "a BW needs its F's activations")):
                if first is not None and then is not None and then[1] < first[1]:
                    before = streams[first[0]][first[1]]
                    self.fail(*then, f"runs before {before} (instruction {first[1]}): {why}")

    def missing(self, key: Key, problem: str) -> NoReturn:
        """Fail for a missing op: at the first instruction naming its slot, on the worker that has one."""
        topo = self.plan.topology
        for w in [*sorted(self.plan.streams), None]:
            if w is None:
                home = Worker(key[0], topo.place_of(key[2]))
                self.fail(home if topo.is_live(home) else None, None, problem)
            for i, ins in enumerate(self.plan.streams[w]):
                if ins.op is not None and ins.op.key == key:
                    self.fail(w, i, problem)

    def loads_present(self) -> None:
        ns, loads, comp = self.ns, self.loads, self.comp
        for cid, (w, i) in comp.items():
            if cid & 3 == 0:  # an F
                slot = cid >> 2
                s = slot % ns
                if s == 0 or s == ns - 1:
                    load = loads.get(slot)
                    if load is None or (load[0] is not w and load[0] != w) or load[1] > i:
                        ins = self.plan.streams[w][i]
                        self.fail(w, i, f"needs LOAD[{ins}] earlier in this stream (inputs/targets)")
        for slot, (w, i) in loads.items():
            if slot * 4 not in comp:
                self.fail(w, i, "loads a micro-batch no forward here uses: drop it")

    # ---- transfers --------------------------------------------------------------------------

    def transfers(self) -> None:
        """Check every send and receive and pair them up (dicts keep the scan's stream order)."""
        pp, ns, comp, kid = self.pp, self.ns, self.comp, _KIND_ID
        if ns != pp:
            self.handoffs()
        sent, received, consumed, out, into = self.sent, self.received, self.consumer, self.out, self.into
        # Per kind, the row's fields this pass reads: one dict lookup per transfer, not one per field.
        rows = {k: (sem.op_kinds, sem.peer_stage, sem.channel) for k, sem in SEMANTICS.items() if sem.is_transfer}
        nw = self.plan.topology.dp * pp
        events = self.events = [[] for _ in range(nw)]
        ev_of: Worker | None = None  # the scan grouped sends and receives by worker: look up once per group
        ev: list[tuple[int, int, int]] = []
        rank = -1
        for w, i, ins, slot in self.sends:
            if w is not ev_of:
                ev_of, rank = w, w.pipeline * pp + w.stage
                ev = events[rank]
            op, peer = ins.op, ins.peer
            opk = op.kind
            op_kinds, step, channel = rows[ins.kind]
            if opk not in op_kinds or not 0 <= op.stage + step < ns:
                self.fail(w, i, SEMANTICS[ins.kind].rule)
            target = comp.get((slot + step) * 4)  # the F of the peer's slot: where it is consumed
            # Stream keys are distinct workers: a peer that is its consumer's key but not `w` differs from `w`,
            # which settles both peer rules in the common case without `Worker.__eq__` (a Python call).
            to_consumer = target is not None and target[0] is peer and peer is not w
            if not to_consumer and (peer is w or peer == w):
                self.fail(w, i, "sends to its own worker: a tensor between two chunks of one worker is handed off "
                                "locally, drop the SEND and its RECV")
            producer = comp.get(slot * 4 + kid[opk])
            if producer is None or (producer[0] is not w and producer[0] != w) or producer[1] > i:
                self.fail(w, i, f"sends the output of {op} before (or without) running it here: move it after {op}")
            if not to_consumer and (target is None or target[0] != peer):
                expect = "nobody" if target is None else target[0]
                self.fail(w, i, f"goes to {peer} but the consumer of {op}'s output runs on {expect}")
            tensor, here = slot * 2 + channel, rank << 32 | i
            first = sent.setdefault(tensor, here)  # one lookup: where the tensor is first sent
            if first != here:
                self.fail(w, i, f"sends the same tensor twice (first at instruction {first & _LOW}): keep one")
            key = rank * nw + peer.pipeline * pp + peer.stage  # peer is a live worker
            queue = out.get(key)
            if queue is None:
                out[key] = [tensor]
            else:
                queue.append(tensor)
            ev.append((i, 1, tensor))
        ev_of = None
        for w, j, ins, slot in self.recvs:
            if w is not ev_of:
                ev_of, rank = w, w.pipeline * pp + w.stage
                ev = events[rank]
            op, peer = ins.op, ins.peer
            opk = op.kind
            op_kinds, step, channel = rows[ins.kind]
            if opk not in op_kinds or not 0 <= op.stage + step < ns:
                self.fail(w, j, SEMANTICS[ins.kind].rule)
            consumer = comp.get(slot * 4 + kid[opk])
            if consumer is None or (consumer[0] is not w and consumer[0] != w):
                self.fail(w, j, f"receives for {op}, which does not run on this worker")
            if consumer[1] < j:
                self.fail(w, j, f"posted after its consumer {op} (instruction {consumer[1]}): post it before")
            source = comp.get((slot + step) * 4)
            if source is None or (source[0] is not peer and source[0] != peer):
                expect = "nobody" if source is None else source[0]
                self.fail(w, j, f"receives from {peer} but the producer of {op}'s input runs on {expect}")
            tensor, here = (slot + step) * 2 + channel, rank << 32 | j
            first = received.setdefault(tensor, here)
            if first != here:
                self.fail(w, j, f"receives the same tensor twice (first at instruction {first & _LOW})")
            consumed[tensor] = consumer[1]
            key = (peer.pipeline * pp + peer.stage) * nw + rank
            queue = into.get(key)
            if queue is None:
                into[key] = [tensor]
            else:
                queue.append(tensor)
            ev.append((consumer[1], 0, tensor))
        # Each send above names a distinct producer that needs one, and `exactly_once` found an F and one
        # B or BW in every slot: so all of them are sent exactly when there are as many sends as slots
        # that have a next stage (F) plus slots that have a previous one (B or BW). Only if not, look for
        # the first one that is not.
        local = self.local
        if len(sent) != 2 * self.plan.topology.dp * self.mbs * (ns - 1) - len(local):
            for cid, (w, i) in comp.items():
                k, slot = cid & 3, cid >> 2
                s = slot % ns
                if k == 0 and s < ns - 1 and slot * 2 not in sent and slot * 2 not in local:
                    self.fail(w, i, "its output is never sent to the next stage: add a SEND_ACT after it")
                if (k == 1 or k == 3) and s > 0 and slot * 2 + 1 not in sent and slot * 2 + 1 not in local:
                    self.fail(w, i, "its input gradient is never sent to the previous stage: add a SEND_GRAD after it")
        if not received.keys() >= sent.keys():  # a set comparison in C; the loop names the first unreceived
            for tensor, at in sent.items():
                w, i = self.where(at)
                if tensor not in received:
                    self.fail(w, i, f"nobody receives it: add the matching receive to {self.plan.streams[w][i].peer}")

    def memory(self) -> None:
        costs = self.plan.costs
        for w, (i, held) in sorted(self.over.items()):
            peak = max(memory_profile(self.plan, w))
            where = f" (stage {w.stage}'s)" if isinstance(costs.memory_limit, tuple) else ""
            self.fail(w, i, f"holds {show_memory(held, costs)}, above memory_limit{where} "
                            f"{show_memory(costs.limit_at(w.stage), costs, unit=False)}: raise the limit "
                            f"to {show_memory(peak, costs, unit=False)} or use a schedule that holds fewer "
                            "micro-batches")
