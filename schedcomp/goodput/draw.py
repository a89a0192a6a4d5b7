"""Goodput over time, one line per strategy, above the failure timeline (matplotlib, PNG or SVG).

Built on `matplotlib.figure.Figure` directly (no pyplot), as `schedcomp.draw.gantt` is, so it works
headless and touches no global state; the file is written atomically (`fileio.write_atomic`).
"""

from __future__ import annotations

import io
from pathlib import Path

from schedcomp.errors import SchedcompError
from schedcomp.fileio import write_atomic
from schedcomp.goodput.model import GoodputResult

_FORMATS = {".png": "png", ".svg": "svg"}
_DAY = 86400.0


def draw_goodput(result: GoodputResult, path: str | Path, title: str = "", dpi: int = 130) -> None:
    """Useful iterations so far, as a fraction of the fault-free job's, per strategy; failures below."""
    path = Path(path)
    fmt = _FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise SchedcompError(f"cannot draw {path}: give a file name ending in .png or .svg")
    from matplotlib.figure import Figure  # imported here: slow to import, and only drawing needs it

    fig = Figure(figsize=(11, 6), dpi=dpi, layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(4, 1))
    for run in result.runs:
        days = [t / _DAY for t, _ in run.series[1:]]
        share = [done * result.iteration_s / t for t, done in run.series[1:]]  # of the fault-free job so far
        top.plot(days, share, label=f"{run.strategy} ({run.relative_goodput:.1%})", linewidth=1.2)
    top.set_ylabel("goodput so far / fault-free")
    top.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    top.grid(alpha=0.3)
    if title:
        top.set_title(title)
    changes = sorted([(f.time, len(f.workers)) for f in result.failures]
                     + [(f.time + f.down, -len(f.workers)) for f in result.failures])
    times, down, now = [0.0], [0], 0
    for t, delta in changes:
        now += delta
        times.append(t / _DAY)
        down.append(now)
    bottom.step([*times, result.duration_s / _DAY], [*down, now], where="post", color="#e15759")
    bottom.plot([f.time / _DAY for f in result.failures], [0] * len(result.failures), "|", color="#333333")
    bottom.set_ylabel("workers down")
    bottom.set_xlabel("days (ticks: failures)")
    bottom.set_xlim(0, result.duration_s / _DAY)
    buffer = io.BytesIO()
    fig.savefig(buffer, format=fmt)
    write_atomic(path, buffer.getvalue())
