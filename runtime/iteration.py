"""One worker's state for one iteration of its stream: the tensors in flight, their keys and tags.

`Iteration` is what every handler of `runtime.executor` reads and writes; it is thrown away when
the iteration ends. Tensors in flight are keyed by (channel, virtual stage, micro-batch): a received
tensor waits in `recvs` until its consumer takes it, a produced one in `outgoing` until its SEND
posts it (or the worker's next chunk takes it: a local hand-off). A message's tag is its transfer's
id in the plan's index, the same on both ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.distributed as dist
from torch import Tensor

from schedcomp.errors import RuntimeSetupError
from schedcomp.ir import Instruction, Op, Plan
from schedcomp.planindex import plan_index
from schedcomp.runtime.comm import Comm
from schedcomp.runtime.data import Tensors, batch_rows, chunk_index, held_rows, overlaps, piece_rows
from schedcomp.runtime.layout import Layout
from schedcomp.runtime.memory import MemoryMeter
from schedcomp.runtime.stage import Stage, TensorMeta
from schedcomp.semantics import ACT, semantics_of
from schedcomp.topology import Worker

Key = tuple[int, int]  # (home pipeline, microbatch)
Slot = tuple[int, int, Key]  # a tensor in flight: (channel, virtual stage of the op that names it, micro-batch)
MAX_PARTS = 64  # tensors a stage may pass on (keeps gloo tags unique)


@dataclass
class Iteration:
    """Everything one iteration of one worker's stream touches; thrown away when it ends."""

    plan: Plan
    worker: Worker
    stage: Stage  # the worker's (first) chunk
    comm: Comm
    inputs: Tensors
    targets: Tensors
    boundaries: dict[int, tuple[TensorMeta, ...]]  # what crosses into unit u, by u (`runtime.shapes`)
    number: int = 0  # of the iteration, for message tags
    record: bool = False  # profiling: note when each receive was seen complete
    step: Callable[[Iteration], None] | None = None  # runs STEP instead of `stage.step` (resilient: snapshot, commit)
    ledger: Tensor | None = None  # per-chunk count of weight gradients accumulated, summed by ALLREDUCE (`count`)
    keep_sent: bool = False  # keep every sent tensor until the iteration is dropped (lossy recovery)
    meter: MemoryMeter | None = None  # profiling: activation memory around each compute op
    stages: dict[int, Stage] = field(default_factory=dict)  # every chunk held, by virtual stage (default: `stage`)
    seed: int | None = None  # the job's: each forward draws from its micro-batch's stream (`runtime.rng`)
    layout: Layout | None = None  # units each stage holds, the all-reduce's collectives (default: the plan's)
    # state, filled and emptied as the stream runs
    loaded: dict[tuple[int, Key], tuple[Tensors | None, Tensors | None]] = field(default_factory=dict)
    recvs: dict[Slot, tuple[int, list[dist.Work], tuple[Tensor, ...]]] = field(default_factory=dict)
    outgoing: dict[Slot, tuple[Tensor, ...]] = field(default_factory=dict)
    sends: list[tuple[dist.Work, Tensor]] = field(default_factory=list)
    sent: dict[Slot, tuple[Tensor, ...]] = field(default_factory=dict)  # kept to send again (lossy)
    losses: dict[Key, Tensor] = field(default_factory=dict)  # last stage: each micro-batch's scaled loss
    arrivals: dict[int, float] = field(default_factory=dict)  # RECV index -> when its consumer saw it complete
    memory: dict[int, tuple[float, float]] = field(default_factory=dict)  # compute index -> (held after, peak)
    index: int = 0  # of the instruction being run
    # each micro-batch's rows of the global batch, computed once for LOAD, its loss, its receives and the ledger
    rows_by_key: dict[Key, tuple[int, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.stages:
            self.stages = {self.stage.index: self.stage}

    @property
    def units(self) -> Layout:
        """Which units each pipeline's stages hold, and the all-reduce's collectives (`runtime.layout`)."""
        if self.layout is None:
            self.layout = Layout.of(self.plan)
        return self.layout

    def incoming(self, op: Op) -> tuple[TensorMeta, ...]:
        """What `op`'s stage receives from the held stage before it (across any gap)."""
        return self.boundaries[self.units.span(op.pipeline, op.stage).start]

    def outgoing_grads(self, op: Op) -> tuple[TensorMeta, ...]:
        """The gradients `op`'s stage receives from the held stage after it: of its floating-point outputs."""
        return tuple(m for m in self.boundaries[self.units.span(op.pipeline, op.stage).stop] if m.has_grad)

    def stage_of(self, op: Op) -> Stage:
        """The chunk that runs `op` (its virtual stage)."""
        try:
            return self.stages[op.stage]
        except KeyError:
            raise RuntimeSetupError(f"{op} on worker {self.worker} is of stage {op.stage}, which this worker does not "
                                    f"hold (it holds {sorted(self.stages)}): the plan is malformed") from None

    @property
    def device(self) -> torch.device:
        return self.comm.device

    @property
    def chunks(self) -> int:
        return self.plan.topology.dp * self.plan.microbatches

    def rows_of(self, op: Op) -> tuple[int, int]:
        """The rows of the global batch `op`'s micro-batch covers (a piece of it, in a re-cut plan)."""
        key = key_of(op)
        rows = self.rows_by_key.get(key)
        if rows is None:
            plan = self.plan
            rows = self.rows_by_key[key] = piece_rows(plan.cut, op.pipeline, op.microbatch, plan.microbatches,
                                                      self.chunks, batch_rows(self.inputs))
        return rows

    def scale_of(self, op: Op) -> float:
        """The weight of `op`'s micro-batch's (mean) loss: its share of the global batch's samples."""
        if not self.plan.cut:
            return 1.0 / self.chunks
        start, stop = self.rows_of(op)
        return (stop - start) / batch_rows(self.inputs)

    def tag(self, ins: Instruction, part: int) -> int:
        # The transfer's id in the plan's index (the same on both ends), so unique per message of an
        # iteration, and differs between consecutive iterations (a sender is never more than one
        # iteration ahead of its receiver: it waits for the receiver's gradients). Gloo matches on
        # (peer, tag); NCCL ignores tags and relies on the plan's per-channel FIFO order.
        return ((plan_index(self.plan).id_of(ins) * 2 + self.number % 2) * MAX_PARTS) + part

    def wait_inputs(self, ins: Instruction) -> None:
        """Block until the receives feeding this compute op have arrived."""
        direction = semantics_of(ins.kind).reads
        pending = self.recvs.get(slot_of(direction, ins.op))
        if pending is not None:
            for work in pending[1]:
                self.comm.wait(work)
            if self.record:
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                self.arrivals[pending[0]] = time.perf_counter()

    def take_received(self, direction: int, op: Op) -> tuple[Tensor, ...]:
        """The input of `op` on `direction`: received, or handed off by this worker's neighbouring chunk."""
        received = self.recvs.pop(slot_of(direction, op), None)
        if received is not None:
            return received[2]
        producer = op.stage - 1 if direction == ACT else op.stage + 1
        try:
            return self.outgoing.pop((direction, producer, key_of(op)))
        except KeyError:
            what = "RECV_ACT" if direction == ACT else "RECV_GRAD"
            raise RuntimeSetupError(f"{op} on worker {self.worker} has no earlier {what}: the plan is malformed, "
                                    "run `schedcomp check` on it") from None

    def post_sends(self, direction: int, ins: Instruction, again: bool = False) -> None:
        """Post the sends of a produced tensor (`again`: the same tensors once more, on a new generation)."""
        assert ins.op is not None and ins.peer is not None
        key = slot_of(direction, ins.op)
        tensors = self.sent[key] if again else tuple(t.contiguous() for t in self.outgoing.pop(key))
        if self.keep_sent:
            self.sent[key] = tensors
        for part, t in enumerate(tensors):
            self.sends.append((self.comm.isend(t, ins.peer, self.tag(ins, part)), t))

    def post_recvs(self, direction: int, ins: Instruction, metas: tuple[TensorMeta, ...]) -> None:
        assert ins.op is not None and ins.peer is not None
        if self.plan.cut and ins.op.pipeline in self.plan.cut.pipelines:  # a piece: its own rows, not a whole one's
            start, stop = self.rows_of(ins.op)
            metas = tuple(TensorMeta((stop - start, *m.shape[1:]), m.dtype) for m in metas)
        buffers = tuple(m.empty(self.device) for m in metas)
        works = [self.comm.irecv(b, ins.peer, self.tag(ins, part)) for part, b in enumerate(buffers)]
        self.recvs[slot_of(direction, ins.op)] = (self.index, works, buffers)

    def drop(self, lost: Iterable[Key]) -> None:
        """Forget everything held for these micro-batches (lossy recovery: they are skipped).

        A lost micro-batch whose B ran here gets its W now: B already added the gradients of the
        layers that do not defer theirs, so completing it keeps `.grad` and the ledger in step.
        """
        lost = frozenset(lost)
        for stage in self.stages.values():
            for key in stage.store.pending():
                if key in lost:
                    stage.backward_weight(key)
                    self.count(key)
        for table in (self.recvs, self.outgoing, self.sent):
            for k in [k for k in table if k[2] in lost]:
                del table[k]
        for k in [k for k in self.loaded if k[1] in lost]:
            del self.loaded[k]
        for key in lost:
            self.losses.pop(key, None)
            for stage in self.stages.values():
                stage.discard(key)

    def loss(self) -> Tensor | None:
        """The sum of this worker's scaled micro-batch losses (last stage; None elsewhere)."""
        return torch.stack(list(self.losses.values())).sum() if self.losses else None

    @cached_property
    def ledger_unit(self) -> int:
        """What one whole micro-batch counts in the ledger: 1, or its rows when the plan re-cuts some (see `count`)."""
        return batch_rows(self.inputs) // self.chunks if self.plan.cut else 1

    def count(self, key: Key) -> None:
        """Note that this micro-batch's weight gradients are now in `.grad` (the ledger of resilient jobs).

        The ledger has one entry per regular micro-batch (`chunk_index`) and counts samples: a whole
        micro-batch adds 1; under a re-cut plan every op adds, to each regular micro-batch it overlaps, the
        rows of it that it holds (`data.held_rows`; a whole micro-batch: all of them; the rows `rows_of` took, where
        this worker took them already). Counts are integers, so their sums are exact (in the all-reduce's float32
        too, below 2**24), and `counted` divides by the unit once: exactly 1.0 for a micro-batch whose every sample
        counted once.
        """
        if self.ledger is None:
            return
        if not self.plan.cut:
            self.ledger[chunk_index(key[0], key[1], self.plan.microbatches)] += 1
            return
        per, taken = self.ledger_unit, self.rows_by_key.get(key)  # LOAD's rows, or its receives', where taken here
        held = (overlaps(*taken, per) if taken is not None
                else held_rows(self.plan.cut, key[0], key[1], self.plan.topology.dp, self.plan.microbatches, per))
        for index, rows in held:
            self.ledger[index] += rows

    def counted(self) -> Tensor:
        """The ledger in regular micro-batches (see `count`)."""
        assert self.ledger is not None
        unit = self.ledger_unit
        return self.ledger / unit if unit != 1 else self.ledger

    def finish(self) -> None:
        """Wait for this iteration's sends, then check the stream left nothing behind."""
        for work, _ in self.sends:
            self.comm.wait(work)
        self.sends.clear()
        leftovers = len(self.recvs) + len(self.outgoing) + sum(
            stage.in_flight() + len(stage.store.pending()) for stage in self.stages.values())
        if leftovers:
            raise RuntimeSetupError(f"worker {self.worker}'s stream ended with {leftovers} unconsumed tensors: "
                                    "the plan is malformed, run `schedcomp check` on it")


def key_of(op: Op | None) -> Key:
    assert op is not None
    return (op.pipeline, op.microbatch)


def slot_of(direction: int, op: Op | None) -> Slot:
    assert op is not None
    return (direction, op.stage, (op.pipeline, op.microbatch))
