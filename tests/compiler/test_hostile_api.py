"""Issue 17 regressions, Python API and plan cache: `schedcomp.errors` types for every bad argument,
validated and confined cache files, simulate refusing plans the validator rejects."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from schedcomp import CostModel, Plan, compile, simulate
from schedcomp.cache import PlanCache, precompile
from schedcomp.errors import (
    LimitError,
    PlanFormatError,
    SchedcompError,
    SchedcompTypeError,
    ValidationError,
)
from schedcomp.topology import Worker


def test_the_error_family_is_catchable_as_value_and_type_errors():
    assert issubclass(SchedcompError, ValueError) and issubclass(LimitError, SchedcompError)
    assert issubclass(SchedcompTypeError, TypeError) and issubclass(SchedcompTypeError, SchedcompError)


@pytest.mark.parametrize(("call", "error", "says"), [
    (lambda: compile(2, 2, 4, failed="1:1"), SchedcompTypeError, "not str '1:1'"),
    (lambda: compile(2, 2, 4, failed=None), SchedcompTypeError, "list of workers"),
    (lambda: compile(2, 2, 4, failed=[(0.5, 1)]), SchedcompTypeError, "(0.5, 1)"),
    (lambda: compile(2, 2, 4, failed=[(True, 1)]), SchedcompTypeError, "(True, 1)"),
    (lambda: compile(2, 1, 4, memory_limit={"a": 1}), SchedcompTypeError, "memory_limit"),
    (lambda: compile(2, 1, 4, costs={"forward": [1, 1]}), SchedcompTypeError, "CostModel.from_dict"),
    (lambda: compile(2, 1, 4, schedule=None), SchedcompTypeError, "family name"),
    (lambda: compile(2, 1000000, 4), LimitError, "SCHEDCOMP_MAX_WORKERS"),
    (lambda: compile(2, 1, 10**9), LimitError, "SCHEDCOMP_MAX_MICROBATCHES"),
    (lambda: CostModel.load(None), SchedcompTypeError, "path"),
    (lambda: CostModel(forward=None, backward_input=(1,), backward_weight=(1,)), SchedcompError, "forward"),
    (lambda: CostModel.from_dict({"forward": [10**400], "backward_input": [1], "backward_weight": [1]}),
     SchedcompError, "forward must hold numbers"),
    (lambda: CostModel.uniform(1, forward=float("inf")), SchedcompError, "from 0 to"),
    # Per-stage lists are checked once per distinct (type, value): a True beside a 1 is still caught,
    # and the first bad entry in stage order is the one named; unhashable entries are checked one by one.
    (lambda: CostModel(forward=[1, True], backward_input=[1, 1], backward_weight=[1, 1]), SchedcompError,
     "got True"),
    (lambda: CostModel(forward=[1.0, -2.0, float("nan")], backward_input=[1] * 3, backward_weight=[1] * 3),
     SchedcompError, "got -2.0"),
    (lambda: CostModel(forward=[1.0, [1.0]], backward_input=[1, 1], backward_weight=[1, 1]), SchedcompError,
     "got [1.0]"),
    (lambda: simulate(None), SchedcompTypeError, "needs a Plan"),
    (lambda: simulate(compile(2, 1, 2, schedule="1f1b"), iterations=10**9), LimitError, "ITERATIONS"),
    (lambda: Plan.from_json(None), PlanFormatError, "must be text"),
    # Workers are numbered in ASCII digits: int() read "١" (Arabic-Indic one) as 1 and "1_0" as 10.
    (lambda: Worker.parse("١:0"), SchedcompError, "bad worker '١:0'"),
    (lambda: Worker.parse("1_0:0"), SchedcompError, "bad worker '1_0:0'"),
    (lambda: CostModel.from_dict({"forward": [1, 1], "backward_input": [1, 1], "backward_weight": [1, 1],
                                  "speed": {"1:0": 0.5, "01:0": 0.9}}), SchedcompError, "names a worker twice"),
    (lambda: PlanCache.load(None), SchedcompTypeError, "directory path"),
])
def test_bad_api_arguments_raise_schedcomp_errors(call, error, says):
    with pytest.raises(error) as info:
        call()
    assert says in str(info.value) and "\n" not in str(info.value)


def test_compile_refuses_fractional_workers_instead_of_writing_unreadable_json():
    with pytest.raises(SchedcompTypeError):
        compile(2, 2, 4, failed=[(0.5, 1)])
    plan = compile(2, 2, 4, failed=["1:1"])  # strings are workers too
    assert Plan.from_json(plan.to_json()) == plan


def _deadlocking_json() -> str:
    """1F1B at pp=2 with stage 0's last activation send moved to just before ALLREDUCE: stage 1 waits for
    the activation, stage 0 for a gradient that needs it. The simulator alone posts sends when their
    producer ends, so it timed this plan as if it ran."""
    plan = compile(2, 1, 2, schedule="1f1b")
    data = json.loads(plan.to_json())
    stream = data["streams"]["0:0"]
    send = [i for i in stream if i.startswith("SEND_ACT[")][-1]
    stream.remove(send)
    stream.insert(stream.index("ALLREDUCE"), send)
    return json.dumps(data)


def test_simulate_refuses_a_plan_the_validator_rejects():
    plan = Plan.from_json(_deadlocking_json())
    assert simulate(plan, validate=False).period > 0  # what was reported before: a period for a plan that hangs
    with pytest.raises(ValidationError, match="deadlock"):
        simulate(plan)


def test_simulate_does_not_revalidate_a_checked_plan(monkeypatch):
    import schedcomp.simulator as simulator

    plan = compile(2, 1, 4, schedule="1f1b")  # compile validates it
    monkeypatch.setattr(simulator, "check", lambda p: pytest.fail("validated twice"))
    assert simulate(plan).period == pytest.approx(simulate(plan, validate=False).period)


# ---- the plan cache ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cache")
    precompile(2, 2, 2, 1, directory=root)
    return root


def _copy(cache_dir: Path, tmp_path: Path) -> Path:
    root = tmp_path / "cache"
    root.mkdir()
    for f in cache_dir.iterdir():
        (root / f.name).write_bytes(f.read_bytes())
    return root


def _index(root: Path) -> dict:
    return json.loads((root / "index.json").read_text())


def _rewrite(root: Path, change) -> None:
    data = _index(root)
    change(data)
    (root / "index.json").write_text(json.dumps(data))


def test_index_records_a_digest_of_every_plan(cache_dir):
    for entry in _index(cache_dir)["scenarios"]:
        assert entry["sha256"] == hashlib.sha256((cache_dir / entry["file"]).read_bytes()).hexdigest()
    cache = PlanCache.load(cache_dir)
    cache.preload()
    assert {str(w) for w in cache.lookup([(1, 1)]).topology.failed} == {"1:1"}


def test_an_edited_plan_is_refused_even_with_its_digest_updated(cache_dir, tmp_path):
    root = _copy(cache_dir, tmp_path)
    data = json.loads((root / "healthy.json").read_text())
    stream = data["streams"]["0:0"]
    send = next(i for i in stream if i.startswith("SEND_ACT[F0.0"))
    stream.remove(send)
    stream.insert(stream.index("ALLREDUCE"), send)
    edited = json.dumps(data).encode()
    (root / "healthy.json").write_bytes(edited)
    with pytest.raises(PlanFormatError, match=r"healthy.json does not match the SHA-256"):
        PlanCache.load(root).lookup([])
    _rewrite(root, lambda d: d["scenarios"][0].update(sha256=hashlib.sha256(edited).hexdigest()))
    with pytest.raises(PlanFormatError, match=r"healthy.json is not usable: worker 0:1.*receives in the order"):
        PlanCache.load(root).lookup([])


def test_a_plan_for_another_failure_set_copied_over_healthy_is_refused(cache_dir, tmp_path):
    root = _copy(cache_dir, tmp_path)
    other = (root / "failed-1:1.json").read_bytes()
    (root / "healthy.json").write_bytes(other)
    with pytest.raises(PlanFormatError, match="SHA-256"):
        PlanCache.load(root).lookup([])
    _rewrite(root, lambda d: d["scenarios"][0].update(sha256=hashlib.sha256(other).hexdigest()))
    with pytest.raises(PlanFormatError, match=r"for failed workers 1:1, not scenario healthy"):
        PlanCache.load(root).lookup([])


@pytest.mark.parametrize("name", ["../good.json", "/etc/passwd", "/dev/zero", "sub/healthy.json", "healthy.json\x00"])
def test_index_file_names_are_confined_to_the_cache(cache_dir, tmp_path, name):
    root = _copy(cache_dir, tmp_path)
    (tmp_path / "good.json").write_bytes((root / "healthy.json").read_bytes())
    _rewrite(root, lambda d: d["scenarios"][0].update(file=name))
    with pytest.raises(PlanFormatError, match=r"its file must be 'healthy\.json'"):
        PlanCache.load(root)


def test_a_symlink_out_of_the_cache_is_refused(cache_dir, tmp_path):
    root = _copy(cache_dir, tmp_path)
    outside = tmp_path / "elsewhere.json"
    outside.write_bytes((root / "healthy.json").read_bytes())
    (root / "healthy.json").unlink()
    (root / "healthy.json").symlink_to(outside)
    with pytest.raises(PlanFormatError, match="leads outside the cache directory"):
        PlanCache.load(root).lookup([])


def test_a_device_in_place_of_a_plan_is_refused(cache_dir, tmp_path):
    root = _copy(cache_dir, tmp_path)
    (root / "healthy.json").unlink()
    os.mkfifo(root / "healthy.json")
    with pytest.raises(PlanFormatError, match="not a regular file"):
        PlanCache.load(root).lookup([])


@pytest.mark.parametrize(("content", "says"), [
    (b"\x00\x01\xff binary", "not UTF-8"),
    (b"[" * 50_000 + b"]" * 50_000, "levels deep"),
    (json.dumps([[[[[[[[[[1]]]]]]]]]]).encode(), "not a version 1 schedcomp plan cache"),
    (json.dumps({"format": "schedcomp-plan-cache", "version": 1, "pp": 2, "dp": 10**9, "microbatches": 2,
                 "max_failures": 1}).encode(), "SCHEDCOMP_MAX_WORKERS"),
])
def test_a_binary_or_nested_index_is_one_error(cache_dir, tmp_path, content, says):
    root = _copy(cache_dir, tmp_path)
    (root / "index.json").write_bytes(content)
    with pytest.raises(PlanFormatError, match=says):
        PlanCache.load(root)


@pytest.mark.parametrize(("change", "says"), [
    (lambda d: d.update(pp=True), "'pp' must be a positive integer"),
    (lambda d: d.update(scenarios={}), "'scenarios' must be a list"),
    (lambda d: d["scenarios"][0].update(sha256="00"), "64-hex-digit"),
    (lambda d: d["scenarios"][0].update(failed="1:1"), "lists 'failed'"),
    (lambda d: d["scenarios"][0].update(failed=["9:9"]), "outside the job"),
    (lambda d: d["scenarios"][0].update(classes=[7, 7]), "speed classes"),
    (lambda d: d.pop("costs"), "missing 'costs'"),
])
def test_malformed_index_entries_are_refused(cache_dir, tmp_path, change, says):
    root = _copy(cache_dir, tmp_path)
    _rewrite(root, change)
    with pytest.raises(PlanFormatError, match=says):
        PlanCache.load(root)


@pytest.mark.parametrize("failed", ["1:1", None, [(0.5, 1)], 7])
def test_lookup_refuses_a_bad_failure_set(cache_dir, failed):
    with pytest.raises(SchedcompTypeError):
        PlanCache.load(cache_dir).lookup(failed)


def test_lookup_accepts_worker_strings(cache_dir):
    plan = PlanCache.load(cache_dir).lookup(["1:1"])
    assert {str(w) for w in plan.topology.failed} == {"1:1"}
