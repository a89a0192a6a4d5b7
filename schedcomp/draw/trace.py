"""Chrome / Perfetto traces of timelines: write any spans, read back the ones we wrote.

Open the file at https://ui.perfetto.dev or chrome://tracing. Each worker is one process
track ("worker 0:1") with two threads: its stream (compute, ALLREDUCE, STEP, LOAD) and
its transfers (sends and receives run beside the stream, so they would not nest in it).
Every event is a complete event (`ph: "X"`) whose args carry the worker, iteration,
instruction index and text, so `read_chrome_trace` rebuilds the exact spans.

Times: a span's unit is `seconds_per_unit` seconds (1 by default: measured spans are in
seconds; a simulated unit-cost plan then shows one unit as one second). The trace stores
microseconds and records the unit, so reading converts back.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from schedcomp import fileio, limits
from schedcomp.draw.style import category
from schedcomp.errors import LimitError, PlanFormatError, SchedcompError, SchedcompTypeError
from schedcomp.ir import Instruction, staged_text
from schedcomp.timeline import Span
from schedcomp.topology import Worker

TRACE_FORMAT = "schedcomp-trace"
TRACE_VERSION = 1
_STREAM_TID, _COMM_TID = 0, 1

__all__ = ["load_trace", "read_chrome_trace", "to_chrome_trace", "write_chrome_trace"]


def _text(span: Span) -> str:
    """The instruction's text, naming its op's virtual stage where the worker's place does not (chunks)."""
    op = span.instruction.op
    return staged_text(span.instruction) if op is not None and op.stage != span.worker.stage else str(span.instruction)


def to_chrome_trace(spans: Iterable[Span], seconds_per_unit: float = 1.0, name: str = "schedcomp") -> dict[str, Any]:
    """The Chrome trace-event JSON object of `spans` (see the module docstring)."""
    if not seconds_per_unit > 0:
        raise PlanFormatError(f"seconds_per_unit must be positive, got {seconds_per_unit!r}")
    spans = list(spans)
    us = seconds_per_unit * 1e6
    workers = sorted({s.worker for s in spans})
    pid = {w: k for k, w in enumerate(workers)}
    events: list[dict[str, Any]] = []
    for w in workers:
        events += [
            {"ph": "M", "name": "process_name", "pid": pid[w], "tid": 0, "args": {"name": f"worker {w}"}},
            {"ph": "M", "name": "process_sort_index", "pid": pid[w], "tid": 0, "args": {"sort_index": pid[w]}},
            {"ph": "M", "name": "thread_name", "pid": pid[w], "tid": _STREAM_TID, "args": {"name": "stream"}},
            {"ph": "M", "name": "thread_name", "pid": pid[w], "tid": _COMM_TID, "args": {"name": "transfers"}},
        ]
    for s in spans:
        cat = category(s.instruction)
        text = _text(s)
        events.append({
            "name": text,
            "cat": cat,
            "ph": "X",
            "pid": pid[s.worker],
            "tid": _COMM_TID if cat == "comm" else _STREAM_TID,
            "ts": s.start * us,
            "dur": max(0.0, s.end - s.start) * us,
            "args": {"worker": str(s.worker), "iteration": s.iteration, "index": s.index,
                     "instruction": text,
                     **({"memory": s.memory, "memory_peak": s.memory_peak} if s.memory is not None else {})},
        })
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"format": TRACE_FORMAT, "version": TRACE_VERSION, "name": name,
                      "seconds_per_unit": seconds_per_unit},
    }


def write_chrome_trace(spans: Iterable[Span], path: str | Path, seconds_per_unit: float = 1.0) -> None:
    """Write the trace atomically (a failed write leaves the old file whole)."""
    fileio.write_atomic(path, fileio.dumps_json(to_chrome_trace(spans, seconds_per_unit)), PlanFormatError)


def load_trace(path: str | Path) -> Any:
    """The JSON value of a trace file: size-bounded, UTF-8, depth-bounded, no NaN (not yet checked as a trace)."""
    where = f"trace {path}"
    return fileio.load_json(fileio.read_text(path, "trace", PlanFormatError), where, PlanFormatError)


def read_chrome_trace(source: str | Path | Mapping[str, Any], name: str = "trace") -> list[Span]:
    """The spans of a trace written by `to_chrome_trace` (a path or the loaded JSON object).

    Events without schedcomp args (from other tools) are skipped; PlanFormatError if none is left.
    `name` is how errors call a loaded object (e.g. "trace run1.json").
    """
    where = name
    if isinstance(source, Mapping):
        data: Any = source
    elif isinstance(source, (str, Path)):
        where = f"trace {source}"
        data = load_trace(source)
    else:
        raise SchedcompTypeError(f"a trace is a path or its loaded JSON object, not {type(source).__name__}")
    if isinstance(data, list):  # the JSON Array Format: events only
        events, other = data, {}
    elif isinstance(data, Mapping) and isinstance(data.get("traceEvents"), list):
        events, other = data["traceEvents"], data.get("otherData") or {}
    else:
        raise PlanFormatError(f"{where} is not a Chrome trace: expected an object with a 'traceEvents' list")
    scale = other.get("seconds_per_unit", 1.0) if isinstance(other, Mapping) else 1.0
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < math.inf:
        raise PlanFormatError(f"{where}: otherData.seconds_per_unit must be a positive number, got {scale!r}")
    us = scale * 1e6
    top = limits.ITERATIONS.value()
    spans = []
    for k, ev in enumerate(events):
        if not isinstance(ev, Mapping) or ev.get("ph") != "X" or not isinstance(ev.get("args"), Mapping):
            continue
        args = ev["args"]
        if "worker" not in args or "iteration" not in args or "index" not in args:
            continue
        try:
            worker = Worker.parse(str(args["worker"]))
            instruction = Instruction.parse(str(args.get("instruction", ev.get("name", ""))), worker.stage)
            iteration, index = _nonneg_int(args["iteration"]), _nonneg_int(args["index"])
            ts, dur = _finite(ev["ts"]), _finite(ev.get("dur", 0.0))
            memory, peak = _bytes(args.get("memory")), _bytes(args.get("memory_peak", args.get("memory")))
        except (SchedcompError, KeyError, TypeError, ValueError, OverflowError) as exc:
            raise PlanFormatError(f"{where}: event {k} is not a schedcomp span ({exc})") from None
        if iteration >= top:  # metrics index a list by iteration: 10^18 would try to allocate it
            raise LimitError(f"{where}: event {k} is at iteration {iteration}, past the limit of {top:,} iterations: "
                             f"check the trace, or raise the limit with {limits.ITERATIONS.env}")
        spans.append(Span(worker, iteration, index, instruction, ts / us, (ts + dur) / us, memory, peak))
    if not spans:
        raise PlanFormatError(f"{where} holds no schedcomp spans: write it with `schedcomp show --trace` "
                              "or the runtime's trace option")
    spans.sort(key=lambda s: (s.worker, s.iteration, s.index))
    return spans


def _bytes(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"memory must be a non-negative number of bytes, got {value!r}")
    return float(value)


def _finite(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(f"expected a number, got {type(value).__name__}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"expected a finite number, got {value!r}")
    return number


def _nonneg_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"expected a non-negative integer, got {value!r}")
    return value
