"""A timeline in the terminal: one row per worker, time across, ops labelled and coloured by kind."""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

from schedcomp.draw.style import BLOCKING, CATEGORIES, category, label
from schedcomp.memory import format_bytes
from schedcomp.timeline import Span
from schedcomp.topology import Worker

_RESET = "\x1b[0m"
_IDLE = "."
_SHORT = {"F": "F", "B": "B", "W": "W", "BW": "BW", "ALLREDUCE": "AR", "STEP": "OPT"}


_MAX_BANDS = 8
"""At most this many bands of rows: past that, ops too short for their label show their kind only."""


def render_timeline(
    spans: Iterable[Span],
    width: int = 100,
    color: bool = False,
    iterations: Sequence[int] | None = (0,),
    workers: Sequence[Worker] | None = None,
    title: str = "",
    unit: str = "",
    failed: Collection[Worker] = (),
) -> str:
    """The blocking instructions (compute, ALLREDUCE, STEP) of `iterations` (None: all), one row per worker,
    rows grouped by stage; each of the `failed` workers is a row of `x` among its stage's peers.

    `width` is the whole line, worker column included; `color` adds ANSI backgrounds by kind
    (use it only on a TTY). Sends and receives run beside the stream and are not drawn. Each op shows
    its label (`F3`, or `F3.1` for micro-batch 3 of pipeline 1 re-routed here): when the labels need
    more columns than `width`, time is folded into bands of rows, one under the other (at most
    _MAX_BANDS; past that, ops too short for their label show only their kind).
    """
    shown = [s for s in spans if (iterations is None or s.iteration in iterations)]
    live = set(workers) if workers is not None else {s.worker for s in shown}
    rows = sorted(live | set(failed), key=lambda w: (w.stage, w.pipeline))
    blocking = [s for s in shown if category(s.instruction) in BLOCKING]
    lines = [title] if title else []
    if not blocking:
        lines.append("(nothing to draw)")
        return "\n".join(lines) + "\n"
    t0 = min(s.start for s in shown)
    t1 = max(s.end for s in blocking)
    name_width = max(len(str(w)) for w in rows) + 2
    cols = max(10, width - name_width)
    scale, total = _scale(blocking, t0, t1, cols)
    grid = {w: [(_IDLE, "")] * total for w in rows}  # (character, category) per column
    for w in failed:
        grid[w] = [(ch, "") for ch in _failed_row(total, cols)]
    for s in sorted(blocking, key=lambda x: x.start):
        a, b = round((s.start - t0) * scale), round((s.end - t0) * scale)
        if b <= a:
            if s.end <= s.start:
                continue  # an instant (e.g. an all-reduce of one worker) takes no room
            b = a + 1
        a, b = min(a, total - 1), min(b, total)
        cells = grid.get(s.worker)
        if cells is None or s.worker in failed:
            continue
        cat = category(s.instruction)
        # The op's widest piece (it may cross into the next band) says its label or, too short for it,
        # only its kind (a cut label such as `F1` for `F12` would read as another op); the rest is `-`.
        pieces = [(lo, min(b, (lo // cols + 1) * cols)) for lo in range(a, b) if lo == a or lo % cols == 0]
        widest = max(pieces, key=lambda p: p[1] - p[0])
        for lo, hi in pieces:
            text = label(s) if lo == widest[0] else "-" * (hi - lo)
            if len(text) > hi - lo:
                text = _SHORT[cat]
            for k, ch in enumerate(text[: hi - lo].ljust(hi - lo)):
                cells[lo + k] = (ch, cat)
    for first in range(0, total, cols):
        if first:
            lines.append("")
        band_t0 = t0 + first / scale
        lines += _ruler(band_t0, t1, scale, min(cols, total - first), name_width, unit)
        for w in rows:
            lines.append(f"{w!s:<{name_width}}" + _paint(grid[w][first : first + cols], color))
    return "\n".join(lines) + "\n"


def _failed_row(total: int, cols: int) -> str:
    """`failed xxxx...` in every band: the worker runs nothing, its peers run its micro-batches."""
    band = ("failed " + "x" * cols)[:cols]
    return (band * (total // cols + 1))[:total]


def _scale(blocking: Sequence[Span], t0: float, t1: float, cols: int) -> tuple[float, int]:
    """Columns per time unit and columns in all: whole columns per unit when that fits (unit-cost ops
    stay one width), at least as many as the compute ops' labels and a space need, in at most _MAX_BANDS."""
    span = max(t1 - t0, 1e-12)
    need = max(((len(label(s)) + 1) / (s.end - s.start) for s in blocking
                if s.instruction.is_compute and s.end > s.start), default=1.0)
    fit = cols / span  # one band
    if fit >= need:
        scale = math.floor(fit) if math.floor(fit) >= need else fit
    else:
        most = cols * _MAX_BANDS / span
        scale = min(float(math.ceil(need)), math.floor(most) if most >= 1 else most)
    return scale, min(max(1, math.ceil(span * scale)), cols * _MAX_BANDS)


def legend_categories(spans: Iterable[Span]) -> list[str]:
    """The blocking categories drawn for `spans`, in legend order (an instant, such as an all-reduce
    under the default costs, is not drawn)."""
    present = {category(s.instruction) for s in spans if s.end > s.start}
    return [cat for cat in BLOCKING if cat in present]


def has_rerouted(spans: Iterable[Span]) -> bool:
    return any(s.instruction.is_compute and s.instruction.op is not None
               and s.instruction.op.pipeline != s.worker.pipeline for s in spans)


def _paint(cells: list[tuple[str, str]], color: bool) -> str:
    if not color:
        return "".join(ch for ch, _ in cells)
    out: list[str] = []
    k = 0
    while k < len(cells):  # one escape sequence per run of one category
        cat = cells[k][1]
        end = k
        while end < len(cells) and cells[end][1] == cat:
            end += 1
        text = "".join(ch for ch, _ in cells[k:end])
        out.append(f"\x1b[30;{CATEGORIES[cat][2]}m{text}{_RESET}" if cat else f"\x1b[2m{text}{_RESET}")
        k = end
    return "".join(out)


def _ruler(t0: float, t1: float, scale: float, cols: int, indent: int, unit: str) -> list[str]:
    """Tick labels and marks every 1, 2 or 5 x 10^k time units, at least 8 columns apart."""
    span = max(t1 - t0, 1e-12)
    raw = span * 8 / cols
    base = 10 ** math.floor(math.log10(raw))
    step = next(m * base for m in (1, 2, 5, 10) if m * base >= raw)
    first = math.ceil(t0 / step) * step
    labels, marks = [" "] * (cols + 12), [" "] * cols
    t = first
    while t <= t1 + 1e-9:
        c = round((t - t0) * scale)
        if c < cols:
            marks[c] = "|"
            text = f"{t:g}"
            if all(ch == " " for ch in labels[c : c + len(text) + 1]):
                labels[c : c + len(text)] = list(text)
        t += step
    head = f"{unit:<{indent}}" if unit else " " * indent
    return [head + "".join(labels).rstrip(), " " * indent + "".join(marks).rstrip()]


def render_legend(color: bool = False, categories: Iterable[str] = BLOCKING, rerouted: bool = False) -> str:
    """The key of `categories` (give `legend_categories(spans)`: only the kinds drawn) and, with
    `rerouted`, how a re-routed op's label reads."""
    parts = []
    for cat in categories:
        name, _, ansi = CATEGORIES[cat]
        key = _SHORT.get(cat, cat)
        parts.append(f"\x1b[30;{ansi}m{key}{_RESET} {name}" if color else f"{key} {name}")
    parts.append(f"{_IDLE} idle")
    if rerouted:
        parts.append("F3.1 micro-batch 3 of pipeline 1, re-routed")
    return "legend: " + "  ".join(parts) + "\n"


def render_summary(summary: Mapping[str, Any], title: str = "") -> str:
    """The summary of `schedcomp show`: period, makespan, bubbles and memory, one fact a line."""
    def num(x: Any) -> str:
        return f"{x:.6g}" if isinstance(x, float) else str(x)

    lines = [title] if title else []
    for key, text in (("family", "schedule"), ("solver", "solver"), ("topology", "topology")):
        if summary.get(key):
            lines.append(f"  {text:<13} {summary[key]}")
    if "microbatches" in summary:
        lines.append(f"  {'micro-batches':<13} {summary['microbatches']}")
    mode = ""
    if "synchronous_optimizer" in summary:
        mode = (" with a global barrier at each optimizer step" if summary["synchronous_optimizer"]
                else " with staggered per-stage optimizer steps")
    if "period" in summary:
        lines.append(f"  {'period':<13} {num(summary['period'])}  (per iteration in steady state, over "
                     f"{summary.get('iterations', 1)} iterations{mode})")
    if "makespan" in summary:
        lines.append(f"  {'makespan':<13} {num(summary['makespan'])}  (iteration 0, first start to last end)")
    if "bubble_ratio" in summary:
        lines.append(f"  {'bubble':<13} {summary['bubble_ratio']:.1%} of worker time idle")
    if summary.get("lower_bound") is not None:
        lines.append(f"  {'lower bound':<13} {num(summary['lower_bound'])}")
    if "peak_memory" in summary:
        memory = summary.get("memory") or {}
        worst = max(memory, key=lambda w: memory[w]) if memory else None
        where = f"  (worker {worst})" if worst is not None else ""
        limit = summary.get("memory_limit")
        unit = "bytes" if summary.get("memory_unit") == "bytes" else "activation units"
        if isinstance(limit, list):
            cap = f", limit per stage {', '.join(num(v) for v in limit)}"
        else:
            cap = f", limit {num(limit)}" if limit is not None else ""
        if summary.get("within_memory_limit") is False:
            cap += " (OVER the limit)"
        lines.append(f"  {'peak memory':<13} {num(summary['peak_memory'])} {unit}{where}{cap}")
        if summary.get("memory_note"):
            lines.append(f"  {'':<13} {summary['memory_note']}")
    return "\n".join(lines) + "\n"


def render_memory(rows: Sequence[Mapping[str, Any]], width: int = 100) -> str:
    """Planned against measured peak activation memory per worker, as pairs of bars on one scale."""
    if not rows:
        return ""
    top = max(max(r["planned"], r["measured"]) for r in rows) or 1.0
    bar = max(10, width - 40)
    lines = ["peak activation memory per worker (planned | measured)"]
    for r in rows:
        for tag, key in (("plan", "planned"), ("meas", "measured")):
            n = round(bar * r[key] / top)
            name = str(r["worker"]) if key == "planned" else ""
            flag = "  <- over plan" if key == "measured" and r["ratio"] > 1.2 else ""
            lines.append(f"  {name:>6} {tag} {'#' * n:<{bar}} {format_bytes(r[key])}{flag}")
    return "\n".join(lines) + "\n"

