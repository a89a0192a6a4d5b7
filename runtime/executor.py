"""Execute one worker's instruction stream for one iteration: a dispatch table, one handler per kind.

Semantics (docs/design.md): receives are posted in stream order and never block; a compute op waits
only for the receives of its own inputs; a send is posted right after its producer and never
blocks; sends are waited on when the stream ends (their buffers live until then). ALLREDUCE sums
the stage's gradients over its live workers (each micro-batch's loss was already scaled by
1 / (dp * microbatches), or by its samples over the global batch's for a re-cut piece); STEP runs the
optimizer. Nothing waits on other stages after that: the
next iteration starts at once (staggered optimizer).

Virtual stages: a worker holds one `Stage` per chunk (`Iteration.stages`, by virtual stage) and
each op runs on the chunk its `op.stage` names. Tensors in flight are keyed by (channel, chunk,
micro-batch). A tensor between two chunks of this worker has no SEND or RECV: the producer leaves
it in `outgoing` and the consumer takes it from there (a local hand-off). ALLREDUCE reduces every
chunk's gradients in one collective (the worker's stage group holds the same chunks everywhere);
STEP steps every chunk's optimizer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from schedcomp.errors import RuntimeSetupError
from schedcomp.ir import COMPUTE_KINDS, InstrKind, Instruction, Op, Plan
from schedcomp.planindex import plan_index
from schedcomp.runtime.comm import Comm
from schedcomp.runtime.data import Tensors, as_tuple, batch_rows, chunk_index, micro_batch, piece_rows, take_rows
from schedcomp.runtime.memory import MemoryMeter
from schedcomp.runtime.rng import stream_seed
from schedcomp.runtime.stage import Stage, TensorMeta
from schedcomp.semantics import ACT, GRAD, SEMANTICS, semantics_of
from schedcomp.topology import Worker

Key = tuple[int, int]  # (home pipeline, microbatch)
Slot = tuple[int, int, Key]  # a tensor in flight: (channel, virtual stage of the op that names it, micro-batch)
_ACT, _GRAD = ACT, GRAD  # a transfer's channel, as the semantics table numbers it
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
    boundaries: tuple[tuple[TensorMeta, ...], ...]  # what crosses from virtual stage s to s + 1, per s
    number: int = 0  # of the iteration, for message tags
    record: bool = False  # profiling: note when each receive was seen complete
    step: Callable[[Iteration], None] | None = None  # runs STEP instead of `stage.step` (resilient: snapshot, commit)
    ledger: Tensor | None = None  # per-chunk count of weight gradients accumulated, summed by ALLREDUCE
    keep_sent: bool = False  # keep every sent tensor until the iteration is dropped (lossy recovery)
    meter: MemoryMeter | None = None  # profiling: activation memory around each compute op
    stages: dict[int, Stage] = field(default_factory=dict)  # every chunk held, by virtual stage (default: `stage`)
    seed: int | None = None  # the job's: each forward draws from its micro-batch's stream (`runtime.rng`)
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

    def __post_init__(self) -> None:
        if not self.stages:
            self.stages = {self.stage.index: self.stage}

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
        plan = self.plan
        return piece_rows(plan.cut, op.pipeline, op.microbatch, plan.microbatches, self.chunks,
                          batch_rows(self.inputs))

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
        pending = self.recvs.get(_slot(direction, ins.op))
        if pending is not None:
            for work in pending[1]:
                self.comm.wait(work)
            if self.record:
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                self.arrivals[pending[0]] = time.perf_counter()

    def take_received(self, direction: int, op: Op) -> tuple[Tensor, ...]:
        """The input of `op` on `direction`: received, or handed off by this worker's neighbouring chunk."""
        received = self.recvs.pop(_slot(direction, op), None)
        if received is not None:
            return received[2]
        producer = op.stage - 1 if direction == _ACT else op.stage + 1
        try:
            return self.outgoing.pop((direction, producer, _key(op)))
        except KeyError:
            what = "RECV_ACT" if direction == _ACT else "RECV_GRAD"
            raise RuntimeSetupError(f"{op} on worker {self.worker} has no earlier {what}: the plan is malformed, "
                                    "run `schedcomp check` on it") from None

    def post_sends(self, direction: int, ins: Instruction, again: bool = False) -> None:
        """Post the sends of a produced tensor (`again`: the same tensors once more, on a new generation)."""
        assert ins.op is not None and ins.peer is not None
        key = _slot(direction, ins.op)
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
        self.recvs[_slot(direction, ins.op)] = (self.index, works, buffers)

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

    def count(self, key: Key) -> None:
        """Note that this micro-batch's weight gradients are now in `.grad` (the ledger of resilient jobs)."""
        if self.ledger is not None:
            self.ledger[chunk_index(key[0], key[1], self.plan.microbatches)] += 1

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


def _key(op: Op | None) -> Key:
    assert op is not None
    return (op.pipeline, op.microbatch)


def _slot(direction: int, op: Op | None) -> Slot:
    assert op is not None
    return (direction, op.stage, (op.pipeline, op.microbatch))


def _load(it: Iteration, ins: Instruction) -> None:
    op = ins.op
    assert op is not None
    stage = it.stage_of(op)
    if it.plan.cut:
        start, stop = it.rows_of(op)
        inputs = take_rows(it.inputs, start, stop) if stage.is_first else None
        targets = take_rows(it.targets, start, stop) if stage.is_last else None
    else:
        index = chunk_index(op.pipeline, op.microbatch, it.plan.microbatches)
        inputs = micro_batch(it.inputs, index, it.chunks) if stage.is_first else None
        targets = micro_batch(it.targets, index, it.chunks) if stage.is_last else None
    it.loaded[(op.stage, _key(op))] = (inputs, targets)


def _recv_act(it: Iteration, ins: Instruction) -> None:
    assert ins.op is not None
    it.post_recvs(_ACT, ins, it.boundaries[ins.op.stage - 1])


def _recv_grad(it: Iteration, ins: Instruction) -> None:
    assert ins.op is not None
    it.post_recvs(_GRAD, ins, tuple(m for m in it.boundaries[ins.op.stage] if m.has_grad))


def _send_act(it: Iteration, ins: Instruction) -> None:
    it.post_sends(_ACT, ins)


def _send_grad(it: Iteration, ins: Instruction) -> None:
    it.post_sends(_GRAD, ins)


def _forward(it: Iteration, ins: Instruction) -> None:
    op = ins.op
    assert op is not None
    stage = it.stage_of(op)
    loaded_inputs, targets = (it.loaded.pop((op.stage, _key(op)), (None, None)) if stage.is_first or stage.is_last
                              else (None, None))
    if stage.is_first:
        if loaded_inputs is None:
            raise RuntimeSetupError(f"{op} on worker {it.worker} runs before its LOAD: the plan is malformed")
        inputs = as_tuple(loaded_inputs)
    else:
        inputs = it.take_received(_ACT, op)
    seed = None if it.seed is None else stream_seed(it.seed, it.number, op.stage, op.pipeline, op.microbatch)
    outputs = stage.forward(_key(op), inputs, targets, scale=it.scale_of(op), seed=seed)
    if stage.is_last:
        it.losses[_key(op)] = outputs[0]
    else:
        it.outgoing[_slot(_ACT, op)] = outputs


def _count(it: Iteration, op: Op | None) -> None:
    if op is not None:
        it.count(_key(op))


def _backward(it: Iteration, ins: Instruction, split: bool) -> None:
    op = ins.op
    assert op is not None
    stage = it.stage_of(op)
    grads = () if stage.is_last else it.take_received(_GRAD, op)
    input_grads = stage.backward(_key(op), grads, split=split)
    if not split:
        _count(it, op)
    if not stage.is_first:
        it.outgoing[_slot(_GRAD, op)] = input_grads


def _backward_input(it: Iteration, ins: Instruction) -> None:
    _backward(it, ins, split=True)


def _backward_fused(it: Iteration, ins: Instruction) -> None:
    _backward(it, ins, split=False)


def _backward_weight(it: Iteration, ins: Instruction) -> None:
    assert ins.op is not None
    it.stage_of(ins.op).backward_weight(_key(ins.op))
    _count(it, ins.op)


def _allreduce(it: Iteration, ins: Instruction) -> None:
    group = it.comm.stage_group(it.plan.topology.stage_group(it.worker.stage))
    stages = [stage for stage in it.stages.values() if stage.params]
    if group is None or not stages:
        return  # the only live worker of its stage: its gradients are already the sum
    # one collective for every chunk held (a single chunk's flat gradients are not copied again)
    flat = stages[0].flat_grads() if len(stages) == 1 else torch.cat([stage.flat_grads() for stage in stages])
    if it.ledger is not None:  # the ledger rides along: the counts summed are those of the gradients summed
        flat = torch.cat([flat, it.ledger.to(device=flat.device, dtype=flat.dtype)])  # the ledger is kept on the CPU
    it.comm.wait(dist.all_reduce(flat, group=group, async_op=True))
    if it.ledger is not None:
        n = flat.numel() - it.ledger.numel()
        it.ledger.copy_(flat[n:])
        flat = flat[:n]
    offset = 0
    for stage in stages:
        n = stage.numel
        stage.set_flat_grads(flat[offset:offset + n])
        offset += n


def _step(it: Iteration, ins: Instruction) -> None:
    if it.step is not None:
        it.step(it)
    else:
        for stage in it.stages.values():
            stage.step()


HANDLERS: dict[InstrKind, Callable[[Iteration, Instruction], None]] = {
    InstrKind.LOAD: _load,
    InstrKind.RECV_ACT: _recv_act,
    InstrKind.RECV_GRAD: _recv_grad,
    InstrKind.SEND_ACT: _send_act,
    InstrKind.SEND_GRAD: _send_grad,
    InstrKind.F: _forward,
    InstrKind.B: _backward_input,
    InstrKind.W: _backward_weight,
    InstrKind.BW: _backward_fused,
    InstrKind.ALLREDUCE: _allreduce,
    InstrKind.STEP: _step,
}


def handler(kind: InstrKind) -> Callable[[Iteration, Instruction], None]:
    """The handler of `kind`; a kind without one is a setup error, never a silent skip."""
    try:
        return HANDLERS[kind]
    except KeyError:
        raise RuntimeSetupError(f"instruction kind {kind!r} has no runtime handler: add one to "
                                "schedcomp.runtime.executor.HANDLERS") from None

Timing = list[tuple[int, float, float]]  # (instruction index, start, end) in perf_counter seconds


def run_stream(it: Iteration, stream: tuple[Instruction, ...], timing: Timing | None = None,
               before: Callable[[int, Instruction], None] | None = None) -> None:
    """Run one iteration of `stream`; with `timing`, append each instruction's (index, start, end).

    `before(index, instruction)` is called before each instruction (fault injection in tests).

    With `timing` and `it.meter`, each compute op's activation memory is measured too (`it.memory`).
    A compute op's start is taken after its inputs arrived, so waiting shows as a gap before it,
    as in the planned timeline. On a GPU the device is synchronised around each instruction, only
    when timing (profiling) is on.
    """
    sync = torch.cuda.synchronize if timing is not None and it.device.type == "cuda" else None
    waits = {k for k, sem in SEMANTICS.items() if sem.reads >= 0}  # compute ops that consume a received tensor
    for index, ins in enumerate(stream):
        it.index = index
        if before is not None:
            before(index, ins)
        if ins.kind in waits:
            it.wait_inputs(ins)
        run = handler(ins.kind)
        start = time.perf_counter()
        if it.meter is not None and timing is not None and ins.kind in COMPUTE_KINDS:
            assert ins.op is not None
            with it.meter.measure(ins.kind, _key(ins.op), it.stage_of(ins.op)):
                run(it, ins)
            it.memory[index] = (it.meter.held, it.meter.peak)
        else:
            run(it, ins)
        if timing is not None:
            if sync is not None:
                sync()
            timing.append((index, start, time.perf_counter()))
    it.index = len(stream)  # every instruction done (the progress a lossy recovery reads)
    it.finish()


def run_residual(it: Iteration, resend: Sequence[Instruction], repost: Sequence[Instruction],
                 rest: tuple[Instruction, ...], lost: Iterable[Key]) -> None:
    """Finish an iteration a failure interrupted, on the new generation's `it.comm` (lossy policy).

    The broken generation's transfers are given up (the graveyard keeps their groups alive); the
    lost micro-batches' state is dropped; receives not consumed are posted again, and sends whose
    receiver had not consumed them are posted again from the kept tensors; then `rest` runs. See
    `fault.residual` for why both sides then agree on every channel.
    """
    it.sends.clear()
    it.drop(lost)
    for ins in repost:
        handler(ins.kind)(it, ins)  # a receive: posted again on the new generation
    for ins in resend:
        it.post_sends(semantics_of(ins.kind).channel, ins, again=True)
    run_stream(it, rest)
