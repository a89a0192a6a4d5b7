"""What the Gantt views say: labelled boxes, failed rows, SVG text, the HTML view, the terminal at dp > 1."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from schedcomp.compiler import compile
from schedcomp.draw import Panel, draw_gantt, render_legend, render_timeline
from schedcomp.draw.html import render_html
from schedcomp.draw.layout import gantt_layout, parse_worker_filter
from schedcomp.draw.terminal import has_rerouted, legend_categories
from schedcomp.errors import SchedcompError
from schedcomp.simulator import simulate
from schedcomp.topology import Worker

FAILED = Worker(1, 2)


@pytest.fixture(scope="module")
def failure():
    plan = compile(4, dp=2, microbatches=8, failed=[FAILED], solver="greedy")
    return plan, simulate(plan, iterations=1)


def test_layout_labels_every_box_and_names_its_home_pipeline(failure):
    plan, sim = failure
    lay = gantt_layout(sim.spans, plan.topology.failed)
    compute = [b for b in lay.boxes if b.category in ("F", "B", "W", "BW")]
    assert len(compute) == sum(1 for s in sim.spans if s.instruction.is_compute)
    for b in compute:
        kind, mb, home = re.fullmatch(r"([FBW]+)(\d+)(?:\.(\d+))?", b.label).groups()
        assert b.instruction.startswith(kind + mb + ".")
        assert b.rerouted == (b.home != b.worker.pipeline)
        assert (home is not None) == b.rerouted and (home is None or int(home) == b.home)
    rerouted = [b for b in compute if b.rerouted]
    # the failed worker's micro-batches: every one of pipeline 1's, on stage 2, run by pipeline 0
    assert {b.worker for b in rerouted} == {Worker(0, 2)} and {b.home for b in rerouted} == {1}
    assert sorted(int(b.label[1:].split(".")[0]) for b in rerouted if b.category == "F") == list(range(8))


def test_layout_has_a_crossed_row_for_the_failed_worker_grouped_by_stage(failure):
    plan, sim = failure
    lay = gantt_layout(sim.spans, plan.topology.failed)
    assert [r.worker for r in lay.rows] == sorted(
        [*plan.workers, FAILED], key=lambda w: (w.stage, w.pipeline))
    failed = [r for r in lay.rows if r.failed]
    assert [r.worker for r in failed] == [FAILED] and failed[0].name == "1:2 failed"
    assert not any(b.worker == FAILED for b in lay.boxes) and lay.has_failed and lay.has_rerouted


def test_worker_filter_keeps_the_rows_asked_for(failure):
    plan, sim = failure
    lay = gantt_layout(sim.spans, plan.topology.failed, parse_worker_filter("*:2-3"))
    assert [r.name for r in lay.rows] == ["0:2", "1:2 failed", "0:3", "1:3"]
    only = gantt_layout(sim.spans, plan.topology.failed, parse_worker_filter("0:*,1:0"))
    assert {r.worker for r in only.rows} == {Worker(0, s) for s in range(4)} | {Worker(1, 0)}
    for bad in ("0", "x:1", "2-1:0", ":"):
        with pytest.raises(SchedcompError, match="--workers"):
            parse_worker_filter(bad)


def test_svg_keeps_text_as_text_with_labels_and_legend(tmp_path, failure):
    plan, sim = failure
    path = tmp_path / "fail.svg"
    draw_gantt([Panel("with a failure", sim.spans, failed=frozenset(plan.topology.failed))], path)
    svg = path.read_text()
    texts = [re.sub(r"<[^>]+>", "", t).strip() for t in re.findall(r"<text\b.*?</text>", svg, re.S)]
    assert "F0.1" in texts and "F0" in texts  # a re-routed op names its home pipeline
    assert "1:2 failed" in texts and any("1:2 failed" in t and "re-routed" in t for t in texts)
    assert "failed worker" in texts and any(t.startswith("re-routed") for t in texts)
    assert "forward" in texts and "all-reduce" not in texts  # the legend lists the kinds drawn only


def test_png_of_a_failure_plan(tmp_path, failure):
    plan, sim = failure
    path = tmp_path / "fail.png"
    draw_gantt([Panel("with a failure", sim.spans, failed=frozenset(plan.topology.failed))], path,
               keep=parse_worker_filter("*:1-2"))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_html_is_one_self_contained_file_with_every_box(failure):
    plan, sim = failure
    planned = Panel("planned", sim.spans, failed=frozenset(plan.topology.failed))
    measured = Panel("measured", sim.spans, "ms", failed=frozenset(plan.topology.failed))
    page = render_html([planned, measured], title="t </script> & <b>")
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)  # nothing fetched from a network
    assert page.count("</script>") == 2 and "<title>t &lt;/script&gt; &amp; &lt;b&gt;</title>" in page
    data = json.loads(re.search(r'<script id="data" type="application/json">(.*?)</script>', page, re.S)
                      .group(1).replace("<\\/", "</"))
    assert data["title"] == "t </script> & <b>"
    assert [p["title"] for p in data["panels"]] == ["planned", "measured"]
    assert [p["unit"] for p in data["panels"]] == ["cost-model units", "ms"]
    lay = gantt_layout(sim.spans, plan.topology.failed)
    assert len(data["panels"][0]["boxes"]) == len(lay.boxes)
    assert {"name": "1:2", "failed": True} in data["panels"][0]["rows"]
    assert any(b[4] == "F0.1" and b[6] == 1 and b[7] for b in data["panels"][0]["boxes"])


def test_terminal_at_dp2_numbers_every_op_and_keys_only_the_kinds_drawn(failure):
    plan, sim = failure
    text = render_timeline(sim.spans, width=100, failed=plan.topology.failed)
    assert all(len(line) <= 100 for line in text.splitlines())
    names = [line.split()[0] for line in text.splitlines() if re.match(r"\d+:\d+ ", line)]
    assert names[:8] == ["0:0", "1:0", "0:1", "1:1", "0:2", "1:2", "0:3", "1:3"]  # by stage, the failed one too
    failed_rows = [line for line in text.splitlines() if line.startswith("1:2 ")]
    assert failed_rows and all(re.fullmatch(r"1:2\s+failed x+", line) for line in failed_rows)
    row = "".join(line.split(maxsplit=1)[1] for line in text.splitlines() if line.startswith("0:2 "))
    expected = [f"{s.instruction.op.kind.value}{s.instruction.op.microbatch}"
                + (f".{s.instruction.op.pipeline}" if s.instruction.op.pipeline != 0 else "")
                for s in sim.spans_of(Worker(0, 2), 0) if s.instruction.is_compute]
    assert re.findall(r"[FBW]+\d+(?:\.\d+)?", row) == expected
    legend = render_legend(False, legend_categories(sim.spans), rerouted=has_rerouted(sim.spans))
    assert "F forward" in legend and "AR" not in legend and "OPT" not in legend and "BW" not in legend
    assert "F3.1 micro-batch 3 of pipeline 1" in legend


CHECK = Path(__file__).resolve().parents[1] / "browser" / "check_html.py"


@pytest.mark.slow
def test_html_view_in_a_headless_browser(tmp_path):
    """The page's self-test (hover, zoom, pan, reset) run by Chromium; skipped where it is not installed."""
    done = subprocess.run([sys.executable, str(CHECK), str(tmp_path)], capture_output=True, text=True,
                          timeout=240)
    if done.returncode == 77:
        pytest.skip(done.stdout.strip())
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout[: done.stdout.rindex("}") + 1])
    assert all(result["checks"].values()) and "re-routed here" in result["tooltip"]
    assert (tmp_path / "page.png").stat().st_size > 10_000
