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
chunk's gradients in one collective (the worker's stage group holds the same chunks everywhere); with
re-formed pipelines it runs one collective per segment the worker holds, in layer order (`runtime.layout`);
STEP steps every chunk's optimizer. The iteration's state (tensors in flight, tags) is
`runtime.iteration.Iteration`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from schedcomp.errors import RuntimeSetupError
from schedcomp.ir import COMPUTE_KINDS, InstrKind, Instruction, Op
from schedcomp.runtime.data import as_tuple, chunk_index, micro_batch, take_rows
from schedcomp.runtime.iteration import Iteration, Key, key_of, slot_of
from schedcomp.runtime.layout import Layout, Reduction
from schedcomp.runtime.rng import stream_seed
from schedcomp.runtime.stage import Stage
from schedcomp.semantics import ACT, GRAD, SEMANTICS, semantics_of
from schedcomp.topology import Worker

__all__ = ["HANDLERS", "Iteration", "Timing", "handler", "run_residual", "run_stream"]


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
    it.loaded[(op.stage, key_of(op))] = (inputs, targets)


def _recv_act(it: Iteration, ins: Instruction) -> None:
    assert ins.op is not None
    it.post_recvs(ACT, ins, it.incoming(ins.op))


def _recv_grad(it: Iteration, ins: Instruction) -> None:
    assert ins.op is not None
    it.post_recvs(GRAD, ins, it.outgoing_grads(ins.op))


def _send_act(it: Iteration, ins: Instruction) -> None:
    it.post_sends(ACT, ins)


def _send_grad(it: Iteration, ins: Instruction) -> None:
    it.post_sends(GRAD, ins)


def _forward(it: Iteration, ins: Instruction) -> None:
    op = ins.op
    assert op is not None
    stage = it.stage_of(op)
    loaded_inputs, targets = (it.loaded.pop((op.stage, key_of(op)), (None, None)) if stage.is_first or stage.is_last
                              else (None, None))
    if stage.is_first:
        if loaded_inputs is None:
            raise RuntimeSetupError(f"{op} on worker {it.worker} runs before its LOAD: the plan is malformed")
        inputs = as_tuple(loaded_inputs)
    else:
        inputs = it.take_received(ACT, op)
    seed = None if it.seed is None else stream_seed(it.seed, it.number, op.stage, op.pipeline, op.microbatch)
    outputs = stage.forward(key_of(op), inputs, targets, scale=it.scale_of(op), seed=seed)
    if stage.is_last:
        it.losses[key_of(op)] = outputs[0]
    else:
        it.outgoing[slot_of(ACT, op)] = outputs


def _count(it: Iteration, op: Op | None) -> None:
    if op is not None:
        it.count(key_of(op))


def _backward(it: Iteration, ins: Instruction, split: bool) -> None:
    op = ins.op
    assert op is not None
    stage = it.stage_of(op)
    grads = () if stage.is_last else it.take_received(GRAD, op)
    input_grads = stage.backward(key_of(op), grads, split=split)
    if not split:
        _count(it, op)
    if not stage.is_first:
        it.outgoing[slot_of(GRAD, op)] = input_grads


def _backward_input(it: Iteration, ins: Instruction) -> None:
    _backward(it, ins, split=True)


def _backward_fused(it: Iteration, ins: Instruction) -> None:
    _backward(it, ins, split=False)


def _backward_weight(it: Iteration, ins: Instruction) -> None:
    assert ins.op is not None
    it.stage_of(ins.op).backward_weight(key_of(ins.op))
    _count(it, ins.op)


def _allreduce(it: Iteration, ins: Instruction) -> None:
    reductions = it.units.reductions_of(it.worker)
    if it.ledger is None or not it.units.per_layer:
        for reduction in reductions:
            _reduce(it, reduction)
        return
    # Per segment, the ledger: each reduction sums this worker's own counts (a W covers every layer it holds)
    # over that segment's holders, so each segment's sum says how often each row entered its layers' update.
    own, summed = it.ledger.clone(), []
    for reduction in reductions:
        it.ledger.copy_(own)
        _reduce(it, reduction)
        summed.append(it.ledger.clone())
    it.ledger.copy_(segment_ledger(summed, own))


def _reduce(it: Iteration, reduction: Reduction) -> None:
    """One collective of ALLREDUCE (`runtime.layout`): the holders sum the gradients of the reduction's layers
    (of every chunk held, for a reduction over a stage group)."""
    group = it.comm.stage_group(reduction.holders)
    if group is None:
        return  # the only live holder: its gradients are already the sum
    gathered = _gather(it, reduction)
    if gathered is None:  # no trainable parameter here (nor on its other holders, which hold the same layers)
        if it.ledger is not None:
            _sum_ledger(it, group, it.comm.device)
        return
    flat, scatter = gathered
    # The ledger (kept on the CPU) rides along, so the counts summed are those of the gradients summed; its
    # counts are rows (up to thousands), exact in float32 and float64 but not in half precision (bf16: 256),
    # so with half-precision gradients it goes in a float32 collective of its own on the same group. (With
    # segments `_allreduce` gives each reduction a fresh copy of this worker's counts.)
    rides = it.ledger is not None and flat.dtype in (torch.float32, torch.float64)
    if rides:
        flat = torch.cat([flat, it.ledger.to(device=flat.device, dtype=flat.dtype)])
    it.comm.wait(dist.all_reduce(flat, group=group, async_op=True))
    if rides:
        n = flat.numel() - it.ledger.numel()
        it.ledger.copy_(flat[n:])
        flat = flat[:n]
    elif it.ledger is not None:
        _sum_ledger(it, group, flat.device)
    scatter(flat)


def _sum_ledger(it: Iteration, group: dist.ProcessGroup, device: torch.device) -> None:
    """The ledger summed over `group` in a float32 collective of its own on `device` (exact: integer counts below
    2**24)."""
    assert it.ledger is not None
    counts = it.ledger.to(device=device, dtype=torch.float32)
    it.comm.wait(dist.all_reduce(counts, group=group, async_op=True))
    it.ledger.copy_(counts)


def segment_ledger(summed: Sequence[torch.Tensor], own: torch.Tensor) -> torch.Tensor:
    """One ledger for a worker that reduced several segments (`summed`: each one's counts over its holders):
    where they agree their count, where they differ NaN, so the report shows all ones exactly when every
    segment counted every row once. A worker holding no segment (idle) keeps its own counts (`own`)."""
    if not summed:
        return own
    first = summed[0]
    agree = torch.stack([s == first for s in summed]).all(dim=0)
    return torch.where(agree, first, torch.full_like(first, float("nan")))


def _gather(it: Iteration, reduction: Reduction) -> tuple[torch.Tensor, Callable[[torch.Tensor], None]] | None:
    """The gradients a reduction sums on this worker, flat, and how to put the sum back; None when it holds
    no trainable parameter there. A stage group's: every chunk's (one chunk's flat gradients are not copied
    again); a segment's: those of its layers within this worker's stage, in order."""
    if reduction.layers is None:
        stages = [stage for stage in it.stages.values() if stage.params]
        if not stages:
            return None
        flat = stages[0].flat_grads() if len(stages) == 1 else torch.cat([stage.flat_grads() for stage in stages])
        sizes = [stage.numel for stage in stages]
        setters = [stage.set_flat_grads for stage in stages]
    else:
        params = segment_params(it.units, it.worker, it.stage, reduction.layers)
        if not params:
            return None
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        sizes = [p.numel() for p in params]
        setters = [functools.partial(_set_grad, p) for p in params]

    def scatter(summed: torch.Tensor) -> None:
        offset = 0
        for n, put in zip(sizes, setters, strict=True):
            put(summed[offset:offset + n])
            offset += n

    return flat, scatter


def segment_params(layout: Layout, worker: Worker, stage: Stage, layers: range) -> list[torch.nn.Parameter]:
    """The trainable parameters of model layers `layers` in `worker`'s stage, in order (a segment's)."""
    return [p for layer in layout.layers_of(worker, stage.module, layers) for p in layer.parameters()
            if p.requires_grad]


def _set_grad(p: torch.nn.Parameter, flat: torch.Tensor) -> None:
    p.grad = flat.view_as(p)


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
            with it.meter.measure(ins.kind, key_of(ins.op), it.stage_of(ins.op)):
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
