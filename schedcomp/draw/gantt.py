"""A Gantt chart of timelines with matplotlib, to PNG or SVG (one panel per timeline).

Built on `matplotlib.figure.Figure` directly (no pyplot), so nothing global such as the
backend is touched and it works headless.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from schedcomp import fileio
from schedcomp.draw.style import BLOCKING, CATEGORIES, category, label
from schedcomp.errors import SchedcompError
from schedcomp.timeline import Span
from schedcomp.topology import Worker

_FORMATS = {".png": "png", ".svg": "svg"}


@dataclass(frozen=True)
class Panel:
    """One timeline to draw: its title, spans (already filtered to the iterations to show) and time unit."""

    title: str
    spans: Sequence[Span]
    unit: str = "cost-model units"


def draw_gantt(panels: Sequence[Panel], path: str | Path, title: str = "", dpi: int = 150) -> None:
    """Draw `panels` one above the other and save to `path` (.png or .svg)."""
    path = Path(path)
    fmt = _FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise SchedcompError(f"cannot draw {path}: give a file name ending in .png or .svg")
    from matplotlib.figure import Figure  # imported here: matplotlib is slow to import and only drawing needs it

    rows = [len({s.worker for s in p.spans}) or 1 for p in panels]
    row_in = 0.36 if max(rows) <= 16 else max(0.12, 6.0 / max(rows))
    heights = [1.3 + r * row_in for r in rows]
    fig = Figure(figsize=(14, sum(heights) + (0.5 if title else 0.2)), dpi=dpi, layout="constrained")
    axes = fig.subplots(len(panels), 1, squeeze=False, height_ratios=heights)[:, 0]
    present: set[str] = set()
    for ax, panel in zip(axes, panels, strict=True):
        present |= _draw_panel(fig, ax, panel, row_in)
    handles = [_patch(cat) for cat in CATEGORIES if cat in present]
    if "rerouted" in present:
        from matplotlib.patches import Patch

        handles.append(Patch(facecolor="#9d9d9d", edgecolor="white", hatch="///", label="re-routed micro-batch"))
    if handles:
        fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), frameon=False, fontsize=9)
    if title:
        fig.suptitle(title, fontsize=11)
    buffer = io.BytesIO()  # rendered in memory, then written atomically: a failure leaves the old file whole
    fig.savefig(buffer, format=fmt)
    fileio.write_atomic(path, buffer.getvalue(), SchedcompError)


def _patch(cat: str):
    from matplotlib.patches import Patch

    name, colour, _ = CATEGORIES[cat]
    return Patch(facecolor=colour, edgecolor="white", label=name)


def _draw_panel(fig, ax, panel: Panel, row_in: float) -> set[str]:
    workers: list[Worker] = sorted({s.worker for s in panel.spans})
    ax.set_title(panel.title, loc="left", fontsize=10)
    if not workers:
        ax.text(0.5, 0.5, "nothing to draw", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return set()
    row = {w: k for k, w in enumerate(workers)}
    # Sends span their transfer (post to arrival); receives only wait for one, so they are not drawn.
    bars: dict[str, dict[int, list[tuple[float, float]]]] = {}
    for s in panel.spans:
        cat = category(s.instruction)
        if cat == "LOAD" or s.end <= s.start or (cat == "comm" and s.instruction.kind.value.startswith("RECV")):
            continue
        bars.setdefault(cat, {}).setdefault(row[s.worker], []).append((s.start, s.end - s.start))
    t0 = min(s.start for s in panel.spans)
    t1 = max(s.end for s in panel.spans)
    # White edges separate neighbouring ops; on bars a few pixels wide they would hide the colours.
    px_per_unit = fig.get_size_inches()[0] * fig.dpi * 0.86 / max(t1 - t0, 1e-12)
    compute = [d for cat in BLOCKING for items in bars.get(cat, {}).values() for _, d in items]
    edge = "white" if compute and sorted(compute)[len(compute) // 2] * px_per_unit >= 6 else "none"
    for cat, by_row in bars.items():
        colour = CATEGORIES[cat][1]
        for r, items in by_row.items():
            if cat in BLOCKING:
                ax.broken_barh(items, (r - 0.36, 0.72), facecolors=colour, edgecolors=edge, linewidth=0.6)
            else:  # transfers run beside the stream: a thin lane under the row
                ax.broken_barh(items, (r + 0.38, 0.1), facecolors=colour, edgecolors="none")
    # Ops re-routed from another pipeline (after a failure) are hatched over their colour.
    rerouted: dict[int, list[tuple[float, float]]] = {}
    for s in panel.spans:
        op = s.instruction.op
        if s.instruction.is_compute and op is not None and op.pipeline != s.worker.pipeline and s.end > s.start:
            rerouted.setdefault(row[s.worker], []).append((s.start, s.end - s.start))
    for r, items in rerouted.items():
        ax.broken_barh(items, (r - 0.36, 0.72), facecolors="none", edgecolors="white", hatch="///", linewidth=0)
    if rerouted:
        bars["rerouted"] = {}
    ax.set_xlim(t0, t1 + (t1 - t0) * 0.005)
    ax.set_ylim(len(workers) - 0.45, -0.55)
    ax.set_yticks(range(len(workers)), [f"worker {w}" for w in workers], fontsize=8 if len(workers) <= 32 else 5)
    ax.set_xlabel(f"time ({panel.unit})", fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(axis="x", color="#e6e6e6", linewidth=0.6)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    _labels(fig, ax, panel.spans, row, t0, t1, row_in)
    return set(bars)


def _labels(fig, ax, spans: Sequence[Span], row: dict[Worker, int], t0: float, t1: float, row_in: float) -> None:
    """Label the bars wide enough to hold their text, in black or white for contrast."""
    fig_w_in = fig.get_size_inches()[0]
    axis_px = fig_w_in * fig.dpi * 0.86  # the axes take most of the width
    px_per_unit = axis_px / max(t1 - t0, 1e-12)
    largest = max(5.5, min(8.5, row_in * 72 * 0.42))
    sizes = [x for x in (largest, largest - 1, largest - 2) if x >= 5.5]

    def fits(text: str, room_px: float, size: float) -> bool:  # about 0.58 em a character, a little margin
        return (len(text) * 0.58 + 0.4) * size * fig.dpi / 72 <= room_px

    items = [(s, label(s), (s.end - s.start) * px_per_unit) for s in spans if category(s.instruction) in BLOCKING]
    compute = [(text, room) for s, text, room in items if s.instruction.is_compute]
    # One size for the panel: the largest at which every compute op's label fits, else the smallest.
    size = next((x for x in sizes if all(fits(t, r, x) for t, r in compute)), sizes[-1])
    for s, text, room in items:
        if fits(text, room, size):
            ax.text((s.start + s.end) / 2, row[s.worker], text, ha="center", va="center", fontsize=size,
                    color=_ink(CATEGORIES[category(s.instruction)][1]), clip_on=True)


def _ink(colour: str) -> str:
    r, g, b = (int(colour[k : k + 2], 16) / 255 for k in (1, 3, 5))
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.55 else "white"
