"""`schedcomp compile`: outputs, files, errors; the parser imports no solver."""

from __future__ import annotations

import json
import subprocess
import sys

from schedcomp.adaptive import SOLVERS
from schedcomp.check import check
from schedcomp.cli import main
from schedcomp.cli.compile import SOLVERS as CLI_SOLVERS
from schedcomp.ir import Plan
from schedcomp.simulator import simulate


def test_compile_writes_a_valid_plan_and_prints_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    status = main(["compile", "--pp", "4", "--dp", "2", "--microbatches", "8", "--fail", "1:2", "--solver", "greedy",
                   "-o", str(out), "--json"])
    assert status == 0
    summary = json.loads(capsys.readouterr().out)
    for key in ("makespan", "period", "bubble_ratio", "peak_memory", "lower_bound", "solver", "compile_seconds"):
        assert key in summary
    plan = Plan.from_json(out.read_text())
    check(plan)
    assert summary["period"] == simulate(plan).period and summary["solver"] == "greedy"
    assert summary["lower_bound"] <= summary["period"] + 1e-9


def test_compile_takes_several_failures_text_form_and_a_summary(tmp_path, capsys):
    out = tmp_path / "plan.txt"
    status = main(["compile", "--pp", "3", "--dp", "3", "--microbatches", "3", "--fail", "0:1", "--failed", "1:2",
                   "2:0", "--text", "-o", str(out), "--solver", "greedy"])
    assert status == 0
    assert "period" in capsys.readouterr().out
    plan = Plan.from_text(out.read_text())
    assert {str(w) for w in plan.topology.failed} == {"0:1", "1:2", "2:0"}


def test_compile_errors_are_one_line(capsys):
    for argv in (["compile", "--pp", "2", "--dp", "2", "--microbatches", "2", "--fail", "0:1", "--fail", "1:1"],
                 ["compile", "--pp", "2", "--dp", "2", "--microbatches", "2", "--fail", "0:1", "--memory-limit", "0.5"],
                 ["compile", "--pp", "2", "--dp", "2", "--microbatches", "2", "--fail", "7:1"],
                 ["compile", "--pp", "2", "--microbatches", "2", "--solver", "magic"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("schedcomp: error:") and err.count("\n") == 1


def test_the_cli_solver_list_is_the_library_one_and_the_parser_loads_no_solver():
    assert CLI_SOLVERS == SOLVERS
    code = ("import sys; from schedcomp.cli import build_parser; build_parser(); "
            "print(any(m.startswith(('ortools', 'torch', 'schedcomp.adaptive', 'schedcomp.baselines')) "
            "for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
