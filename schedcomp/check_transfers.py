"""The validator's transfer rules, one column per rule over all sends (or all receives) at once.

`TransferRules` is the part of `check._Checker` that pairs every SEND and RECV (mixed in, like
`check_order.OrderRules`). A 200k-row plan has 1.6M transfers, and a Python loop over them cost ~2 us
each, half the validator; here each rule is one numpy expression over columns read off the scan's
lists with C-level `map`s (ints: packed places `rank << 32 | index`, slots, kind codes), and only a
plan that breaks a rule is walked, to the first transfer (in stream order) that breaks any, whose first
broken rule (in the order listed) is reported: the same transfer and message a loop would give.

Sends, each: (1) its kind may carry its op's kind and the peer's stage exists; (2) it does not go to its
own worker; (3) its producer runs earlier on this worker; (4) its peer runs the consumer (the peer
slot's F); (5) no earlier send carries the same tensor. Receives: (1) as sends; (2) its consumer runs
on this worker; (3) after it; (4) its peer runs the producer; (5) no earlier receive of the same tensor.
The peer rules compare workers by rank where the column scan gives the peers' ranks, else by identity first
(the streams' keys are distinct objects) and by equality where identity does not settle them.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn

import numpy as np

from schedcomp import check_reformed
from schedcomp.ir import Instruction, Plan
from schedcomp.opcolumns import OP_CODES
from schedcomp.planindex import TensorTable
from schedcomp.semantics import SEMANTICS
from schedcomp.topology import Worker

if TYPE_CHECKING:
    from numpy.typing import NDArray

_KIND_ID = {kind: code for code, kind in enumerate(OP_CODES)}  # an op id is `slot * 4 + _KIND_ID[kind]`
_LOW = (1 << 32) - 1
_FIELDS = 3  # ints (objects) per transfer in the scan's flat arrays (lists): see `check._Checker.sends`


class _Codes(dict):  # type: ignore[type-arg]
    """key -> small int, -1 for a key the table does not know (a subscript that `map` can call in C)."""

    def __missing__(self, key: object) -> int:
        return -1


TRANSFER_ROWS = [k for k, sem in SEMANTICS.items() if sem.is_transfer]
"""The transfer kinds, numbered by their place here (`TransferColumns.kind`)."""


class TransferColumns(NamedTuple):
    """One side's transfers (all sends, or all receives) in stream order, as the scan found them: per
    transfer its packed place, slot, its op's stage, its kind (a row of `TRANSFER_ROWS`), its op's kind
    (`_KIND_ID`, -1 for another) and its peer: the object the walk read, or, from the column scan, whose
    peers are live workers by construction, the peer's rank (-1 for none)."""

    here: NDArray[np.int64]
    slot: NDArray[np.int64]
    stage: NDArray[np.int64]
    kind: NDArray[np.int64]
    op_kind: NDArray[np.int64]
    peers: list[Any] | None
    peer_rank: NDArray[np.int64] | None = None


def _scanned(ints: Any, objects: list[Any] | None) -> TransferColumns:
    """The walk's flat tables (`check._Checker.sends`: three ints and three objects per transfer) as columns;
    the column scan (`schedcomp.check_columns`) gives them ready."""
    if isinstance(ints, TransferColumns):
        return ints
    assert objects is not None
    n = len(objects) // _FIELDS
    flat = np.frombuffer(ints, dtype=np.int64) if n else np.zeros(0, np.int64)
    code = {k: c for c, k in enumerate(TRANSFER_ROWS)}  # the scan gave transfer kinds only
    return TransferColumns(flat[0::_FIELDS].copy(), flat[1::_FIELDS].copy(), flat[2::_FIELDS].copy(),
                           np.fromiter(map(code.__getitem__, objects[0::_FIELDS]), np.int64, n),
                           np.fromiter(map(_Codes(_KIND_ID).__getitem__, objects[1::_FIELDS]), np.int64, n),
                           objects[2::_FIELDS])


class _Columns:
    """One side's transfers, with what the rules read of each."""

    def __init__(self, side: TransferColumns, ns: int, comp: NDArray[np.int64], plan: Plan,
                 by_rank: list[Worker | None], checker: Any = None) -> None:
        self.plan, self.by_rank = plan, by_rank  # for messages only
        self.n = len(side.here)
        self.here, self.slot, self.peers, self.peer_rank = side.here, side.slot, side.peers, side.peer_rank
        rows, kcode, opk = TRANSFER_ROWS, side.kind, side.op_kind
        allowed = np.array([[k in SEMANTICS[r].op_kinds for k in _KIND_ID] + [False] for r in rows], dtype=bool)
        self.step = np.array([SEMANTICS[r].peer_stage for r in rows], dtype=np.int64)[kcode]
        if checker is not None and checker.reach is not None:  # re-formed pipelines: neighbours across gaps
            self.step = check_reformed.steps(checker, side.slot, side.stage, self.step)
        self.channel = np.array([SEMANTICS[r].channel for r in rows], dtype=np.int64)[kcode]
        to = side.stage + self.step
        self.kind_ok = allowed[kcode, opk] & (to >= 0) & (to < ns)  # opk -1 reads the last, False, column
        self.opk = opk
        self.rank = self.here >> 32
        self.comp = comp

    def instruction(self, k: int) -> Instruction:
        at = int(self.here[k])
        return self.plan.streams[self.by_rank[at >> 32]][at & _LOW]  # type: ignore[index]

    def kind_rule(self, k: int) -> str:
        """What transfer k's kind requires (the message of the first rule)."""
        return SEMANTICS[self.instruction(k).kind].rule

    def first_of(self, tensors: NDArray[np.int64], k: int) -> int:
        """The instruction index of the first transfer of transfer k's tensor."""
        return int(self.here[np.flatnonzero(tensors == tensors[k])[0]]) & _LOW

    def place(self, op_ids: NDArray[np.int64]) -> NDArray[np.int64]:
        """The packed place of each op id (-1 where no such op runs)."""
        comp = self.comp
        known = (op_ids >= 0) & (op_ids < len(comp))
        return np.where(known, comp[np.where(known, op_ids, 0)], -1) if len(comp) else np.full(self.n, -1)


class TransferRules:
    """Sends and receives, checked and paired (mixed into `check._Checker`, which provides these)."""

    plan: Plan
    pp: int
    ns: int
    nw: int
    comp: Any  # op id -> packed place, -1 for none (an int64 array: see `check._Checker`)
    by_rank: list[Worker | None]
    sends: Any  # array("q"), see `check._Checker`
    send_kinds: list[Any]
    recvs: Any
    recv_kinds: list[Any]
    sent: TensorTable
    received: TensorTable
    consumer: TensorTable
    transfer_events: tuple[Any, ...]
    channels: tuple[Any, ...]
    reach: Any  # per pipeline its neighbour tables, with per-pipeline partitions (`check_reformed`), or None

    def fail(self, worker: Worker | None, index: int | None, problem: str) -> NoReturn:
        raise NotImplementedError

    def comp_array(self) -> NDArray[np.int64]:
        raise NotImplementedError

    def placed(self) -> list[tuple[int, int]]:
        raise NotImplementedError

    def _rank_ids(self) -> NDArray[np.uint64]:
        """`id` of each rank's worker (of None for failed ranks), for identity tests over columns."""
        return np.fromiter(map(id, self.by_rank), np.uint64, len(self.by_rank))

    def _peers_are(self, cols: _Columns, ranks: NDArray[np.int64]) -> NDArray[np.bool_]:
        """Whether each transfer's peer is the worker of rank `ranks` (-1: nobody): by rank where the scan
        knows the peers' ranks, else by identity, then by equality for the few that identity does not settle."""
        known = ranks >= 0
        if cols.peer_rank is not None:
            return known & (cols.peer_rank == ranks)
        assert cols.peers is not None
        ids = self._rank_ids()
        peer_ids = np.fromiter(map(id, cols.peers), np.uint64, cols.n)
        same = known & (ids[np.where(known, ranks, 0)] == peer_ids)
        by_rank, peers = self.by_rank, cols.peers
        for k in np.flatnonzero(known & ~same).tolist():
            same[k] = peers[k] == by_rank[ranks[k]]
        return same

    def _first_bad(self, cols: _Columns, rules: list[tuple[NDArray[np.bool_], Any]]) -> None:
        """Fail at the first transfer that breaks a rule, with its first broken rule's message."""
        ok = np.logical_and.reduce([good for good, _ in rules]) if rules else np.ones(cols.n, bool)
        if ok.all():
            return
        k = int(np.argmin(ok))
        at = int(cols.here[k])
        for good, message in rules:
            if not good[k]:
                self.fail(self.by_rank[at >> 32], at & _LOW, message(k))
        raise AssertionError("a transfer failed no rule")

    @staticmethod
    def _once(tensors: NDArray[np.int64]) -> NDArray[np.bool_]:
        """Whether no earlier item of `tensors` is the same tensor."""
        n = len(tensors)
        # First occurrences: a stable sort groups equal tensors in their order (one test when all differ).
        by = np.argsort(tensors, kind="stable")
        ordered = tensors[by]
        repeat = np.zeros(n, bool)
        repeat[1:] = ordered[1:] == ordered[:-1]
        once = np.ones(n, bool)
        once[by[repeat]] = False
        return once

    def _table(self, keys: NDArray[np.int64], values: NDArray[np.int64]) -> TensorTable:
        """A transfer table of this plan (keys checked distinct and in range by the rules)."""
        return TensorTable(keys, values, self.ns * self.mbs * self.plan.topology.dp * 2)  # type: ignore[attr-defined]

    def transfers(self) -> None:
        """Check every send and receive and pair them up (the tables keep the scan's stream order)."""
        pp, ns, comp = self.pp, self.ns, self.comp_array()
        if ns != pp:
            self.handoffs()  # type: ignore[attr-defined]
        by_rank = self.by_rank
        sends = _Columns(_scanned(self.sends, self.send_kinds), ns, comp, self.plan, by_rank, self)
        self.sends, self.send_kinds = array("q"), []  # (read into columns)
        slot, rank, ins = sends.slot, sends.rank, sends.instruction
        target = sends.place((slot + sends.step) * 4)  # the F of the peer's slot: where it is consumed
        to = np.where(target >= 0, target >> 32, -1)  # the consumer's rank
        to_consumer = self._peers_are(sends, to) & (to != rank)
        own = self._peers_are(sends, rank)
        producer = sends.place(slot * 4 + sends.opk)
        tensor = slot * 2 + sends.channel

        def own_worker(k: int) -> str:
            return ("sends to its own worker: a tensor between two chunks of one worker is handed off locally, drop "
                    "the SEND and its RECV")

        def unproduced(k: int) -> str:
            op = ins(k).op
            return f"sends the output of {op} before (or without) running it here: move it after {op}"

        def elsewhere(k: int) -> str:
            expect = "nobody" if to[k] < 0 else by_rank[int(to[k])]
            return f"goes to {ins(k).peer} but the consumer of {ins(k).op}'s output runs on {expect}"

        def twice(k: int) -> str:
            return f"sends the same tensor twice (first at instruction {sends.first_of(tensor, k)}): keep one"

        self._first_bad(sends, [
            (sends.kind_ok, sends.kind_rule),
            (~own, own_worker),
            ((producer >= 0) & (producer >> 32 == rank) & (producer < sends.here), unproduced),
            (to_consumer, elsewhere),
            (self._once(tensor), twice),
        ])
        self.sent = self._table(tensor, sends.here)  # the pairing `PlanIndex` keeps

        recvs = _Columns(_scanned(self.recvs, self.recv_kinds), ns, comp, self.plan, by_rank, self)
        self.recvs, self.recv_kinds = array("q"), []
        rslot, rrank, rins = recvs.slot, recvs.rank, recvs.instruction
        consumer = recvs.place(rslot * 4 + recvs.opk)
        source = recvs.place((rslot + recvs.step) * 4)
        frm = np.where(source >= 0, source >> 32, -1)  # the producer's rank
        rtensors = (rslot + recvs.step) * 2 + recvs.channel
        used = consumer & _LOW

        def not_here(k: int) -> str:
            return f"receives for {rins(k).op}, which does not run on this worker"

        def late(k: int) -> str:
            return f"posted after its consumer {rins(k).op} (instruction {used[k]}): post it before"

        def not_from(k: int) -> str:
            expect = "nobody" if frm[k] < 0 else by_rank[int(frm[k])]
            return f"receives from {rins(k).peer} but the producer of {rins(k).op}'s input runs on {expect}"

        def rtwice(k: int) -> str:
            return f"receives the same tensor twice (first at instruction {recvs.first_of(rtensors, k)})"

        self._first_bad(recvs, [
            (recvs.kind_ok, recvs.kind_rule),
            ((consumer >= 0) & (consumer >> 32 == rrank), not_here),
            (consumer > recvs.here, late),
            (self._peers_are(recvs, frm), not_from),
            (self._once(rtensors), rtwice),
        ])
        self.received = self._table(rtensors, recvs.here)
        self.consumer = self._table(rtensors, used)
        # What `fifo` and `deadlock` read: each side's channels (sender rank * workers + receiver rank) and
        # tensors in stream order, and the deadlock pass's events ((rank, index, 0 needs / 1 sends, tensor)).
        nw = self.nw
        self.channels = (rank * nw + to, tensor, frm * nw + rrank, rtensors)
        self.transfer_events = (np.concatenate([rank, rrank]), np.concatenate([sends.here & _LOW, used]),
                                np.concatenate([np.ones(sends.n, np.int64), np.zeros(recvs.n, np.int64)]),
                                np.concatenate([tensor, self.channels[3]]))
        self.all_sent()

    def all_sent(self) -> None:
        """Every output that has a neighbouring stage is sent (unless handed off), and received."""
        ns, sent, received, local = self.ns, self.sent, self.received, self.local  # type: ignore[attr-defined]
        # Each send above names a distinct producer that needs one, and `exactly_once` found an F and one
        # B or BW in every slot: so all of them are sent exactly when there are as many sends as slots
        # that have a next stage (F) plus slots that have a previous one (B or BW). Only if not, look for
        # the first one that is not.
        runs = self.plan.cut.total(self.plan.topology.dp, self.plan.microbatches)  # (pipeline, micro-batch) pairs
        reformed = self.reach is not None  # re-formed pipelines: boundaries between held stages only
        links = check_reformed.link_counts(self) if reformed else 2 * runs * (ns - 1)
        if len(sent) != links - len(local):
            for cid, at in self.placed():
                k, slot = cid & 3, cid >> 2
                s = slot % ns
                w, i = self.by_rank[at >> 32], at & _LOW
                up = check_reformed.has_neighbour(self, slot, True) if reformed else s < ns - 1
                down = check_reformed.has_neighbour(self, slot, False) if reformed else s > 0
                if k == 0 and up and slot * 2 not in sent and slot * 2 not in local:
                    self.fail(w, i, "its output is never sent to the next stage: add a SEND_ACT after it")
                if (k == 1 or k == 3) and down and slot * 2 + 1 not in sent and slot * 2 + 1 not in local:
                    self.fail(w, i, "its input gradient is never sent to the previous stage: add a SEND_GRAD after it")
        if not received.has_all(sent.key_array()):  # one array test; the loop names the first unreceived
            for tensor, at in sent.items():
                w, i = self.by_rank[at >> 32], at & _LOW
                if tensor not in received:
                    self.fail(w, i, f"nobody receives it: add the matching receive to {self.plan.streams[w][i].peer}")
