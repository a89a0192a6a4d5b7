"""A Gantt chart of timelines with matplotlib, to PNG or SVG (one panel per timeline).

Every compute box is labelled (`F3`; `F3.1` when micro-batch 3 of pipeline 1 was re-routed here, also
hatched), failed workers are crossed-out rows, and rows are grouped by stage (see `layout`). The figure
widens until labels fit, and grows a row at a time, so plans of 64+ workers stay legible; `keep`
(`schedcomp show --workers`) draws a subset.

Built on `matplotlib.figure.Figure` directly (no pyplot), so nothing global such as the
backend is touched and it works headless.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from schedcomp import fileio
from schedcomp.draw.layout import GanttLayout, gantt_layout
from schedcomp.draw.style import BLOCKING, CATEGORIES
from schedcomp.errors import SchedcompError
from schedcomp.timeline import Span
from schedcomp.topology import Worker

_FORMATS = {".png": "png", ".svg": "svg"}


@dataclass(frozen=True)
class Panel:
    """One timeline to draw: its title, spans (already filtered to the iterations to show), time unit and
    the failed workers (drawn as crossed-out rows)."""

    title: str
    spans: Sequence[Span]
    unit: str = "cost-model units"
    failed: frozenset[Worker] = frozenset()


_LABEL_PT = 6.0  # the smallest label size
_WIDTH_PT = 7.0  # the figure widens (up to _MAX_WIDTH_IN) until every compute label fits at this size
_MAX_WIDTH_IN = 40.0
_ROW_IN = 0.26  # at least this tall a row: 64 workers make a 17-inch chart, still readable
_FAILED = "#c0392b"
_REROUTED_HATCH = "////"
_AXES_SHARE = 0.86  # the axes take most of the figure's width
COMPUTE = ("F", "B", "W", "BW")


def draw_gantt(
    panels: Sequence[Panel],
    path: str | Path,
    title: str = "",
    dpi: int = 150,
    keep: Callable[[Worker], bool] | None = None,
) -> None:
    """Draw `panels` one above the other and save to `path` (.png or .svg; SVG text stays text).

    `keep` selects the workers drawn (see `layout.parse_worker_filter`)."""
    path = Path(path)
    fmt = _FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise SchedcompError(f"cannot draw {path}: give a file name ending in .png or .svg")
    import matplotlib  # imported here: matplotlib is slow to import and only drawing needs it
    from matplotlib.figure import Figure

    layouts = [gantt_layout(p.spans, p.failed, keep) for p in panels]
    rows = [len(lay.rows) or 1 for lay in layouts]
    row_in = 0.36 if max(rows) <= 16 else _ROW_IN
    heights = [1.3 + r * row_in for r in rows]
    width = max([14.0, *(_width_for_labels(lay) for lay in layouts)])
    fig = Figure(figsize=(width, sum(heights) + (0.5 if title else 0.2)), dpi=dpi, layout="constrained")
    axes = fig.subplots(len(panels), 1, squeeze=False, height_ratios=heights)[:, 0]
    for ax, panel, lay in zip(axes, panels, layouts, strict=True):
        _draw_panel(fig, ax, panel, lay, row_in)
    handles = _legend(layouts)
    if handles:
        fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 5), frameon=False,
                   fontsize=9)
    if title:
        fig.suptitle(title, fontsize=11)
    buffer = io.BytesIO()  # rendered in memory, then written atomically: a failure leaves the old file whole
    with matplotlib.rc_context({"svg.fonttype": "none"}):  # SVG text as <text>: selectable and searchable
        fig.savefig(buffer, format=fmt)
    fileio.write_atomic(path, buffer.getvalue(), SchedcompError)


def _width_for_labels(lay: GanttLayout) -> float:
    """Inches of figure the narrowest compute box needs to hold its label at _WIDTH_PT (capped)."""
    span = lay.t1 - lay.t0
    need = [_text_in(b.label, _WIDTH_PT) * span / ((b.end - b.start) * _AXES_SHARE)
            for b in lay.boxes if b.category in COMPUTE]
    return min(_MAX_WIDTH_IN, max(need, default=0.0))


def _text_in(text: str, size: float) -> float:
    """About 0.58 em a character, a little margin."""
    return (len(text) * 0.58 + 0.4) * size / 72


def _legend(layouts: Sequence[GanttLayout]) -> list:
    from matplotlib.patches import Patch

    present = set().union(*(lay.categories for lay in layouts))
    handles = [Patch(facecolor=CATEGORIES[cat][1], edgecolor="white", label=CATEGORIES[cat][0])
               for cat in CATEGORIES if cat in present]
    if any(lay.has_rerouted for lay in layouts):
        handles.append(Patch(facecolor="#9d9d9d", edgecolor="white", hatch=_REROUTED_HATCH,
                             label="re-routed: F3.1 = micro-batch 3 of pipeline 1"))
    if any(lay.has_failed for lay in layouts):
        handles.append(Patch(facecolor="#f4f4f4", edgecolor=_FAILED, hatch="xx", label="failed worker"))
    return handles


def _draw_panel(fig, ax, panel: Panel, lay: GanttLayout, row_in: float) -> None:
    ax.set_title(panel.title, loc="left", fontsize=10)
    if not lay.rows:
        ax.text(0.5, 0.5, "nothing to draw", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    t0, t1 = lay.t0, max(lay.t1, lay.t0 + 1e-12)
    # White edges separate neighbouring ops; on bars a few pixels wide they would hide the colours.
    px_per_unit = fig.get_size_inches()[0] * fig.dpi * _AXES_SHARE / (t1 - t0)
    compute = sorted(b.end - b.start for b in lay.boxes if b.category in COMPUTE)
    edge = "white" if compute and compute[len(compute) // 2] * px_per_unit >= 6 else "none"
    bars: dict[tuple[str, bool], dict[int, list[tuple[float, float]]]] = {}
    for b in lay.boxes:
        bars.setdefault((b.category, b.rerouted), {}).setdefault(b.row, []).append((b.start, b.end - b.start))
    for (cat, rerouted), by_row in bars.items():
        colour = CATEGORIES[cat][1]
        for r, items in by_row.items():
            if cat in BLOCKING:
                ax.broken_barh(items, (r - 0.36, 0.72), facecolors=colour, edgecolors=edge, linewidth=0.6)
                if rerouted:  # hatched along its top and bottom edges, leaving the label in the middle clear
                    for y in (r - 0.36, r + 0.18):
                        ax.broken_barh(items, (y, 0.18), facecolors="none", edgecolors="#ffffffc0",
                                       hatch=_REROUTED_HATCH, linewidth=0)
            else:  # transfers run beside the stream: a thin lane under the row
                ax.broken_barh(items, (r + 0.38, 0.1), facecolors=colour, edgecolors="none")
    for r, row in enumerate(lay.rows):
        if row.failed:  # crossed out over the whole time axis: it runs nothing
            ax.broken_barh([(t0, t1 - t0)], (r - 0.36, 0.72), facecolors="#f4f4f4", edgecolors=_FAILED,
                           hatch="xx", linewidth=0.8)
            ax.text((t0 + t1) / 2, r, f"worker {row.worker} failed: its micro-batches are re-routed",
                    ha="center", va="center", fontsize=8, color=_FAILED,
                    bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.5})
    stages = [row.worker.stage for row in lay.rows]
    for r in range(1, len(stages)):
        if stages[r] != stages[r - 1] and len(stages) > len(set(stages)):  # a rule between stage groups
            ax.axhline(r - 0.5, color="#b0b0b0", linewidth=0.6)
    ax.set_xlim(t0, t1 + (t1 - t0) * 0.005)
    ax.set_ylim(len(lay.rows) - 0.45, -0.55)
    ax.set_yticks(range(len(lay.rows)), [row.name for row in lay.rows],
                  fontsize=8 if len(lay.rows) <= 32 else 6)
    for tick, row in zip(ax.get_yticklabels(), lay.rows, strict=True):
        if row.failed:
            tick.set_color(_FAILED)
    ax.set_ylabel("worker (pipeline:stage), by stage" if len(stages) > len(set(stages)) else "worker", fontsize=8)
    ax.set_xlabel(f"time ({panel.unit})", fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(axis="x", color="#e6e6e6", linewidth=0.6)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    _labels(ax, lay, px_per_unit, fig.dpi, row_in)


def _labels(ax, lay: GanttLayout, px_per_unit: float, dpi: float, row_in: float) -> None:
    """Label each box in black or white for contrast: its whole label where it fits, else its micro-batch
    (and home pipeline) without the kind, which its colour already shows."""
    largest = max(_LABEL_PT, min(8.5, row_in * 72 * 0.42))
    sizes = [*(x for x in (largest, largest - 1, largest - 2) if x > _LABEL_PT), _LABEL_PT]

    def fits(text: str, room_px: float, size: float) -> bool:
        return _text_in(text, size) * dpi <= room_px

    items = [(b, (b.end - b.start) * px_per_unit) for b in lay.boxes if b.on_stream]
    compute = [(b.label, room) for b, room in items if b.category in COMPUTE]
    # One size for the panel: the largest at which every compute op's label fits, else the smallest.
    size = next((x for x in sizes if all(fits(t, r, x) for t, r in compute)), sizes[-1])
    for b, room in items:
        text = b.label if fits(b.label, room, size) else b.label.lstrip("FBW")
        if fits(text, room, size):
            ax.text((b.start + b.end) / 2, b.row, text, ha="center", va="center", fontsize=size,
                    color=_ink(CATEGORIES[b.category][1]), clip_on=True, in_layout=False)


def _ink(colour: str) -> str:
    r, g, b = (int(colour[k : k + 2], 16) / 255 for k in (1, 3, 5))
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.55 else "white"
