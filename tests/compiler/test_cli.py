"""The command line: outputs, files, exit codes, one-line errors, and no torch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from schedcomp.cli import main
from schedcomp.compiler import compile
from schedcomp.draw import read_chrome_trace
from schedcomp.ir import Plan
from schedcomp.topology import Worker

SHOW = ["show", "--schedule", "zb-h1", "--pp", "4", "--microbatches", "8"]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_show_prints_a_timeline_and_a_summary(capsys):
    status, out, err = run(capsys, *SHOW, "--width", "100", "--color", "never")
    assert status == 0 and err == ""
    for w in ("0:0", "0:1", "0:2", "0:3"):
        assert f"\n{w} " in out
    assert "legend:" in out and "period        27" in out and "11.1%" in out
    assert "\x1b[" not in out  # not a TTY


def test_show_colours_on_request(capsys):
    status, out, _ = run(capsys, *SHOW, "--color", "always")
    assert status == 0 and "\x1b[30;44m" in out


@pytest.mark.parametrize(("family", "period", "bubble", "memory"), [
    ("1f1b", 33, 9 / 33, 4), ("zb-h1", 27, 3 / 27, 4), ("zb-h2", 24, 0.0, 7), ("gpipe", 33, 9 / 33, 8),
])
def test_show_json_summary(capsys, family, period, bubble, memory):
    status, out, _ = run(capsys, "show", "--schedule", family, "--pp", "4", "--microbatches", "8", "--json")
    assert status == 0
    summary = json.loads(out)
    assert summary["period"] == period and summary["peak_memory"] == memory
    assert summary["bubble_ratio"] == pytest.approx(bubble)
    assert summary["family"] == family and summary["pp"] == 4 and summary["microbatches"] == 8


def test_sync_optimizer_costs_zb_h2_its_overlap(capsys):
    _, out, _ = run(capsys, "show", "--schedule", "zb-h2", "--pp", "4", "-m", "8", "--json", "--sync-optimizer")
    assert json.loads(out)["period"] == 27


@pytest.mark.slow  # over ~5 s: make test-fast leaves it to make test
def test_show_writes_charts_and_traces_and_draws_a_measured_trace(capsys, tmp_path):
    png, svg, trace = tmp_path / "a.png", tmp_path / "a.svg", tmp_path / "a.json"
    status, _, err = run(capsys, *SHOW, "--png", str(png), "--svg", str(svg), "--trace", str(trace),
                         "--iterations", "3", "--draw-iterations", "2")
    assert status == 0, err
    assert png.read_bytes()[:4] == b"\x89PNG" and "<svg" in svg.read_text()
    spans = read_chrome_trace(trace)
    assert {s.iteration for s in spans} == {0, 1, 2}
    # the written trace stands in for a measured one
    status, out, err = run(capsys, *SHOW, "--measured", str(trace), "--json", "--png", str(png))
    assert status == 0, err
    measured = json.loads(out)["measured"]
    assert measured["period"] == pytest.approx(27) and measured["unit"] == "s"  # a unit is a second
    status, out, _ = run(capsys, *SHOW, "--measured", str(trace), "--width", "100")
    assert status == 0 and "measured:" in out and "measured (s)" in out


def test_saved_plans_show_and_simulate(capsys, tmp_path):
    plan = compile(4, microbatches=8, schedule="zb-h2")
    for name, text in (("p.json", plan.to_json()), ("p.txt", plan.to_text())):
        path = tmp_path / name
        path.write_text(text)
        status, out, _ = run(capsys, "show", str(path), "--json")
        assert status == 0 and json.loads(out)["period"] == 24
        status, out, _ = run(capsys, "simulate", str(path), "--iterations", "6", "--json")
        assert status == 0 and json.loads(out)["iterations"] == 6 and json.loads(out)["period"] == 24
        status, out, _ = run(capsys, "simulate", str(path), "-k", "2", "--sync-optimizer")
        assert status == 0 and "period        27" in out


def test_torch_csv_export_and_import(capsys, tmp_path):
    plan = compile(4, microbatches=8, schedule="zb-h1")
    src, csv, back = tmp_path / "p.json", tmp_path / "s.csv", tmp_path / "q.json"
    src.write_text(plan.to_json())
    assert run(capsys, "export-torch", str(src), "-o", str(csv))[0] == 0
    assert csv.read_text().splitlines()[3].startswith("3F0,3I0,3F1")
    status, _, err = run(capsys, "import-torch", str(csv), "--pp", "4", "--microbatches", "8", "-o", str(back))
    assert status == 0, err
    assert Plan.from_json(back.read_text()).streams == plan.streams
    status, out, _ = run(capsys, "export-torch", str(src))
    assert status == 0 and out == csv.read_text()


def _bad_plans(tmp_path):
    plan = compile(2, microbatches=4, schedule="1f1b")
    data = json.loads(plan.to_json())
    data["streams"]["0:1"] = list(reversed(data["streams"]["0:1"]))
    (tmp_path / "invalid.json").write_text(json.dumps(data))
    (tmp_path / "broken.json").write_text(plan.to_json()[:50])
    (tmp_path / "costs3.json").write_text(json.dumps({"forward": [1] * 3, "backward_input": [1] * 3,
                                                       "backward_weight": [1] * 3}))
    (tmp_path / "costs_bad.json").write_text('{"forward": "fast"}')
    (tmp_path / "trace_bad.json").write_text("{}")
    (tmp_path / "plan.json").write_text(plan.to_json())
    (tmp_path / "dir").mkdir()


BAD = [
    ["show", "{tmp}/plan.json", "--fail", "1:0"],
    ["show", "--schedule", "1f1b", "--pp", "4", "-m", "8", "--workers", "0:x"],
    ["show", "--schedule", "1f1b", "--pp", "4", "-m", "8", "--html", "{tmp}/dir"],
    ["show", "--schedule", "1f1b", "--pp", "4", "-m", "8", "--failed"],
    ["show", "--schedule", "1f1b", "--pp", "0", "--microbatches", "8"],
    ["show", "--schedule", "1f1b", "--pp", "-3", "--microbatches", "8"],
    ["show", "--schedule", "1f1b", "--pp", "four", "--microbatches", "8"],
    ["show", "--schedule", "zb-h2", "--pp", "4", "--microbatches", "3"],
    ["show", "--schedule", "1f1b", "--pp", "4", "--microbatches", "2"],
    ["show", "--schedule", "zb-h9", "--pp", "4", "--microbatches", "8"],
    ["show", "--schedule", "1f1b", "--pp", "4"],
    ["show"],
    ["show", "{tmp}/invalid.json"],
    ["show", "{tmp}/broken.json"],
    ["show", "{tmp}/missing.json"],
    ["show", "{tmp}/dir"],
    ["show", "{tmp}/plan.json", "--schedule", "1f1b"],
    ["show", "--schedule", "1f1b", "--pp", "4", "-m", "8", "--costs", "{tmp}/costs3.json"],
    ["show", "--schedule", "1f1b", "--pp", "4", "-m", "8", "--costs", "{tmp}/costs_bad.json"],
    ["show", "--schedule", "1f1b", "--pp", "4", "-m", "8", "--costs", "{tmp}/missing.json"],
    ["show", "--schedule", "1f1b", "--pp", "4", "-m", "8", "--memory-limit", "1"],
    ["show", "--schedule", "1f1b", "--pp", "4", "-m", "8", "--memory-limit", "-1"],
    ["show", "--schedule", "1f1b", "--pp", "4", "-m", "8", "--failed", "7:7"],
    ["show", "--schedule", "1f1b", "--pp", "4", "-m", "8", "--iterations", "0"],
    ["show", "--schedule", "1f1b", "--pp", "4", "-m", "8", "--draw-iterations", "5"],
    ["show", "--schedule", "1f1b", "--pp", "4", "-m", "8", "--png", "{tmp}/chart.pdf"],
    ["show", "--schedule", "1f1b", "--pp", "4", "-m", "8", "--png", "{tmp}/no/such/dir/chart.png"],
    ["show", "--schedule", "1f1b", "--pp", "4", "-m", "8", "--measured", "{tmp}/trace_bad.json"],
    ["simulate", "{tmp}/invalid.json"],
    ["simulate", "{tmp}/missing.json", "--json"],
    ["simulate"],
    ["export-torch", "{tmp}/broken.json"],
    ["import-torch", "{tmp}/plan.json"],
    ["import-torch", "{tmp}/missing.csv"],
    [],
    ["frobnicate"],
]


@pytest.mark.parametrize("argv", BAD, ids=[" ".join(a)[:60] or "(none)" for a in BAD])
def test_bad_input_is_one_line_and_status_2(capsys, tmp_path, argv):
    _bad_plans(tmp_path)
    status, out, err = run(capsys, *[a.replace("{tmp}", str(tmp_path)) for a in argv])
    assert status == 2
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("schedcomp: error: ") and "Traceback" not in err


def test_help_exits_zero(capsys):
    assert main(["--help"]) == 0
    assert "show" in capsys.readouterr().out
    assert main(["show", "--help"]) == 0
    assert "--schedule" in capsys.readouterr().out


def test_the_cli_never_imports_torch(tmp_path):
    code = (
        "import sys\n"
        "from schedcomp.cli import main\n"
        f"assert main(['show', '--schedule', 'zb-h1', '--pp', '2', '-m', '4', '--png', r'{tmp_path / 'a.png'}',"
        f" '--trace', r'{tmp_path / 't.json'}', '--html', r'{tmp_path / 'a.html'}']) == 0\n"
        f"assert main(['show', '--schedule', 'zb-h1', '--pp', '2', '-m', '4', '--measured', r'{tmp_path / 't.json'}',"
        " '--json']) == 0\n"
        "assert 'torch' not in sys.modules, 'the CLI imported torch'\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("ok")


def test_console_entry_point_reports_errors_in_one_line():
    exe = shutil.which("schedcomp")
    cmd = [exe] if exe else [sys.executable, "-m", "schedcomp.cli"]
    done = subprocess.run([*cmd, "show", "--schedule", "1f1b", "--pp", "0", "-m", "4"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("schedcomp: error:")
    done = subprocess.run([*cmd, "show", "--schedule", "1f1b", "--pp", "2", "-m", "4", "--json"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and json.loads(done.stdout)["period"] == 3 * 4 + 3


@pytest.mark.parametrize("command", [
    ["show", "--pp", "4", "-m", "4", "--json", "--schedule", "adaptive", "--solver", "greedy"],
    ["compile", "--pp", "4", "-m", "4", "--json", "--solver", "greedy"],
    ["compare", "--pp", "4", "-m", "4", "--json", "--strategy", "adaptive"],
])
def test_failures_are_spelled_alike_everywhere(capsys, command):
    """`--fail D:S` repeated and `--failed D:S D:S` give the same failures in every command."""
    outputs = []
    for spelling in (["--fail", "1:2", "--fail", "0:1"], ["--failed", "1:2", "0:1"], ["--fail", "1:2", "--failed",
                                                                                       "0:1"]):
        status, out, err = run(capsys, *command, "--dp", "2", *spelling)
        assert status == 0, err
        outputs.append(json.loads(out))
        if isinstance(outputs[-1], dict):
            outputs[-1].pop("compile_seconds", None)  # a timing, not a result
    assert outputs[0] == outputs[1] == outputs[2]
    if command[0] != "compare":
        assert outputs[0]["failed"] == ["0:1", "1:2"]


def test_an_unknown_command_is_one_line_naming_the_program_once(capsys):
    status, _, err = run(capsys, "bogus")
    assert status == 2 and err.count("schedcomp") == 2  # the prefix and the `--help` hint, nothing doubled
    assert err.startswith("schedcomp: error: argument COMMAND: invalid choice: 'bogus'") and err.count("\n") == 1
    status, _, err = run(capsys, "show", "--bogus")
    assert status == 2
    assert err == "schedcomp: error: show: unrecognized arguments: --bogus (see schedcomp show --help)\n"
    status, _, err = run(capsys, "show", "--fail", "one")
    assert status == 2 and err.startswith("schedcomp: error: show: argument --fail") and err.count("\n") == 1


def test_show_writes_an_html_view_and_filters_workers(capsys, tmp_path):
    page = tmp_path / "v.html"
    status, _, err = run(capsys, "show", "--pp", "4", "--dp", "2", "-m", "8", "--fail", "1:2", "--html", str(page),
                         "--workers", "*:2", "--json")
    assert status == 0, err
    text = page.read_text()
    assert '"name":"0:2"' in text and '"name":"1:2","failed":true' in text and '"name":"0:1"' not in text
    status, out, _ = run(capsys, *SHOW, "--workers", "0:1-2", "--color", "never")
    assert status == 0 and "\n0:1 " in out and "\n0:2 " in out and "\n0:0 " not in out and "\n0:3 " not in out
    status, _, err = run(capsys, *SHOW, "--workers", "two")
    assert status == 2 and "--workers" in err


def test_demo_says_which_schedule_it_runs():
    from schedcomp.runtime.demo import _parser, choose_schedule

    failed, schedule, why = choose_schedule(_parser().parse_args(["--schedule", "zb-h1"]))
    assert failed == [Worker(1, 1)] and schedule == "adaptive" and "not zb-h1" in why and "--failed" in why
    failed, schedule, why = choose_schedule(_parser().parse_args(["--failed", "--schedule", "zb-h1"]))
    assert failed == [] and schedule == "zb-h1" and why == "schedule: zb-h1, no failed worker"
    failed, schedule, _ = choose_schedule(_parser().parse_args(["--fail", "0:1", "--fail", "1:0"]))
    assert failed == [Worker(0, 1), Worker(1, 0)] and schedule == "adaptive"


def test_colour_on_a_terminal_unless_no_color(capsys, monkeypatch):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    status, out, _ = run(capsys, *SHOW)
    assert status == 0 and "\x1b[30;44m" in out
    monkeypatch.setenv("NO_COLOR", "1")
    status, out, _ = run(capsys, *SHOW)
    assert status == 0 and "\x1b[" not in out
