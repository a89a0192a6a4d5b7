"""Plan caches of re-cut failure plans (`precompile(recut=True)`, `schedcomp precompile --recut`): the index
records it, loading keeps checking every plan against it, old indexes read as before, and the repair path
(`lookup_or_repair`) starts from plans that keep whole micro-batches."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from recut_cache import DP, PP, M, as_whole, copy_cache, precompile_recut

from schedcomp.cache import PlanCache, canonical, precompile
from schedcomp.check import check
from schedcomp.cli import main
from schedcomp.compiler import compile
from schedcomp.errors import PlanFormatError, SchedcompError, ScheduleError
from schedcomp.repair import lookup_or_repair, repair
from schedcomp.topology import Worker


@pytest.fixture(scope="module")
def recut_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return precompile_recut(tmp_path_factory.mktemp("plans"))


def test_the_index_records_recut_and_each_cut_and_a_load_serves_the_re_cut_plans(recut_dir: Path) -> None:
    index = json.loads((recut_dir / "index.json").read_text())
    assert index["recut"] is True and index["version"] == 1
    cache = PlanCache.load(recut_dir)
    assert cache.recut and not cache.plans  # known from the index alone, before any plan is read
    plan = cache.lookup([Worker(1, 1)])
    # 1:1's micro-batches go to its peers in pieces, and the other pipelines run halves (`recut.halve_the_rest`)
    assert plan.cut.pipelines.keys() == {0, 1, 2} and all(sum(plan.cut.sizes(d, M)) == M for d in range(DP))
    check(plan)
    assert not cache.lookup([]).cut  # the fault-free plan has nothing to re-cut
    cache.preload()
    assert cache.cuts == {key: p.cut for key, p in cache.plans.items() if p.cut} and len(cache.cuts) == 2
    assert {json.dumps(e.get("cut")) for e in index["scenarios"] if e["failed"]} == \
        {json.dumps(c.to_json()) for c in cache.cuts.values()}


def test_precompile_cli_recut_writes_the_same_cache(recut_dir: Path, tmp_path: Path) -> None:
    status = main(["precompile", "--pp", str(PP), "--dp", str(DP), "--microbatches", str(M), "--max-failures", "1",
                   "-o", str(tmp_path), "--jobs", "1", "--time-limit", "1", "--recut"])
    assert status == 0
    assert json.loads((tmp_path / "index.json").read_text()) == json.loads((recut_dir / "index.json").read_text())


def test_an_index_without_recut_reads_as_before_and_refuses_a_re_cut_plan(recut_dir: Path, tmp_path: Path) -> None:
    cache = PlanCache.load(copy_cache(recut_dir, tmp_path, as_whole))  # as precompile wrote indexes before --recut
    assert not cache.recut and not cache.cuts
    assert not cache.lookup([]).cut
    with pytest.raises(PlanFormatError, match=r"its cut of micro-batches \(18 pieces over pipelines 0, 1, 2\) "
                                              r"differs from the one the index gives \(none\)"):
        cache.lookup([Worker(1, 1)])


def test_a_plan_whose_cut_is_not_its_index_entrys_is_refused(recut_dir: Path, tmp_path: Path) -> None:
    def other_cut(index: dict) -> None:
        for entry in index["scenarios"]:
            if "cut" in entry:
                entry["cut"] = {"2": [0.0, 1.0, 3.0]}

    cache = PlanCache.load(copy_cache(recut_dir, tmp_path, other_cut))
    with pytest.raises(PlanFormatError, match=r"\(18 pieces over pipelines 0, 1, 2\) differs from the one the index "
                                              r"gives \(2 pieces over pipelines 2\)"):
        cache.lookup([Worker(1, 1)])


@pytest.mark.parametrize(("edit", "message"), [
    (lambda index: index.pop("recut"), "scenario 1 has a 'cut' but the index does not say \"recut\": true"),
    (lambda index: index["scenarios"][1].update(cut={"3": [0.0, 3.0]}), "names pipeline 3, outside pipelines 0..2"),
    (lambda index: index["scenarios"][1].update(cut={"2": [0.0, 2.0]}), "covers 2 micro-batches but the plan has 3"),
    (lambda index: index["scenarios"][1].update(cut={"2": [0.0, 0.0, 3.0]}), "boundaries must increase"),
    (lambda index: index["scenarios"][1].update(cut={}), "its 'cut' is empty"),
    (lambda index: index["scenarios"][0].update(cut={"0": [0.0, 1.5, 3.0]}), "re-cuts a fault-free plan"),
])
def test_a_malformed_cut_in_the_index_is_refused_at_load(recut_dir: Path, tmp_path: Path, edit, message: str) -> None:
    with pytest.raises(PlanFormatError, match=re.escape(message)):
        PlanCache.load(copy_cache(recut_dir, tmp_path, edit))


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


def test_a_cache_held_in_memory_saves_re_cut_plans_only_when_it_says_so(tmp_path: Path) -> None:
    plan = compile(PP, DP, M, failed=["2:1"], recut=True, solver="greedy")  # the canonical scenario of one failure
    key = canonical(plan.topology, plan.costs).key
    cache = PlanCache(PP, DP, M, plan.costs, 1, plans={((), ()): compile(PP, DP, M), key: plan})
    with pytest.raises(PlanFormatError, match="holds plans that re-cut micro-batches: set its recut to True"):
        cache.save(tmp_path)
    cache.recut = True
    cache.save(tmp_path)
    loaded = PlanCache.load(tmp_path)
    assert loaded.cuts == {key: plan.cut} and 1 in loaded.lookup([Worker(1, 1)]).cut.pipelines


@pytest.mark.slow  # a background compile process
@pytest.mark.timeout(120)
def test_improving_plans_over_a_re_cut_cache_repairs_whole_and_compiles_pieces(recut_dir: Path) -> None:
    # 0:1 and 1:0 dead, a cache of one failure: the repair starts from the fault-free plan (the cached plans of
    # either failure alone re-cut) and keeps whole micro-batches; the background compile re-cuts, as the cache's
    # own plans do, and is faster.
    import time

    from schedcomp.improving import ImprovingPlans
    from schedcomp.simulator import simulate
    from schedcomp.topology import Topology

    plans = ImprovingPlans(PlanCache.load(recut_dir), time_limit=1.0)
    try:
        topology = Topology.of(PP, DP, [Worker(0, 1), Worker(1, 0)])
        repaired = plans.lookup(topology)
        assert repaired.solver == "repair" and not repaired.cut
        deadline = time.monotonic() + 100
        while plans.pending(topology) and time.monotonic() < deadline:
            time.sleep(0.02)
        better = plans.improved(topology)
        assert better is not None and better.cut and simulate(better).period < simulate(repaired).period
        assert better.to_text() == compile(PP, DP, M, failed=[Worker(0, 1), Worker(1, 0)], schedule="adaptive",
                                           time_limit=1.0, recut=True,
                                           memory_limit=repaired.costs.memory_limit).to_text()
    finally:
        plans.close()
