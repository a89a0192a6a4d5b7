"""What a Gantt view shows, as plain data: rows (failed workers included) and labelled boxes.

The PNG/SVG chart (`gantt`) and the HTML view (`html`) both draw a `GanttLayout`, so what a box says
(its micro-batch and, when re-routed, its home pipeline) is decided once and tested without drawing.
Rows are grouped by stage, so a failed worker sits beside the peers that run its micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from schedcomp.draw.style import BLOCKING, category, label
from schedcomp.errors import SchedcompError
from schedcomp.timeline import Span
from schedcomp.topology import Worker


@dataclass(frozen=True)
class Row:
    """One worker's row: live, or failed (drawn crossed out, with no boxes)."""

    worker: Worker
    failed: bool = False

    @property
    def name(self) -> str:
        return f"{self.worker} failed" if self.failed else str(self.worker)


@dataclass(frozen=True)
class Box:
    """One instruction drawn on a row: on the worker's stream, or (transfers) in a lane beside it.

    `label` is what the box says: `F3` (micro-batch 3), `F3.1` (micro-batch 3 of pipeline 1, re-routed
    here), `AR`, `OPT`, `SEND_ACT[F3]`. `home` is the pipeline the micro-batch belongs to (None for
    all-reduce and optimizer steps).
    """

    row: int
    worker: Worker
    iteration: int
    start: float
    end: float
    category: str
    label: str
    instruction: str
    home: int | None
    rerouted: bool

    @property
    def on_stream(self) -> bool:
        return self.category in BLOCKING


@dataclass(frozen=True)
class GanttLayout:
    rows: tuple[Row, ...]
    boxes: tuple[Box, ...]
    t0: float
    t1: float

    @property
    def categories(self) -> set[str]:
        return {b.category for b in self.boxes}

    @property
    def has_rerouted(self) -> bool:
        return any(b.rerouted for b in self.boxes)

    @property
    def has_failed(self) -> bool:
        return any(r.failed for r in self.rows)


def gantt_layout(
    spans: Iterable[Span],
    failed: Collection[Worker] = (),
    keep: Callable[[Worker], bool] | None = None,
) -> GanttLayout:
    """Rows for the spans' workers and the `failed` ones (those `keep` accepts), ordered by stage then
    pipeline, and a box per drawn span. Loads, receives (they only wait for a send, which is drawn from
    post to arrival) and zero-length spans are left out."""
    spans = [s for s in spans if keep is None or keep(s.worker)]
    dead = {w for w in failed if keep is None or keep(w)}
    workers = sorted({s.worker for s in spans} | dead, key=lambda w: (w.stage, w.pipeline))
    rows = tuple(Row(w, w in dead) for w in workers)
    index = {w: k for k, w in enumerate(workers)}
    boxes = []
    for s in spans:
        cat = category(s.instruction)
        if cat == "LOAD" or s.end <= s.start or (cat == "comm" and s.instruction.kind.value.startswith("RECV")):
            continue
        op = s.instruction.op
        home = op.pipeline if op is not None else None
        boxes.append(Box(index[s.worker], s.worker, s.iteration, s.start, s.end, cat, label(s), str(s.instruction),
                         home, home is not None and home != s.worker.pipeline))
    t0 = min((s.start for s in spans), default=0.0)
    t1 = max((s.end for s in spans), default=0.0)
    return GanttLayout(rows, tuple(boxes), t0, t1)


def parse_worker_filter(text: str) -> Callable[[Worker], bool]:
    """`--workers`: comma-separated D:S patterns, each side a number, a range `a-b` or `*`.
    `*:0-1` keeps stages 0 and 1 of every pipeline; `2:*,3:*` pipelines 2 and 3."""
    patterns = []
    for part in text.split(","):
        pipe, colon, stage = part.strip().partition(":")
        if not colon:
            raise SchedcompError(f"--workers {text!r}: each pattern is D:S, with * or a-b for either, e.g. *:0-1")
        patterns.append((_span(pipe, text), _span(stage, text)))

    def keep(w: Worker) -> bool:
        return any(p[0] <= w.pipeline <= p[1] and s[0] <= w.stage <= s[1] for p, s in patterns)

    return keep


def _span(side: str, text: str) -> tuple[float, float]:
    side = side.strip()
    if side == "*":
        return (0, float("inf"))
    low, dash, high = side.partition("-")
    try:
        a = int(low)
        b = int(high) if dash else a
    except ValueError:
        raise SchedcompError(f"--workers {text!r}: {side!r} is not a number, a range a-b or *") from None
    if a < 0 or b < a:
        raise SchedcompError(f"--workers {text!r}: {side!r} is not a range of non-negative numbers")
    return (a, b)
