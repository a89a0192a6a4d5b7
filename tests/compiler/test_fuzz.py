"""Fuzzing every compiler-side loader and the command line (issue 17).

Each test feeds hypothesis-generated input (random bytes, random JSON, and mutations of valid files,
which reach deeper than random text) to one loader and asserts the contract: it returns a value or
raises a `SchedcompError` with a one-line message (a hang is ended by pytest-timeout); the CLI exits 0, or 2 with one
`schedcomp: error:` line and no file changed. Any other exception fails the test with its input.

Example counts (default, per test) are in `EXAMPLES`; multiply them with SCHEDCOMP_FUZZ_SCALE (e.g. 10
for a long local run): `SCHEDCOMP_FUZZ_SCALE=10 .venv/bin/python -m pytest tests/compiler/test_fuzz.py -q`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hostile_helpers import assert_refused, cli, snapshot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schedcomp import CostModel, Plan, compile
from schedcomp.cache import PlanCache, precompile
from schedcomp.draw.trace import read_chrome_trace, to_chrome_trace
from schedcomp.errors import SchedcompError
from schedcomp.profile import profile_costs
from schedcomp.serialize import order_from_torch_csv, plan_to_torch_csv, read_plan
from schedcomp.simulator import simulate

SCALE = max(1, int(os.environ.get("SCHEDCOMP_FUZZ_SCALE", "1")))
EXAMPLES = {"costs": 400, "plans": 300, "csv": 300, "traces": 300, "index": 200, "cli": 300}


def fuzz(name: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Bounded, derandomized (reproducible in CI) runs. No per-example deadline: that would be a timed
    assertion failing on a loaded machine; the suite's pytest-timeout ends a test that hangs."""
    return settings(max_examples=EXAMPLES[name] * SCALE, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


def _one_line(exc: SchedcompError) -> None:
    assert str(exc) and "\n" not in str(exc), repr(exc)


# JSON values with the hostile corners the issue found: huge/odd numbers, deep nesting, odd strings.
_leaf = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
         | st.sampled_from([0, -1, 1e308, 1e-320, 10**30, 10**18, 2**63, 0.5]) | st.text(max_size=12)
         | st.sampled_from(["1:1", "0:0", "9:9", "../x", "/dev/zero", "F0.0", "NaN"]))
_json = st.recursive(_leaf, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                         max_size=4), max_leaves=12)


def _mutate(data: Any, draw: Callable[..., Any], depth: int = 0) -> Any:
    """Replace, drop or keep parts of a valid JSON value, recursively (structure-aware mutation)."""
    choice = draw(st.integers(0, 9))
    if choice == 0 or depth > 4:
        return draw(_json)
    if isinstance(data, dict) and data:
        out = dict(data)
        key = draw(st.sampled_from(sorted(out)))
        if choice == 1:
            del out[key]
        else:
            out[key] = _mutate(out[key], draw, depth + 1)
        return out
    if isinstance(data, list) and data:
        out = list(data)
        i = draw(st.integers(0, len(out) - 1))
        if choice == 1:
            del out[i]
        else:
            out[i] = _mutate(out[i], draw, depth + 1)
        return out
    return data if choice < 6 else draw(_json)


def _mutate_text(text: str, draw: Callable[..., Any]) -> str:
    """Byte-level damage: cut, splice random text, or repeat a slice."""
    i = draw(st.integers(0, len(text)))
    j = draw(st.integers(i, min(len(text), i + 40)))
    op = draw(st.integers(0, 2))
    if op == 0:
        return text[:i] + text[j:]
    if op == 1:
        return text[:i] + draw(st.text(max_size=20)) + text[j:]
    return text[:i] + text[i:j] * draw(st.integers(2, 50)) + text[j:]


# ---- fixtures: one valid file of each kind ------------------------------------------------------------

PLAN = compile(2, 2, 4, failed=[(1, 1)], solver="greedy")
PLAN_JSON = json.loads(PLAN.to_json())
COSTS = PLAN.costs.to_dict() | {"speed": {"0:1": 0.5}}
CSV = plan_to_torch_csv(compile(3, 1, 4, schedule="zb-h1"))
TRACE = to_chrome_trace(simulate(compile(2, 1, 4, schedule="1f1b"), iterations=3).spans)


@fuzz("costs")
@given(st.data())
def test_fuzz_cost_model_files(data):
    kind = data.draw(st.integers(0, 2))
    if kind == 0:
        raw = data.draw(st.binary(max_size=200))
    elif kind == 1:
        raw = json.dumps(_mutate(COSTS, data.draw)).encode()
    else:
        raw = _mutate_text(json.dumps(COSTS), data.draw).encode()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "costs.json"
        path.write_bytes(raw)
        try:
            costs = CostModel.load(path)
        except SchedcompError as exc:
            _one_line(exc)
            return
    assert CostModel.from_dict(json.loads(costs.to_json())) == costs  # what loads, round-trips


@fuzz("plans")
@given(st.data())
def test_fuzz_plans_json_and_text(data):
    form = data.draw(st.sampled_from(["json", "text", "raw"]))
    if form == "json":
        text = json.dumps(_mutate(PLAN_JSON, data.draw))
    elif form == "text":
        text = _mutate_text(PLAN.to_text(), data.draw)
    else:
        text = data.draw(st.text(max_size=300))
    try:
        plan = read_plan(text)
        sim = simulate(plan, iterations=2)  # validates first: no period for a plan that cannot run
    except SchedcompError as exc:
        _one_line(exc)
        return
    assert isinstance(plan, Plan) and sim.period >= 0


@fuzz("csv")
@given(st.data())
def test_fuzz_torch_csv(data):
    text = (_mutate_text(CSV, data.draw) if data.draw(st.booleans())
            else data.draw(st.text(alphabet="0123456789FIWB,_ \n\r\"", max_size=200)))
    dp = data.draw(st.sampled_from([1, 2, 10**9]))
    try:
        order = order_from_torch_csv(text, dp=dp)
    except SchedcompError as exc:
        _one_line(exc)
        return
    assert order.topology.dp == dp and len(order.ops) == dp * order.topology.pp


@fuzz("traces")
@given(st.data())
def test_fuzz_traces_for_profile_and_show_measured(data):
    value = _mutate(TRACE, data.draw) if data.draw(st.booleans()) else data.draw(_json)
    if data.draw(st.booleans()) and isinstance(value, dict) and isinstance(value.get("traceEvents"), list):
        value = value["traceEvents"]  # the JSON Array Format
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        path.write_text(json.dumps(value))
        try:
            spans = read_chrome_trace(path)
            profile_costs([spans])
        except SchedcompError as exc:
            _one_line(exc)
            return
    assert spans


@pytest.fixture(scope="module")
def cache_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    root = tmp_path_factory.mktemp("fuzzcache")
    precompile(2, 2, 2, 1, directory=root)
    return {p.name: p.read_bytes() for p in root.iterdir()}


@fuzz("index")
@given(data=st.data())
def test_fuzz_cache_index(cache_files, data):
    index = json.loads(cache_files["index.json"])
    raw = (json.dumps(_mutate(index, data.draw)) if data.draw(st.integers(0, 3))
           else _mutate_text(cache_files["index.json"].decode(), data.draw))
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        for name, content in cache_files.items():
            (root / name).write_bytes(content)
        (root / "index.json").write_text(raw)
        try:
            cache = PlanCache.load(root)
            cache.preload()
            plan = cache.lookup(data.draw(st.sampled_from([[], [(1, 1)], [(0, 0)], ["1:0"]])))
        except SchedcompError as exc:
            _one_line(exc)
            return
    assert plan.topology.pp == cache.pp


# ---- the command line -------------------------------------------------------------------------------

_NUMBERS = ["0", "1", "2", "3", "-1", "1e9", "1000000000", "nan", "inf", "x", "", "0x10", "9" * 40]
_FILES = ["plan.json", "plan.txt", "costs.json", "s.csv", "trace.json", "bad.json", "utf16.json", "deep.json",
          "/dev/zero", "missing.json", "cache", "."]
_FLAGS = {
    "--pp": _NUMBERS, "--dp": _NUMBERS, "-m": _NUMBERS, "--microbatches": _NUMBERS, "--iterations": _NUMBERS,
    "--fail": ["1:1", "0:0", "9:9", "1", "a:b", ":"], "--failed": ["1:1", "0:1", "x"],
    "--schedule": ["1f1b", "gpipe", "zb-h1", "adaptive", "nope"], "--solver": ["greedy", "cpsat", "bogus"],
    "--time-limit": ["0.5", "nan", "inf", "-1", "1e308"], "--costs": _FILES, "-o": ["out.json", "outdir", "."],
    "--max-failures": ["0", "1", "-1", "1000000"], "-j": ["1", "0"], "--measured": _FILES, "--trace": ["t.json"],
    "--draw-iterations": _NUMBERS, "--width": _NUMBERS, "--json": None, "--text": None, "-q": None,
    "--skip": _NUMBERS, "--b-share": ["0.5", "nan", "2"], "--base": _FILES, "--strategy": ["bamboo", "no"],
}
_COMMANDS = ["show", "simulate", "compile", "precompile", "compare", "import-torch", "export-torch", "profile",
             "bogus", "--version", "-v"]


@st.composite
def _argv(draw: Callable[..., Any]) -> list[str]:
    argv = [draw(st.sampled_from(_COMMANDS))]
    if draw(st.booleans()):
        argv.append(draw(st.sampled_from(_FILES)))
    for flag in draw(st.lists(st.sampled_from(sorted(_FLAGS)), max_size=6)):
        argv.append(flag)
        if _FLAGS[flag] is not None:
            argv.append(draw(st.sampled_from(_FLAGS[flag])))
    return argv


@pytest.fixture(scope="module")
def cli_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fuzzcli")
    small = compile(2, 1, 4, schedule="1f1b")
    (root / "plan.json").write_text(small.to_json())
    (root / "plan.txt").write_text(small.to_text())
    (root / "costs.json").write_text(CostModel.uniform(2).to_json())
    (root / "s.csv").write_text(plan_to_torch_csv(small))
    (root / "trace.json").write_text(json.dumps(to_chrome_trace(simulate(small, iterations=2).spans)))
    (root / "bad.json").write_text('{"format": "schedcomp-plan", "version": 1, "topology": {"pp": 2, "dp": 1e9}}')
    (root / "utf16.json").write_bytes(CostModel.uniform(2).to_json().encode("utf-16"))
    (root / "deep.json").write_text("[" * 10_000)
    precompile(2, 2, 2, 1, directory=root / "cache")
    return root


@pytest.mark.slow  # over ~5 s: make test-fast leaves it to make test
@fuzz("cli")
@given(argv=_argv())
def test_fuzz_command_line(cli_dir, argv):
    with tempfile.TemporaryDirectory() as d:
        work = Path(d) / "w"
        shutil.copytree(cli_dir, work)
        before = snapshot(work)
        old = os.getcwd()
        os.chdir(work)
        try:
            run = cli(*argv, *(["--time-limit", "1"] if "--time-limit" not in argv and argv[0] in (
                "compile", "precompile", "compare") else []))
        finally:
            os.chdir(old)
        if run.code != 0:
            assert_refused(run)
            assert snapshot(work) == before, argv  # a refusal changes no file
        assert "Traceback" not in run.err
