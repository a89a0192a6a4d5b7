"""What `check` learns about a plan, kept for every consumer: `plan_index(plan)`.

The validator already pairs every send with its receive, finds each received tensor's consumer,
groups transfers by channel and walks the streams in a deadlock-free order; the `PlanIndex` keeps
those tables (built once, by `check`, and cached on the plan) so that the simulator, the runtime's
message tags, lossy recovery's residuals, profiles and traces read them instead of re-deriving them.

A transfer is named by the tensor it carries: the slot (pipeline d, micro-batch m, stage s) of the op
that produces it and its channel (ACT forward, GRAD backward). `transfer_key(ins)` reads that off a
SEND or RECV alone (no plan needed); its integer id in a plan is
`((d * microbatches + m) * stages + s) * 2 + channel`, unique among the plan's transfers of an iteration
(`stages` is `pp` times the chunks each worker holds; a hand-off between two chunks of one worker is
no transfer at all).
"""

from __future__ import annotations

import operator
from array import array
from collections.abc import ItemsView, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from schedcomp.costs import CostModel
from schedcomp.cut import NO_CUT, Cut
from schedcomp.ir import Instruction, Plan
from schedcomp.memory import memory_levels, stream_deltas
from schedcomp.partitions import Reach, neighbours
from schedcomp.semantics import RECV, SEND, semantics_of
from schedcomp.topology import Worker

__all__ = ["PlanIndex", "TensorTable", "plan_index", "transfer_key"]

Where = tuple[Worker, int]  # (worker, instruction index)
TransferKey = tuple[int, int, int, int]  # (pipeline, micro-batch, producing stage, channel)


def transfer_key(ins: Instruction, reach: Reach | None = None) -> TransferKey:
    """The tensor a SEND or RECV carries, the same on both ends (see the module docstring). `reach`: with
    re-formed pipelines, each pipeline's neighbours across its gaps (`schedcomp.partitions.reach`)."""
    sem = semantics_of(ins.kind)
    op = ins.op
    if sem.direction not in (SEND, RECV) or op is None:
        raise ValueError(f"{ins} is not a transfer")
    stage = op.stage if sem.direction == SEND else op.stage + sem.peer_stage  # a receive names its consumer
    if reach is not None and sem.direction == RECV:  # its producer is the held neighbour, over any gap
        stage = neighbours(reach, op.pipeline, op.stage)[0 if sem.peer_stage > 0 else 1]
    return (op.pipeline, op.microbatch, stage, sem.channel)


def _as_id(key: object) -> int | None:
    """`key` as a transfer id where a dict of int keys would match it (1, True, np.int64(1), 1.0), else None."""
    if type(key) is int:
        return key
    if isinstance(key, float):
        return int(key) if key.is_integer() else None
    try:
        return operator.index(key)  # type: ignore[arg-type]
    except TypeError:
        return None


class TensorTable(Mapping[int, int]):
    """A read-only map of transfer ids to ints (packed places, indexes), in the order it was built, over typed
    arrays: a plan of pp = 32, dp = 256 has a million transfers, which as three dicts of Python ints took 300 MB
    of `check`'s peak memory and as arrays take 24 MB each. Lookups index arrays, iteration yields plain ints."""

    __slots__ = ("_keys", "_pos", "_values")

    def __init__(self, keys: Any, values: Any, size: int) -> None:
        """`keys` (distinct transfer ids in 0..size-1) and their `values`, both int64 columns of one length."""
        self._keys = array("q", np.ascontiguousarray(keys, dtype=np.int64).tobytes())
        self._values = array("q", np.ascontiguousarray(values, dtype=np.int64).tobytes())
        pos = np.full(size, -1, dtype=np.int64)
        pos[np.frombuffer(self._keys, dtype=np.int64)] = np.arange(len(self._keys))
        self._pos = array("q", pos.tobytes())

    def __getitem__(self, key: int) -> int:
        pos = self._pos
        key = _as_id(key)
        if key is not None and 0 <= key < len(pos):
            at = pos[key]
            if at >= 0:
                return self._values[at]
        raise KeyError(key)

    def __contains__(self, key: object) -> bool:
        pos = self._pos
        key = _as_id(key)
        return key is not None and 0 <= key < len(pos) and pos[key] >= 0

    def __iter__(self) -> Iterator[int]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def items(self) -> ItemsView[int, int]:
        return _Items(self)

    def key_array(self) -> np.ndarray:
        """The keys as an int64 column (a view, in the table's order)."""
        return np.frombuffer(self._keys, dtype=np.int64) if len(self._keys) else np.zeros(0, np.int64)

    def has_all(self, keys: np.ndarray) -> bool:
        """Whether every id of `keys` (an int64 column) is a key here."""
        pos = np.frombuffer(self._pos, dtype=np.int64) if len(self._pos) else np.zeros(0, np.int64)
        inside = (keys >= 0) & (keys < len(pos))
        return bool(inside.all() and (pos[keys] >= 0).all())


class _Items(ItemsView):  # type: ignore[type-arg]
    """`TensorTable.items()`: pairs straight off its two columns (the generic view looks each key up)."""

    _mapping: TensorTable

    def __iter__(self) -> Iterator[tuple[int, int]]:
        table = self._mapping
        return zip(table._keys, table._values, strict=True)


@dataclass(frozen=True, eq=False)
class PlanIndex:
    """A checked plan's tables (read-only; shared by reference with the validator that built them).

    Columnar, in plain ints: a place is packed as `rank << 32 | index` (ranks as in `Topology.rank`),
    so the tables are dicts and arrays of ints, which the cyclic garbage collector does not track (a
    million tuples of workers kept alive cost it seconds per collection). Read them through the methods.

    - `sent[t]` / `received[t]`: the packed place of transfer id t's SEND / RECV; `consumed[t]`: the
      index, on the receiver, of the compute op that consumes it.
    - `channel(sender, receiver)`: the transfer ids the channel carries, in posting order (both ends
      agree: `check` proved FIFO order); read off the sender's stream when asked.
    - `order` (from `order_ranks`, `order_stops`): a deadlock-free order of (worker, stop) segments:
      running each worker's stream up to (not including) instruction `stop`, segment after segment,
      never waits for a tensor not yet sent, and every ALLREDUCE is reached by its whole stage group
      before anyone passes it.
    """

    pp: int
    microbatches: int
    by_rank: tuple[Worker | None, ...]  # the plan's workers by rank; None for failed ones
    sent: Mapping[int, int]
    received: Mapping[int, int]
    consumed: Mapping[int, int]
    order_ranks: Sequence[int]
    order_stops: Sequence[int]
    streams: Mapping[Worker, tuple[Instruction, ...]]
    costs: CostModel
    stages: int  # virtual stages per pipeline (`Topology.stages`): what transfer ids count in
    cut: Cut = NO_CUT  # the plan's re-cut micro-batches: activation scales with their size
    reach: Reach | None = None  # re-formed pipelines: each pipeline's neighbours across its gaps
    pipeline_costs: Mapping[int, CostModel] = field(default_factory=dict)  # re-formed pipelines' own costs

    @property
    def ranks(self) -> int:
        return len(self.by_rank)

    @property
    def order(self) -> Iterator[tuple[Worker, int]]:
        by_rank = self.by_rank
        return ((by_rank[r], stop) for r, stop in zip(self.order_ranks, self.order_stops, strict=True))  # type: ignore[misc]

    def transfer_id(self, key: TransferKey) -> int:
        d, m, s, channel = key
        return ((d * self.microbatches + m) * self.stages + s) * 2 + channel

    def id_of(self, ins: Instruction) -> int:
        """The transfer id of a SEND or RECV of this plan."""
        return self.transfer_id(transfer_key(ins, self.reach))

    def where(self, at: int) -> Where:
        """A packed place as (worker, index)."""
        return self.by_rank[at >> 32], at & _LOW  # type: ignore[return-value]

    def send_of(self, transfer: int) -> Where:
        return self.where(self.sent[transfer])

    def receive_of(self, transfer: int) -> Where:
        return self.where(self.received[transfer])

    def peer_of(self, worker: Worker, index: int) -> Where:
        """Where the other end of the transfer at (worker, index) is."""
        ins = self.streams[worker][index]
        t = self.id_of(ins)
        return self.receive_of(t) if semantics_of(ins.kind).direction == SEND else self.send_of(t)

    def consumer(self, worker: Worker, index: int) -> int:
        """The index of the compute op that consumes what the transfer at (worker, index) carries,
        on the receiver (for a SEND, on its peer)."""
        return self.consumed[self.id_of(self.streams[worker][index])]

    def channel(self, sender: Worker, receiver: Worker) -> tuple[int, ...]:
        """The transfer ids from `sender` to `receiver`, in the order both post them."""
        return tuple(self.id_of(ins) for ins in self.streams[sender]
                     if ins.peer == receiver and semantics_of(ins.kind).direction == SEND)

    def memory_profile(self, worker: Worker) -> tuple[float, ...]:
        """Activation memory `worker` holds after each instruction of its stream (the one memory model)."""
        costs = self.pipeline_costs.get(worker.pipeline, self.costs)
        return memory_levels(stream_deltas(costs, self.streams[worker], worker.stage, self.cut))


_LOW = (1 << 32) - 1


def plan_index(plan: Plan) -> PlanIndex:
    """The index of `plan`, validating it first if it has not passed `check` (which builds the index)."""
    from schedcomp.check import check, index_of

    found = index_of(plan)
    if found is None:
        check(plan)
        found = index_of(plan)
    assert found is not None
    return found
