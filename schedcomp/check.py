"""The validator: proves a `Plan` keeps the semantics in docs/design.md, or says where it does not.

`check(plan)` raises `ValidationError(message, worker, index, grid)` at the first rule broken,
in this order: live workers and stages; exactly one F, B and W (or BW) per (pipeline,
micro-batch, stage), on one worker, in dependency order; loads; transfers (each send after its
producer, each receive before its consumer, right peers, matched one to one); FIFO order per
channel; ALLREDUCE then STEP at the end; no deadlock; memory within the limit.

The scan reads every instruction into tables keyed by integers (op, slot, tensor and channel ids: hashing
dataclasses dominated the run; places packed as `rank << 32 | index`): for a plan `lower` made, as array
tests over the columns its streams are made from (`schedcomp.check_columns`), which leave a plan that breaks
one of the scan's rules (or ends its streams otherwise) to the walk, instruction by instruction, which names
the first problem (`schedcomp.check_walk`). Per-worker tables are lists indexed by rank; the transfer rules
are numpy expressions over columns of all sends and all receives (`schedcomp.check_transfers`); the checks
that hold for every sound plan
(every output sent, every send received, FIFO per channel) compare counts or whole sequences first and
only walk item by item to name the first failure.

Virtual stages (`Topology.chunks` > 1): an op's stage is its chunk and must be one its worker holds
(`Topology.place_of`); every rule above holds per virtual stage, slots count `Topology.stages`; a
tensor between two chunks of the same worker is handed off locally: no SEND or RECV (a send to
oneself is refused), and its producer must come first in the stream. ALLREDUCE and STEP stay one
per worker: one gradient reduction over the worker's stage group covers all its chunks (the
workers at one place of each pipeline hold the same chunks, so each chunk's replicas are that group).
The deadlock check finds how far each stream runs (stream order, send -> consumer, each stage's
ALLREDUCE waits for its group) in rounds over columns of each stream's waits and posts only. A send
counts as posted when its stream reaches the SEND instruction (the runtime posts it there), which is
never earlier than its producer.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

from schedcomp import check_reformed, limits
from schedcomp.check_columns import scan_columns
from schedcomp.check_order import OrderRules, error_grid, text_of
from schedcomp.check_reformed import reformed_rules
from schedcomp.check_transfers import TransferRules
from schedcomp.check_walk import walk
from schedcomp.cut import Cut
from schedcomp.errors import PlanFormatError, SchedcompTypeError, ValidationError
from schedcomp.gcpause import paused_gc
from schedcomp.ir import Plan
from schedcomp.memory import memory_levels, show_memory, stream_deltas
from schedcomp.partition import as_partition
from schedcomp.partitions import Reach
from schedcomp.planindex import PlanIndex, TensorTable
from schedcomp.streamcolumns import columns_of
from schedcomp.topology import Worker

if TYPE_CHECKING:
    from numpy.typing import NDArray

Key = tuple[int, int, int]  # (pipeline, microbatch, stage)
Tensor = int  # producing slot * 2 + (0 for an activation, 1 for a gradient): see `_Checker`
Where = tuple[Worker, int]  # (worker, instruction index)

__all__ = ["check", "index_of", "is_checked", "memory_profile", "peak_memory"]

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
    return memory_levels(stream_deltas(plan.costs_of(worker.pipeline), plan.streams[worker], worker.stage, plan.cut))


def peak_memory(plan: Plan) -> dict[Worker, float]:
    """The most activation memory each worker holds at any point of an iteration."""
    return {w: max((0.0, *memory_profile(plan, w))) for w in plan.workers}


class _Checker(TransferRules, OrderRules):
    """One validation run: the scan's indexes, then one method per rule.

    Ops and tensors are keyed by integers, not by dataclasses (hashing those in Python dominated the
    run): a slot (pipeline d, micro-batch m, stage s) is `(d * M + m) * pp + s`, an op of it
    `slot * 4 + code` (`opcolumns.OP_CODES`), and a tensor `producing slot * 2 + (0 activation | 1 gradient)`.
    """

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.pp = plan.topology.pp  # workers per pipeline: ranks are pipeline * pp + place
        self.ns = plan.topology.stages  # virtual stages per pipeline: slots count these
        self.mbs = plan.cut.width(plan.microbatches)  # slot ids' stride (a re-cut pipeline may run more than M)
        self.local: set[int] = set()  # tensors handed off between two chunks of one worker
        # Per-worker state lives in lists indexed by rank (`Topology.rank`), not in dicts keyed by
        # `Worker`: hashing the dataclass cost more than the rules (a 200k-row CSV has 200k workers).
        self.nw = plan.topology.dp * self.pp
        self.workers: list[Worker] = []  # the streams' workers, in rank order (set by `scan`)
        # Places are packed ints, rank << 32 | index: dicts of ints are not tracked by the cyclic
        # collector, so the `PlanIndex` that keeps them costs it nothing (tuples of workers cost seconds),
        # and two places of one rank compare as their indexes.
        # Op id -> where it runs, -1 where no op runs: one int64 per possible op id (the validator walks every
        # slot anyway), so the transfer rules look places up as one numpy index, not a dict lookup each.
        self.comp = array("q")
        # Per send (receive), three ints in a row, packed place, slot and its op's stage (typed: no int objects,
        # 2 million transfers at pp = 32, dp = 256), and three objects in a row: kind, its op's kind, peer.
        self.sends, self.send_kinds = array("q"), []
        self.recvs, self.recv_kinds = array("q"), []
        self.loads: dict[int, int] = {}  # slot -> its LOAD, packed
        self.tail: list[tuple[list[int], list[int]]] = []  # per rank: indexes of ALLREDUCE and of STEP
        self.over: dict[Worker, tuple[int, float]] = {}  # first index above the memory limit
        # Set by `transfers`: tensor -> its send, its receive, and the index of the op that consumes it on the receiver.
        self.sent = self.received = self.consumer = TensorTable(np.zeros(0, np.int64), np.zeros(0, np.int64), 0)
        # Set by `transfers`, as columns: per send and per receive its channel (sender rank * workers +
        # receiver rank, ranks as in `Topology.rank`) and tensor; per transfer (rank, index, 0 needs / 1
        # sends, tensor), what the deadlock pass walks.
        self.channels: tuple[Any, ...] = ()
        self.transfer_events: tuple[Any, ...] = ()
        # Per transfer event in stream order, its instruction's index, and where each rank's events start (set by
        # `deadlock`; an event is a send, or a compute op that needs a received input).
        self.event_places: tuple[list[int], list[int]] = ([], [])
        self.order_ranks = array("q")  # the deadlock pass's walk, in order: which rank advanced ...
        self.order_stops = array("q")  # ... and to which instruction (set from events passed by `index`)
        self.by_rank: list[Worker | None] = []  # the streams' workers by rank, None for failed ones
        self.lengths: list[int] = []  # the streams' lengths by rank, 0 for failed ones
        self.reach: Reach | None = None  # per pipeline its neighbour tables, with per-pipeline partitions

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
        stops = self.event_indexes(self.order_ranks, self.order_stops)  # events passed -> where it stopped
        streams, by_rank = self.plan.streams, self.by_rank
        return PlanIndex(self.pp, self.mbs, tuple(by_rank), self.sent, self.received, self.consumer,
                         self.order_ranks, stops, streams, self.plan.costs, self.ns, self.plan.cut, self.reach,
                         dict(self.plan.pipeline_costs))

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
        dp, mbs, pp, ns = topo.dp, self.mbs, self.pp, self.ns
        failed = topo.failed
        chunked = ns != pp
        if chunked and isinstance(plan.costs.memory_limit, tuple):
            self.fail(None, None, "a memory limit per stage is not defined with virtual stages yet: give one number "
                                  "for every worker, or none")
        if not isinstance(plan.cut, Cut):
            self.fail(None, None, f"plan.cut must be a schedcomp.cut.Cut, got {type(plan.cut).__name__}")
        if plan.cut.shares and plan.partitions is None:
            self.fail(None, None, "a cut with shares other than M (re-balanced pipelines) needs per-pipeline "
                                  "partitions (plan.partitions): only re-formed pipelines re-balance the batch")
        if plan.cut and not plan.cut.shares and plan.partitions is not None:
            self.fail(None, None, "with per-pipeline partitions a cut gives each pipeline's share (Cut.of(..., "
                                  "shares=True)), as the plan's JSON reads it")
        cut_problem = plan.cut.problem(dp, plan.microbatches)  # its pieces cover each pipeline's share once
        if cut_problem:
            self.fail(None, None, cut_problem)
        if plan.partition is not None:  # layers per stage: one positive count per (virtual) stage
            try:
                as_partition(plan.partition, ns, "plan.partition")
            except PlanFormatError as exc:
                self.fail(None, None, str(exc))
        if plan.partitions is not None or plan.pipeline_costs:
            self.reach = reformed_rules(self)
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
        # Workers by rank: rank order is the workers' sorted order, and sorting would compare `Worker`s (a
        # Python call each, 200k of them). (Keys only: a lowered plan's streams are made when read.)
        by_rank: list[Worker | None] = [None] * self.nw
        for w in plan.streams:
            by_rank[w.pipeline * pp + w.stage] = w
        self.by_rank = by_rank
        self.workers = [w for w in by_rank if w is not None]
        self.tail = [([], [])] * self.nw  # placeholders for failed ranks; live ones get their own below
        limits.check_job(ns, dp, mbs)  # before the table sized by the job's slots (a LimitError otherwise)
        columns = columns_of(plan.streams)
        # A lowered plan's columns settle the sound case; re-formed pipelines take the walk, whose rules know
        # their gaps and per-pipeline costs.
        if columns is None or self.reach is not None or not scan_columns(self, columns):
            walk(self)

    # ---- exactly once, same worker, dependency order --------------------------------------

    def exactly_once(self) -> None:
        # Per slot (in (pipeline, micro-batch, stage) order) the places of its F, B, W and BW, and the two
        # sound cases as array expressions: packed places of one rank compare as their indexes, so
        # `f < b < w` on one rank is "same worker, in this order".
        f, b, w, bw = self.comp_array().reshape(-1, 4).T
        split = (f >= 0) & (b >= 0) & (w >= 0) & (bw < 0) & (f >> 32 == w >> 32) & (f < b) & (b < w)
        fused = (f >= 0) & (bw >= 0) & (b < 0) & (w < 0) & (f >> 32 == bw >> 32) & (f < bw)
        sound = split | fused
        if self.plan.cut:  # slots past a re-cut pipeline's count are absent: nothing runs them (`scan` proved it)
            topo, ns, mbs = self.plan.topology, self.ns, self.mbs
            counts = np.array([self.plan.cut.count(d, self.plan.microbatches) for d in range(topo.dp)])
            sound |= np.repeat((np.arange(topo.dp * mbs) % mbs) >= np.repeat(counts, mbs), ns)
        if self.reach is not None:  # re-formed pipelines: no op at a gap, every op where its layers are
            sound |= check_reformed.gap_and_span_failure(self, f, b, w, bw)
        if not sound.all():
            slot = int(np.argmin(sound))
            self.slot_failure(slot, *(None if at < 0 else at for at in (f[slot], b[slot], w[slot], bw[slot])))

    def comp_array(self) -> NDArray[np.int64]:
        """`comp` as a numpy array (a view, no copy)."""
        return np.frombuffer(self.comp, dtype=np.int64) if len(self.comp) else np.zeros(0, np.int64)

    def placed(self) -> list[tuple[int, int]]:
        """(op id, packed place) of every op that runs, in the scan's order (by place)."""
        places = self.comp_array()
        ids = np.flatnonzero(places >= 0)
        ids = ids[np.argsort(places[ids], kind="stable")]
        return list(zip(ids.tolist(), places[ids].tolist(), strict=True))

    def slot_failure(self, slot: int, *places: int | None) -> None:
        """Name what is wrong with a slot whose F, B, W and BW (packed places, or None) are not
        sound (every such slot breaks one of these rules)."""
        streams = self.plan.streams
        f, b, w, bw = (None if at is None else self.where(int(at)) for at in places)
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
        # The F of every slot at the first or last stage, visited in stream order (packed places sort so).
        slots = self.plan.topology.dp * self.mbs * ns
        ends = {*range(0, slots, ns), *range(ns - 1, slots, ns)} if self.reach is None else \
            check_reformed.edge_slots(self)  # a re-formed pipeline's first and last held stages
        edge = [(at, slot) for slot in ends if (at := comp[slot * 4]) >= 0]
        for at, slot in sorted(edge):
            load = loads.get(slot)
            if load is None or load >> 32 != at >> 32 or load > at:
                w, i = self.where(at)
                self.fail(w, i, f"needs LOAD[{self.plan.streams[w][i]}] earlier in this stream (inputs/targets)")
        for slot, at in loads.items():
            if comp[slot * 4] < 0:
                self.fail(*self.where(at), "loads a micro-batch no forward here uses: drop it")

    def memory(self) -> None:
        for w, (i, held) in sorted(self.over.items()):
            costs = self.plan.costs_of(w.pipeline)
            peak = max(memory_profile(self.plan, w))
            where = f" (stage {w.stage}'s)" if isinstance(costs.memory_limit, tuple) else ""
            self.fail(w, i, f"holds {show_memory(held, costs)}, above memory_limit{where} "
                            f"{show_memory(costs.limit_at(w.stage), costs, unit=False)}: raise the limit "
                            f"to {show_memory(peak, costs, unit=False)} or use a schedule that holds fewer "
                            "micro-batches")
