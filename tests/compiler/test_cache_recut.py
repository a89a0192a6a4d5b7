"""Plan caches of re-cut failure plans (`precompile(recut=True)`, `schedcomp precompile --recut`): the index
records it, loading keeps checking every plan against it, old indexes read as before, and the repair path
(`lookup_or_repair`) starts from plans that keep whole micro-batches."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from recut_cache import DP, PP, M, precompile_recut

from schedcomp.cache import PlanCache, precompile
from schedcomp.check import check
from schedcomp.cli import main
from schedcomp.compiler import compile
from schedcomp.errors import PlanFormatError, SchedcompError, ScheduleError
from schedcomp.repair import lookup_or_repair, repair
from schedcomp.topology import Worker


@pytest.fixture(scope="module")
def recut_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return precompile_recut(tmp_path_factory.mktemp("plans"))


def test_the_index_records_recut_and_a_load_serves_the_re_cut_plans(recut_dir: Path) -> None:
    assert json.loads((recut_dir / "index.json").read_text())["recut"] is True
    cache = PlanCache.load(recut_dir)
    assert cache.recut and not cache.plans  # known from the index alone, before any plan is read
    plan = cache.lookup([Worker(1, 1)])
    assert plan.cut.pipelines.keys() == {1} and sum(plan.cut.sizes(1, M)) == M
    check(plan)
    assert not cache.lookup([]).cut  # the fault-free plan has nothing to re-cut


def test_precompile_cli_recut_writes_the_same_cache(recut_dir: Path, tmp_path: Path) -> None:
    status = main(["precompile", "--pp", str(PP), "--dp", str(DP), "--microbatches", str(M), "--max-failures", "1",
                   "-o", str(tmp_path), "--jobs", "1", "--time-limit", "1", "--recut"])
    assert status == 0
    assert json.loads((tmp_path / "index.json").read_text()) == json.loads((recut_dir / "index.json").read_text())


def test_an_index_without_recut_reads_as_before_and_refuses_a_re_cut_plan(recut_dir: Path, tmp_path: Path) -> None:
    index = json.loads((recut_dir / "index.json").read_text())
    del index["recut"]  # as precompile wrote every index before --recut
    for entry in index["scenarios"]:
        (tmp_path / entry["file"]).write_bytes((recut_dir / entry["file"]).read_bytes())
    (tmp_path / "index.json").write_text(json.dumps(index))
    cache = PlanCache.load(tmp_path)
    assert not cache.recut
    assert not cache.lookup([]).cut
    with pytest.raises(PlanFormatError, match="re-cuts micro-batches but the index says the cache's plans keep "
                                              "whole ones"):
        cache.lookup([Worker(1, 1)])


def test_a_whole_cache_writes_no_recut_and_a_malformed_one_is_refused(tmp_path: Path) -> None:
    precompile(PP, DP, M, 1, time_limit=1.0, directory=tmp_path)
    index = json.loads((tmp_path / "index.json").read_text())
    assert "recut" not in index and index["version"] == 1
    assert not any(PlanCache.load(tmp_path).lookup([w]).cut for w in (Worker(0, 0), Worker(1, 1)))
    (tmp_path / "index.json").write_text(json.dumps({**index, "recut": "yes"}))
    with pytest.raises(PlanFormatError, match="'recut' must be true or false"):
        PlanCache.load(tmp_path)


def test_precompile_refuses_recut_with_virtual_stages_before_compiling() -> None:
    with pytest.raises(SchedcompError, match="one stage per worker, not chunks=2"):
        precompile(PP, DP, 4, 1, chunks=2, recut=True)


def test_lookup_or_repair_repairs_from_a_plan_that_keeps_whole_microbatches(recut_dir: Path) -> None:
    # Two failures at one place, a cache of one: the cached plan for 0:1 alone re-cuts, and `repair` moves whole
    # micro-batches, so the repair starts from the fault-free plan instead of failing.
    cache = PlanCache.load(recut_dir)
    with pytest.raises(ScheduleError, match="re-cut"):
        repair(cache.lookup([Worker(0, 1)]), Worker(1, 1))
    plan = lookup_or_repair(cache, [Worker(0, 1), Worker(1, 1)])
    assert plan.solver == "repair" and not plan.cut
    assert plan.topology.failed == {Worker(0, 1), Worker(1, 1)}
    check(plan)


def test_a_cache_held_in_memory_may_hold_re_cut_plans_only_when_it_says_so(tmp_path: Path) -> None:
    plan = compile(PP, DP, M, failed=["1:1"], recut=True, solver="greedy")
    fault_free = compile(PP, DP, M)
    cache = PlanCache(PP, DP, M, plan.costs, 1, plans={((), ()): fault_free, (((2, 1),), ()): replace(plan)})
    cache.save(tmp_path)  # written as it is held: a re-cut plan under an index that says whole ones
    with pytest.raises(PlanFormatError, match="re-cuts micro-batches"):
        PlanCache.load(tmp_path).lookup([Worker(1, 1)])
