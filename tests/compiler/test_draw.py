"""Drawings: terminal timeline, Gantt chart files, Chrome traces written and read back."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from schedcomp.compiler import compile
from schedcomp.costs import CostModel
from schedcomp.draw import (
    Panel,
    draw_gantt,
    read_chrome_trace,
    render_legend,
    render_summary,
    render_timeline,
    to_chrome_trace,
    write_chrome_trace,
)
from schedcomp.errors import PlanFormatError, SchedcompError
from schedcomp.simulator import simulate
from schedcomp.timeline import timeline_metrics
from schedcomp.topology import Worker

ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture(scope="module")
def zb_h1():
    return simulate(compile(4, microbatches=8, schedule="zb-h1"), iterations=3)


def test_terminal_timeline_has_a_row_per_worker_in_time_order(zb_h1):
    text = render_timeline(zb_h1.spans, width=120, title="zb-h1")
    lines = text.splitlines()
    assert lines[0] == "zb-h1"
    rows = [line for line in lines if re.match(r"\d+:\d+ ", line)]
    assert [r.split()[0] for r in rows] == ["0:0", "0:1", "0:2", "0:3"]
    # unit ops get whole columns: every op of stage 0 appears, in stream order
    expected = [f"{s.instruction.op.kind.value}{s.instruction.op.microbatch}"
                for s in zb_h1.spans_of(Worker(0, 0), 0) if s.instruction.is_compute]
    assert re.findall(r"[FBW]+\d+", rows[0]) == expected
    # the warm-up bubble of the last stage shows as idle columns before its first forward
    assert rows[3].split(maxsplit=1)[1].startswith("...")
    assert all(len(r) <= 120 for r in rows)
    assert "\x1b[" not in text


def test_terminal_timeline_colours_only_when_asked(zb_h1):
    plain = render_timeline(zb_h1.spans, width=100)
    coloured = render_timeline(zb_h1.spans, width=100, color=True)
    assert "\x1b[30;44m" in coloured  # forward: blue background
    assert ANSI.sub("", coloured) == plain
    assert "\x1b[" in render_legend(color=True) and "\x1b[" not in render_legend()


def test_narrow_terminal_folds_time_into_bands_and_keeps_every_number(zb_h1):
    text = render_timeline(zb_h1.spans, width=40)
    assert all(len(line) <= 40 for line in text.splitlines())
    rows = [line.split(maxsplit=1) for line in text.splitlines() if re.match(r"\d+:\d+ ", line)]
    assert len(rows) > 4  # several bands of the four workers
    stage0 = "".join(rest for name, rest in rows if name == "0:0")
    expected = [f"{s.instruction.op.kind.value}{s.instruction.op.microbatch}"
                for s in zb_h1.spans_of(Worker(0, 0), 0) if s.instruction.is_compute]
    assert re.findall(r"[FBW]+\d+", stage0) == expected  # whole labels in order, none cut at a band's edge


def test_several_iterations_and_an_empty_selection(zb_h1):
    two = render_timeline(zb_h1.spans, width=200, iterations=(0, 1))
    assert two.count("F0") == 2 * 4
    assert "nothing to draw" in render_timeline(zb_h1.spans, iterations=(9,))


def test_summary_names_the_metrics(zb_h1):
    text = render_summary({**zb_h1.summary(), "family": "zb-h1"}, "summary")
    assert "period        27" in text and "11.1%" in text and "worker 0:0" in text


def test_chrome_trace_round_trips_the_spans(tmp_path, zb_h1):
    trace = to_chrome_trace(zb_h1.spans)
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(events) == len(zb_h1.spans)
    first = events[0]
    assert set(first["args"]) >= {"worker", "iteration", "index"}
    assert {e["pid"] for e in events} == {0, 1, 2, 3}  # one track per worker
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {"worker 0:0", "worker 0:1", "worker 0:2", "worker 0:3"}
    path = tmp_path / "trace.json"
    write_chrome_trace(zb_h1.spans, path)
    back = read_chrome_trace(path)
    assert len(back) == len(zb_h1.spans)
    for a, b in zip(back, zb_h1.spans, strict=True):
        assert (a.worker, a.iteration, a.index, a.instruction) == (b.worker, b.iteration, b.index, b.instruction)
        assert a.start == pytest.approx(b.start) and a.end == pytest.approx(b.end)
    assert timeline_metrics(back).period == pytest.approx(zb_h1.period)


def test_chrome_trace_keeps_its_time_unit(tmp_path, zb_h1):
    path = tmp_path / "ms.json"
    write_chrome_trace(zb_h1.spans, path, seconds_per_unit=1e-3)
    data = json.loads(path.read_text())
    f = next(e for e in data["traceEvents"] if e["ph"] == "X" and e["args"]["instruction"] == "F1.0")
    assert f["dur"] == pytest.approx(1000.0)  # one unit = 1 ms = 1000 us
    assert read_chrome_trace(data)[0].end == pytest.approx(zb_h1.spans[0].end)


@pytest.mark.parametrize("content", [
    "not json", "[]", "{}", '{"traceEvents": 3}', '{"traceEvents": [{"ph": "X", "name": "x"}]}',
    '{"traceEvents": [{"ph": "X", "ts": 0, "args": {"worker": "zero", "iteration": 0, "index": 0}}]}',
    '{"traceEvents": [{"ph": "X", "ts": 0, "args": {"worker": "0:0", "iteration": -1, "index": 0, '
    '"instruction": "F0.0"}}]}',
    '{"traceEvents": [{"ph": "X", "args": {"worker": "0:0", "iteration": 0, "index": 0, "instruction": "F0.0"}}]}',
    '{"traceEvents": [], "otherData": {"seconds_per_unit": 0}}',
])
def test_bad_traces_are_plan_format_errors(tmp_path, content):
    path = tmp_path / "t.json"
    path.write_text(content)
    with pytest.raises(PlanFormatError) as info:
        read_chrome_trace(path)
    assert "\n" not in str(info.value)
    with pytest.raises(PlanFormatError):
        read_chrome_trace(tmp_path / "missing.json")


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_gantt_chart_files(tmp_path, zb_h1, suffix):
    path = tmp_path / f"chart{suffix}"
    measured = [dataclasses.replace(s, start=s.start * 2e-3, end=s.end * 2e-3) for s in zb_h1.spans]
    draw_gantt([Panel("planned", zb_h1.spans_of(Worker(0, 0)) + zb_h1.spans_of(Worker(0, 1))),
                Panel("measured", measured, "s")], path, title="two panels")
    data = path.read_bytes()
    if suffix == ".png":
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        text = data.decode()
        assert "<svg" in text and "forward" in text and "measured" in text
        assert "F0" in text  # ops are labelled
    with pytest.raises(SchedcompError, match=r"\.png or \.svg"):
        draw_gantt([Panel("x", zb_h1.spans)], tmp_path / "chart.pdf")


def test_gantt_of_a_large_plan_and_of_nothing(tmp_path):
    # 16 stages, 768 labelled boxes (labels cost most of the drawing time: kept to what shows it)
    sim = simulate(compile(16, microbatches=16, schedule="zb-h1", costs=CostModel.uniform(16, p2p=0.1)),
                   iterations=1)
    draw_gantt([Panel("zb-h2", sim.spans)], tmp_path / "big.png")
    draw_gantt([Panel("empty", [])], tmp_path / "empty.png")
    assert (tmp_path / "big.png").stat().st_size > 10_000 and (tmp_path / "empty.png").exists()
