"""Drawing timelines: in the terminal, as a Gantt chart (PNG/SVG), as an interactive HTML page, and as
Chrome/Perfetto traces.

Every drawing takes `Span`s, simulated (`schedcomp.simulator`) or measured (the runtime), so a
plan and a run of it are drawn alike. matplotlib is imported only when a chart is drawn.
"""

from schedcomp.draw.gantt import Panel, draw_gantt
from schedcomp.draw.html import write_html
from schedcomp.draw.layout import gantt_layout
from schedcomp.draw.terminal import render_legend, render_summary, render_timeline
from schedcomp.draw.trace import read_chrome_trace, to_chrome_trace, write_chrome_trace

__all__ = [
    "Panel",
    "draw_gantt",
    "gantt_layout",
    "read_chrome_trace",
    "render_legend",
    "render_summary",
    "render_timeline",
    "to_chrome_trace",
    "write_chrome_trace",
    "write_html",
]
