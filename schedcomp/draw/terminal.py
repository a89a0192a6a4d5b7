"""A timeline in the terminal: one row per worker, time across, ops labelled and coloured by kind."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from schedcomp.draw.style import BLOCKING, CATEGORIES, category, label
from schedcomp.memory import format_bytes
from schedcomp.timeline import Span
from schedcomp.topology import Worker

_RESET = "\x1b[0m"
_IDLE = "."
_SHORT = {"F": "F", "B": "B", "W": "W", "BW": "BW", "ALLREDUCE": "AR", "STEP": "OPT"}


def render_timeline(
    spans: Iterable[Span],
    width: int = 100,
    color: bool = False,
    iterations: Sequence[int] | None = (0,),
    workers: Sequence[Worker] | None = None,
    title: str = "",
    unit: str = "",
) -> str:
    """The blocking instructions (compute, ALLREDUCE, STEP) of `iterations` (None: all), one row per worker.

    `width` is the whole line, worker column included; `color` adds ANSI backgrounds by kind
    (use it only on a TTY). Sends and receives run beside the stream and are not drawn.
    """
    shown = [s for s in spans if (iterations is None or s.iteration in iterations)]
    rows = sorted(workers) if workers is not None else sorted({s.worker for s in shown})
    blocking = [s for s in shown if category(s.instruction) in BLOCKING]
    lines = [title] if title else []
    if not blocking:
        lines.append("(nothing to draw)")
        return "\n".join(lines) + "\n"
    t0 = min(s.start for s in shown)
    t1 = max(s.end for s in blocking)
    name_width = max(len(str(w)) for w in rows) + 2
    cols = max(10, width - name_width)
    scale = cols / (t1 - t0) if t1 > t0 else 1.0
    if scale >= 1:
        scale = math.floor(scale)  # whole columns per time unit keep unit-cost ops the same width
        cols = min(cols, math.ceil((t1 - t0) * scale))
    lines += _ruler(t0, t1, scale, cols, name_width, unit)
    placed = []
    for s in blocking:
        a, b = round((s.start - t0) * scale), round((s.end - t0) * scale)
        if b <= a:
            if s.end <= s.start:
                continue  # an instant (e.g. an all-reduce of one worker) takes no room
            b = a + 1
        placed.append((s, min(a, cols - 1), min(b, cols)))
    # Micro-batch numbers only when every op has room for its own: a mix would read as other ops.
    detailed = all(b - a >= len(label(s)) for s, a, b in placed if s.instruction.is_compute)
    grid = {w: [(_IDLE, "")] * cols for w in rows}  # (character, category) per column
    for s, a, b in sorted(placed, key=lambda x: x[0].start):
        cells = grid.get(s.worker)
        if cells is None:
            continue
        cat = category(s.instruction)
        text = (label(s) if detailed or not s.instruction.is_compute else _SHORT[cat])[: b - a].ljust(b - a)
        for k, ch in enumerate(text):
            cells[a + k] = (ch, cat)
    for w in rows:
        lines.append(f"{w!s:<{name_width}}" + _paint(grid[w], color))
    return "\n".join(lines) + "\n"


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


def render_legend(color: bool = False, categories: Iterable[str] = BLOCKING) -> str:
    parts = []
    for cat in categories:
        name, _, ansi = CATEGORIES[cat]
        key = _SHORT.get(cat, cat)
        parts.append(f"\x1b[30;{ansi}m{key}{_RESET} {name}" if color else f"{key} {name}")
    parts.append(f"{_IDLE} idle")
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

