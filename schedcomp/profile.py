"""Measured timelines -> a `CostModel`, so the compiler plans with real costs (torch-free).

`profile_costs(traces)` takes the spans of one or more measured runs (the runtime's traces, read
with `schedcomp.draw.trace.read_chrome_trace`) and returns per-stage costs in milliseconds:
- forward / backward_input / backward_weight: the median F, B, W time of each stage (of its
  fastest replica, where dp > 1). A stage that only ran fused backwards (BW) gets
  B = `b_share` x BW and W = the rest;
- optimizer: the median STEP time (fastest replica); allreduce: per iteration the shortest ALLREDUCE of the stage's
  group (the last worker to arrive waits for nobody), then the median; 0 for a group of one;
- p2p: the median send-to-arrival time of the transfers a receiver actually waited for (the
  others were hidden behind compute and bound nothing); 0 when no receiver ever waited;
- speed: a worker whose median F is off its stage's by more than `straggler` (a fraction) gets
  the factor stage time / its median (below 1 for a straggler).
Warm-up iterations (the first `skip` of each trace) are left out when later ones exist.
Activation memory and the memory limit are not measured: they come from `base` (default: units).
"""

from __future__ import annotations

import logging
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

from schedcomp.costs import CostModel
from schedcomp.draw.trace import load_trace, read_chrome_trace
from schedcomp.errors import CostModelError
from schedcomp.ir import InstrKind, Op
from schedcomp.timeline import Span
from schedcomp.topology import Worker

log = logging.getLogger(__name__)

MS = 1e3  # spans are in seconds; the cost model in milliseconds
_WAIT_EPSILON = 20e-6  # seconds: a receive that completed later than this after the stream could go was waited for
_COMPUTE = {InstrKind.F: "F", InstrKind.B: "B", InstrKind.W: "W", InstrKind.BW: "BW"}
_TRANSFERS = frozenset({InstrKind.SEND_ACT, InstrKind.SEND_GRAD, InstrKind.RECV_ACT, InstrKind.RECV_GRAD})
_CONSUMERS = frozenset({InstrKind.F, InstrKind.B, InstrKind.BW})  # compute ops that take a received tensor


def read_trace(path: str | Path) -> list[Span]:
    """The spans of a Chrome trace in seconds, whatever time unit it was written with."""
    data = load_trace(path)  # read once, bounded
    spans = read_chrome_trace(data if isinstance(data, dict) else {"traceEvents": data}, f"trace {path}")
    other = (data.get("otherData") or {}) if isinstance(data, dict) else {}  # a JSON-array trace has no otherData
    scale = float(other.get("seconds_per_unit", 1.0)) if isinstance(other, dict) else 1.0
    if scale == 1.0:
        return spans
    return [Span(s.worker, s.iteration, s.index, s.instruction, s.start * scale, s.end * scale) for s in spans]


def profile_costs(traces: Iterable[Sequence[Span]], *, base: CostModel | None = None, b_share: float = 0.5,
                  skip: int = 1, straggler: float = 0.1) -> CostModel:
    """A cost model (milliseconds) from measured spans; see the module docstring."""
    if not 0.0 < b_share < 1.0:
        raise CostModelError(f"b_share must be a fraction in (0, 1), got {b_share!r}")
    samples: dict[tuple[str, Worker], list[float]] = defaultdict(list)  # (kind, worker) -> seconds
    allreduce: dict[int, list[float]] = defaultdict(list)
    p2p: list[float] = []
    for trace in traces:
        spans = _steady(list(trace), skip)
        for s in spans:
            kind = s.instruction.kind
            if kind in _COMPUTE:
                samples[(_COMPUTE[kind], s.worker)].append(s.duration)
            elif kind is InstrKind.STEP:
                samples[("STEP", s.worker)].append(s.duration)
        for stage, value in _allreduce_times(spans).items():
            allreduce[stage] += value
        p2p += _waited_transfers(spans)
    workers = sorted({w for _, w in samples})
    if not workers:
        raise CostModelError("the traces hold no spans: record them with PipelineTrainer(profile=True).save_trace")
    pp = max(w.stage for w in workers) + 1
    if base is not None and base.pp != pp:
        raise CostModelError(f"the base cost model has {base.pp} stages but the traces have {pp}: give a matching one")

    def stage_time(kind: str, stage: int) -> float | None:
        """The fastest replica's median: stragglers are slowdowns from it (see `speed`)."""
        medians = [_median(samples[(kind, w)]) for w in workers if w.stage == stage and samples.get((kind, w))]
        return min(medians) if medians else None

    forward, b, w = [], [], []
    for stage in range(pp):
        f_time, b_time, w_time, bw_time = (stage_time(k, stage) for k in ("F", "B", "W", "BW"))
        if f_time is None:
            raise CostModelError(f"the traces have no forward at stage {stage}: profile a run that covers every stage")
        forward.append(f_time)
        if b_time is not None and w_time is not None:
            b.append(b_time)
            w.append(w_time)
        elif bw_time is not None:
            b.append(bw_time * b_share)
            w.append(bw_time - bw_time * b_share)
        else:
            raise CostModelError(f"the traces have no backward at stage {stage}: profile whole iterations")
    speed = {}
    for worker in workers:
        mine = _median(samples[("F", worker)]) if samples.get(("F", worker)) else 0.0
        if mine > 0 and abs(forward[worker.stage] / mine - 1.0) > straggler:
            speed[worker] = forward[worker.stage] / mine
    steps = [stage_time("STEP", stage) for stage in range(pp)]
    template = base or CostModel.uniform(pp)
    return CostModel(
        forward=tuple(forward), backward_input=tuple(b), backward_weight=tuple(w),
        p2p=_median(p2p) if p2p else 0.0,
        allreduce=tuple(_median(allreduce[s]) if allreduce.get(s) else 0.0 for s in range(pp)),
        optimizer=tuple(t or 0.0 for t in steps),
        activation=template.activation, b_frees=template.b_frees, memory_limit=template.memory_limit, speed=speed,
    )


def _median(seconds: Sequence[float]) -> float:
    return statistics.median(seconds) * MS


def _steady(spans: list[Span], skip: int) -> list[Span]:
    iterations = sorted({s.iteration for s in spans})
    if len(iterations) > skip:
        kept = set(iterations[skip:])
        return [s for s in spans if s.iteration in kept]
    return spans


def _allreduce_times(spans: list[Span]) -> dict[int, list[float]]:
    """Per stage, the shortest ALLREDUCE of each iteration (a group of one has nothing to reduce: 0)."""
    groups: dict[tuple[int, int], list[float]] = defaultdict(list)
    for s in spans:
        if s.instruction.kind is InstrKind.ALLREDUCE:
            groups[(s.iteration, s.worker.stage)].append(s.duration)
    out: dict[int, list[float]] = defaultdict(list)
    for (_, stage), durations in groups.items():
        out[stage].append(min(durations) if len(durations) > 1 else 0.0)
    return out


def _message(direction: str, op: Op, iteration: int, sender: Worker | None, receiver: Worker) -> tuple[object, ...]:
    return (iteration, direction, op.pipeline, op.microbatch, sender, receiver)


def _waited_transfers(spans: list[Span]) -> list[float]:
    """Send-to-arrival seconds of the transfers whose consumer had to wait for them."""
    sent: dict[tuple[object, ...], float] = {}
    received: dict[tuple[object, ...], Span] = {}
    by_slot: dict[tuple[Worker, int, int], Span] = {}
    for s in spans:
        ins = s.instruction
        by_slot[(s.worker, s.iteration, s.index)] = s
        if ins.op is None:
            continue
        if ins.kind in (InstrKind.SEND_ACT, InstrKind.SEND_GRAD):
            direction = "act" if ins.kind is InstrKind.SEND_ACT else "grad"
            sent[_message(direction, ins.op, s.iteration, s.worker, ins.peer)] = s.start  # type: ignore[arg-type]
        elif ins.kind in (InstrKind.RECV_ACT, InstrKind.RECV_GRAD):
            direction = "act" if ins.kind is InstrKind.RECV_ACT else "grad"
            received[(s.worker, s.iteration, direction, ins.op.pipeline, ins.op.microbatch)] = s
    out = []
    for s in spans:
        kind = s.instruction.kind
        if kind not in _CONSUMERS or s.instruction.op is None:
            continue
        op, direction = s.instruction.op, ("act" if kind is InstrKind.F else "grad")
        recv = received.get((s.worker, s.iteration, direction, op.pipeline, op.microbatch))
        before = by_slot.get((s.worker, s.iteration, s.index - 1))
        if recv is None or before is None:
            continue
        # when the stream could have run this op: transfers are only posted, they end at arrival
        ready = before.start if before.instruction.kind in _TRANSFERS else before.end
        if recv.end <= ready + _WAIT_EPSILON:
            continue
        posted = sent.get(_message(direction, op, s.iteration, recv.instruction.peer, s.worker))
        if posted is not None and recv.end >= posted:
            out.append(recv.end - posted)
    return out
