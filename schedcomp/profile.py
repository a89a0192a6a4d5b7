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
- virtual stages (interleaved, V): every cost above is per chunk, the model's pp x chunks entries, read
  from the op's stage; a worker's STEP and ALLREDUCE serve all its chunks at once, so each chunk gets an
  equal share (the sum, which is what the timing engines charge a worker, is exact; its split is not
  observable, so a model reused with another placement of the chunks, loop against V, charges each worker
  the sum of shares of chunks it did not hold together); a worker's speed is the median over its chunks.
- activation (bytes) and b_frees, when the trace carries memory (`profile=True` records it): per
  stage, the median rise of held activation memory over an F, and the median share of it a B frees;
  the model's `memory_unit` is then "bytes". Traces without memory keep `base`'s (default: units).
The memory limit comes from `base` (a limit in units is dropped when activations are in bytes).
"""

from __future__ import annotations

import logging
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path

from schedcomp.costs import CostModel
from schedcomp.draw.trace import load_trace, read_chrome_trace
from schedcomp.errors import CostModelError
from schedcomp.ir import COMPUTE_KINDS, InstrKind
from schedcomp.planindex import TransferKey, transfer_key
from schedcomp.semantics import RECV, SEND, kinds, semantics_of
from schedcomp.timeline import Span
from schedcomp.topology import Worker

log = logging.getLogger(__name__)

MS = 1e3  # spans are in seconds; the cost model in milliseconds
_WAIT_EPSILON = 20e-6  # seconds: a receive that completed later than this after the stream could go was waited for
_COMPUTE = {k: k.value for k in COMPUTE_KINDS}
_TRANSFERS = kinds(direction=SEND) | kinds(direction=RECV)
_CONSUMERS = frozenset(k for k in COMPUTE_KINDS if semantics_of(k).reads >= 0)  # ops that take a received tensor


def read_trace(path: str | Path) -> list[Span]:
    """The spans of a Chrome trace in seconds, whatever time unit it was written with."""
    data = load_trace(path)  # read once, bounded
    spans = read_chrome_trace(data if isinstance(data, dict) else {"traceEvents": data}, f"trace {path}")
    other = (data.get("otherData") or {}) if isinstance(data, dict) else {}  # a JSON-array trace has no otherData
    scale = float(other.get("seconds_per_unit", 1.0)) if isinstance(other, dict) else 1.0
    if scale == 1.0:
        return spans
    return [replace(s, start=s.start * scale, end=s.end * scale) for s in spans]


def profile_costs(traces: Iterable[Sequence[Span]], *, base: CostModel | None = None, b_share: float = 0.5,
                  skip: int = 1, straggler: float = 0.1) -> CostModel:
    """A cost model (milliseconds) from measured spans; see the module docstring."""
    if not 0.0 < b_share < 1.0:
        raise CostModelError(f"b_share must be a fraction in (0, 1), got {b_share!r}")
    # (kind, stage, worker) -> seconds; with virtual stages the stage is the op's chunk, and a worker's
    # STEP and ALLREDUCE (one for all its chunks) are shared equally by its chunks
    samples: dict[tuple[str, int, Worker], list[float]] = defaultdict(list)
    allreduce: dict[int, list[float]] = defaultdict(list)
    p2p: list[float] = []
    kept: list[list[Span]] = []
    for trace in traces:
        spans = _steady(list(trace), skip)
        kept.append(spans)
        held = _chunks_held(spans)
        for s in spans:
            kind = s.instruction.kind
            if kind in _COMPUTE and s.instruction.op is not None:
                samples[(_COMPUTE[kind], s.instruction.op.stage, s.worker)].append(s.duration)
            elif kind is InstrKind.STEP:
                for stage in held[s.worker]:
                    samples[("STEP", stage, s.worker)].append(s.duration / len(held[s.worker]))
        for stage, value in _allreduce_times(spans, held).items():
            allreduce[stage] += value
        p2p += _waited_transfers(spans)
    workers = sorted({w for _, _, w in samples})
    if not workers:
        raise CostModelError("the traces hold no spans: record them with PipelineTrainer(profile=True).save_trace")
    pp = max(stage for _, stage, _ in samples) + 1  # stages of the model: pp x chunks with virtual stages
    if base is not None and base.pp != pp:
        raise CostModelError(f"the base cost model has {base.pp} stages but the traces have {pp}: give a matching one")

    def stage_time(kind: str, stage: int) -> float | None:
        """The fastest replica's median: stragglers are slowdowns from it (see `speed`)."""
        medians = [_median(samples[(kind, stage, w)]) for w in workers if samples.get((kind, stage, w))]
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
    ratios: dict[Worker, list[float]] = defaultdict(list)  # per worker, its chunks' forward against the stage's
    for (kind, stage, ran_on), times in samples.items():
        if kind == "F" and (mine := _median(times)) > 0:
            ratios[ran_on].append(forward[stage] / mine)
    speed = {}
    for worker, values in ratios.items():  # a worker's factor: the median over its chunks
        factor = statistics.median(values)
        if abs(factor - 1.0) > straggler:
            speed[worker] = factor
    steps = [stage_time("STEP", stage) for stage in range(pp)]
    template = base or CostModel.uniform(pp)
    activation, b_frees, unit = template.activation, template.b_frees, template.memory_unit
    limit = template.memory_limit
    memory = activation_bytes([s for trace in kept for s in trace], pp)
    if memory is not None:
        activation, b_frees = memory
        limit = limit if unit == "bytes" else None
        unit = "bytes"
    return CostModel(
        forward=tuple(forward), backward_input=tuple(b), backward_weight=tuple(w),
        p2p=_median(p2p) if p2p else 0.0,
        allreduce=tuple(_median(allreduce[s]) if allreduce.get(s) else 0.0 for s in range(pp)),
        optimizer=tuple(t or 0.0 for t in steps),
        activation=activation, b_frees=b_frees, memory_limit=limit, speed=speed, memory_unit=unit,
    )


def memory_deltas(spans: Iterable[Span]) -> dict[tuple[Worker, int], list[tuple[Span, float]]]:
    """Per (worker, iteration), its measured compute spans in stream order with the change in held
    activation memory each made (the first against zero: an iteration starts holding nothing)."""
    runs: dict[tuple[Worker, int], list[Span]] = defaultdict(list)
    for s in spans:
        if s.instruction.kind in _COMPUTE and s.memory is not None:
            runs[(s.worker, s.iteration)].append(s)
    out = {}
    for key, run in runs.items():
        run.sort(key=lambda s: s.index)
        held, rows = 0.0, []
        for s in run:
            assert s.memory is not None
            rows.append((s, s.memory - held))
            held = s.memory
        out[key] = rows
    return out


def activation_bytes(spans: Iterable[Span], pp: int) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """Per stage (with virtual stages, per chunk), (median bytes an F adds, median share of them its B frees),
    or None without memory."""
    adds: dict[int, list[float]] = defaultdict(list)
    frees: dict[int, list[float]] = defaultdict(list)
    for rows in memory_deltas(spans).values():
        added: dict[tuple[int, int, int], float] = {}  # (stage, d, m): with virtual stages, per chunk
        for s, delta in rows:
            op = s.instruction.op
            assert op is not None
            stage, key = op.stage, (op.stage, op.pipeline, op.microbatch)
            if s.instruction.kind is InstrKind.F:
                added[key] = delta
                adds[stage].append(delta)
            elif s.instruction.kind is InstrKind.B and added.get(key, 0.0) > 0:
                frees[stage].append(min(1.0, max(0.0, -delta / added[key])))
            elif s.instruction.kind is InstrKind.BW:
                frees[stage].append(1.0)
    if not adds:
        return None
    missing = [s for s in range(pp) if s not in adds]
    if missing:
        raise CostModelError(f"the traces carry memory but none for stage {missing[0]}: profile every stage")
    return (tuple(max(0.0, statistics.median(adds[s])) for s in range(pp)),
            tuple(statistics.median(frees[s]) if frees.get(s) else 1.0 for s in range(pp)))


def measured_peaks(spans: Iterable[Span]) -> dict[Worker, float]:
    """The most activation memory each worker held in the traces (bytes), where they carry memory.

    A worker's first iteration, and the first after each gap in its iterations (a replacement process that
    joined), are left out where it ran others: on CUDA a process's first iteration also allocates cuBLAS's
    persistent workspace (`runtime.memory`), which is not activation memory."""
    spans = [s for s in spans if s.memory_peak is not None or s.memory is not None]
    iterations: dict[Worker, set[int]] = defaultdict(set)
    for s in spans:
        iterations[s.worker].add(s.iteration)
    starts: dict[Worker, set[int]] = {}
    for w, its in iterations.items():
        firsts = {i for i in its if i - 1 not in its}
        if len(firsts) < len(its):
            starts[w] = firsts
    peaks: dict[Worker, float] = {}
    for s in spans:
        if s.iteration not in starts.get(s.worker, ()):
            value = s.memory_peak if s.memory_peak is not None else s.memory
            peaks[s.worker] = max(peaks.get(s.worker, 0.0), value)
    return peaks


def _median(seconds: Sequence[float]) -> float:
    return statistics.median(seconds) * MS


def _steady(spans: list[Span], skip: int) -> list[Span]:
    iterations = sorted({s.iteration for s in spans})
    if len(iterations) > skip:
        kept = set(iterations[skip:])
        return [s for s in spans if s.iteration in kept]
    return spans


def _chunks_held(spans: Iterable[Span]) -> dict[Worker, tuple[int, ...]]:
    """The stages (chunks) each worker ran compute for: its own stage, or its virtual stages."""
    held: dict[Worker, set[int]] = defaultdict(set)
    for s in spans:
        if s.instruction.kind in _COMPUTE and s.instruction.op is not None:
            held[s.worker].add(s.instruction.op.stage)
    return defaultdict(tuple, {w: tuple(sorted(stages)) for w, stages in held.items()})


def _allreduce_times(spans: list[Span], held: dict[Worker, tuple[int, ...]]) -> dict[int, list[float]]:
    """Per stage, the shortest ALLREDUCE of each iteration (a group of one has nothing to reduce: 0). A
    worker's one all-reduce covers all its chunks: each gets an equal share, which keeps the sum the
    timing engines charge (`CostModel.allreduce_of`); how it splits between chunks is not observable."""
    groups: dict[tuple[int, tuple[int, ...]], list[float]] = defaultdict(list)
    for s in spans:
        if s.instruction.kind is InstrKind.ALLREDUCE and held[s.worker]:
            groups[(s.iteration, held[s.worker])].append(s.duration)
    out: dict[int, list[float]] = defaultdict(list)
    for (_, stages), durations in groups.items():
        for stage in stages:
            out[stage].append(min(durations) / len(stages) if len(durations) > 1 else 0.0)
    return out


def _waited_transfers(spans: list[Span]) -> list[float]:
    """Send-to-arrival seconds of the transfers whose consumer had to wait for them."""
    sent: dict[tuple[int, TransferKey], float] = {}  # (iteration, transfer) -> when its SEND was posted
    # (worker, iteration, channel, stage, d, m) -> RECV: a receive names the op it feeds, chunk included
    received: dict[tuple[Worker, int, int, int, int, int], Span] = {}
    by_slot: dict[tuple[Worker, int, int], Span] = {}
    for s in spans:
        ins = s.instruction
        by_slot[(s.worker, s.iteration, s.index)] = s
        if ins.op is None:
            continue
        sem = semantics_of(ins.kind)
        if sem.direction == SEND:
            sent[(s.iteration, transfer_key(ins))] = s.start
        elif sem.direction == RECV:
            received[(s.worker, s.iteration, sem.channel, ins.op.stage, ins.op.pipeline, ins.op.microbatch)] = s
    out = []
    for s in spans:
        kind = s.instruction.kind
        if kind not in _CONSUMERS or s.instruction.op is None:
            continue
        op = s.instruction.op
        recv = received.get((s.worker, s.iteration, semantics_of(kind).reads, op.stage, op.pipeline, op.microbatch))
        before = by_slot.get((s.worker, s.iteration, s.index - 1))
        if recv is None or before is None:
            continue
        # when the stream could have run this op: transfers are only posted, they end at arrival
        ready = before.start if before.instruction.kind in _TRANSFERS else before.end
        if recv.end <= ready + _WAIT_EPSILON:
            continue
        posted = sent.get((s.iteration, transfer_key(recv.instruction)))
        if posted is not None and recv.end >= posted:
            out.append(recv.end - posted)
    return out
