"""Measured spans: gather every worker's instruction timings and write them as a Chrome/Perfetto trace.

Measured spans mean what simulated ones mean (`schedcomp.timeline.Span`), in seconds from a
common origin (rank 0's `time.perf_counter` at start: one clock for every process of a host):
- compute, ALLREDUCE, STEP: from the moment the instruction could run (inputs there) to its end;
  waiting for inputs shows as a gap before it;
- RECV: from posting to when its consumer saw it complete (an upper bound of the arrival);
- SEND: from posting to the matching receive's end, filled in once every worker's spans are here.
Compute spans also carry the activation memory measured around them (`runtime.memory`).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from schedcomp.draw.trace import to_chrome_trace
from schedcomp.errors import RuntimeSetupError
from schedcomp.fileio import dumps_json, write_atomic
from schedcomp.ir import Plan
from schedcomp.planindex import transfer_key
from schedcomp.semantics import RECV, SEND, semantics_of
from schedcomp.timeline import Span
from schedcomp.topology import Worker

if TYPE_CHECKING:
    from schedcomp.runtime.comm import Comm
    from schedcomp.runtime.trainer import PipelineTrainer

_COLUMNS = 6  # iteration, index, start, end, memory held after, memory peak (NaN: not measured)
_NAN = float("nan")


def common_origin(comm: Comm) -> float:
    """Rank 0's `perf_counter` now: one origin for every rank's spans (collective over the control group).

    `perf_counter` is the host's monotonic clock, shared by its processes, so spans of
    workers on one host line up exactly; across hosts their clocks are not compared.
    """
    origin = torch.tensor([time.perf_counter()], dtype=torch.float64, device=comm.control_device)
    dist.broadcast(origin, src=0, group=comm.control)
    return float(origin.item())


def _local_rows(trainer: PipelineTrainer) -> list[tuple[float, ...]]:
    rows = []
    origin = trainer._clock0
    for iteration, timing, arrivals, memory in trainer._timings:
        for index, start, end in timing:
            end = max(end, arrivals.get(index, end))
            held, peak = memory.get(index, (_NAN, _NAN))
            rows.append((float(iteration), float(index), start - origin, end - origin, held, peak))
    return rows


def _plan_at(history: list[tuple[int, Plan]], iteration: int) -> Plan:
    plan = history[0][1]
    for first, p in history:
        if first <= iteration:
            plan = p
    return plan


def _spans(worker: Worker, rows: list[tuple[float, ...]], history: list[tuple[int, Plan]]) -> list[Span]:
    spans = []
    for iteration, index, start, end, held, peak in rows:
        stream = _plan_at(history, int(iteration)).streams[worker]
        measured = not math.isnan(held)
        spans.append(Span(worker, int(iteration), int(index), stream[int(index)], start, end,
                          held if measured else None, peak if measured else None))
    return spans


def match_sends(spans: list[Span]) -> list[Span]:
    """End each SEND when its matching RECV was seen complete (the arrival, as far as we can tell).

    Both ends name the transfer by `transfer_key` (the tensor it carries) within an iteration."""
    arrived = {}
    for s in spans:
        if semantics_of(s.instruction.kind).direction == RECV:
            arrived[(s.iteration, transfer_key(s.instruction))] = s.end
    out = []
    for s in spans:
        ins = s.instruction
        if semantics_of(ins.kind).direction == SEND:
            end = arrived.get((s.iteration, transfer_key(ins)))
            if end is not None:
                s = Span(s.worker, s.iteration, s.index, ins, s.start, max(s.start, end))
        out.append(s)
    return out


def gather_spans(trainer: PipelineTrainer, everyone: bool) -> list[Span]:
    """This worker's spans, or (`everyone`, collective) every worker's, sends matched to receives."""
    rows = _local_rows(trainer)
    if not everyone:
        return _spans(trainer.worker, rows, trainer._history)
    group, device = trainer.comm.control, trainer.comm.control_device  # host data: no GPU round trip if served
    count = torch.tensor([len(rows)], dtype=torch.int64, device=device)
    counts = [torch.zeros_like(count) for _ in trainer.ranks.workers]
    dist.all_gather(counts, count, group=group)
    longest = max(int(c.item()) for c in counts)
    mine = torch.zeros((longest, _COLUMNS), dtype=torch.float64, device=device)
    if rows:
        mine[: len(rows)] = torch.tensor(rows, dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(mine) for _ in trainer.ranks.workers]
    dist.all_gather(gathered, mine, group=group)
    spans: list[Span] = []
    for worker, n, table in zip(trainer.ranks.workers, counts, gathered, strict=True):
        spans += _spans(worker, [tuple(r) for r in table[: int(n.item())].tolist()], trainer._history)
    return match_sends(spans)


def write_trace(spans: list[Span], path: str | Path) -> None:
    """Write `spans` (seconds) as a Chrome/Perfetto trace, in the format the planned timelines use.

    Atomically: a full disk or a crash leaves the previous trace at `path` whole, and the error
    (a RuntimeSetupError) names the path.
    """
    write_atomic(path, dumps_json(to_chrome_trace(spans)), RuntimeSetupError)
