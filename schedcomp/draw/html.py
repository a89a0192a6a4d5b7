"""An interactive timeline in one self-contained HTML file (no network): `schedcomp show PLAN --html out.html`.

The page holds the `GanttLayout` of each panel as JSON and a small script that draws it as SVG:
hovering a box shows its op, worker, home pipeline, start and end; the wheel zooms time around the
pointer, dragging pans, a double click resets. With `--measured TRACE` the measured run is a second
panel under the planned one. Opened as `out.html#selftest`, the page exercises itself (hover, zoom,
pan) and writes what it saw into `<pre id="selftest">`, which `tests/browser/check_html.py` reads
from a headless Chromium.
"""

from __future__ import annotations

import html
import json
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path

from schedcomp import fileio
from schedcomp.draw.gantt import Panel
from schedcomp.draw.layout import GanttLayout, gantt_layout
from schedcomp.draw.style import CATEGORIES
from schedcomp.errors import SchedcompError
from schedcomp.topology import Worker


def render_html(panels: Sequence[Panel], title: str = "", keep: Callable[[Worker], bool] | None = None) -> str:
    """The page's text (see the module docstring)."""
    data = {
        "title": title,
        "categories": {cat: [name, colour] for cat, (name, colour, _) in CATEGORIES.items()},
        "panels": [_panel_data(p, gantt_layout(p.spans, p.failed, keep)) for p in panels],
    }
    # `</` is escaped so no string in the data can close the script element.
    payload = json.dumps(data, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")
    template = resources.files("schedcomp.draw").joinpath("timeline.html").read_text(encoding="utf-8")
    return (template.replace("{{TITLE}}", html.escape(title or "schedcomp timeline"))
            .replace("{{DATA}}", payload))


def write_html(panels: Sequence[Panel], path: str | Path, title: str = "",
               keep: Callable[[Worker], bool] | None = None) -> None:
    """Write the page atomically (a failed write leaves the old file whole)."""
    fileio.write_atomic(path, render_html(panels, title, keep), SchedcompError)


def _panel_data(panel: Panel, lay: GanttLayout) -> dict:
    return {
        "title": panel.title,
        "unit": panel.unit,
        "t0": lay.t0,
        "t1": lay.t1,
        "rows": [{"name": str(r.worker), "failed": r.failed} for r in lay.rows],
        # One array per box keeps the file small: row, start, end, category, label, instruction,
        # home pipeline (-1: none), re-routed, iteration.
        "boxes": [[b.row, b.start, b.end, b.category, b.label, b.instruction,
                   -1 if b.home is None else b.home, b.rerouted, b.iteration] for b in lay.boxes],
    }
