"""Plan caches holding re-formed failure plans (`compile(..., reform=)`): the index records each such scenario's
per-pipeline partitions and its cut with shares, so a job knows before reading a plan which plans re-form
pipelines (`PlanCache.partitions`); a load serves them, renamed like any plan, and checks each against its entry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from recut_cache import copy_cache
from reformed_cache import REFORMED, VICTIM, M, reformed_cache

from schedcomp.cache import PlanCache
from schedcomp.errors import PlanFormatError
from schedcomp.runtime.fault.policies import may_reform
from schedcomp.topology import Worker


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("plans")
    reformed_cache(directory)
    return directory


def reformed_entry(index: dict) -> dict:
    return next(e for e in index["scenarios"] if "partitions" in e)


def test_the_index_records_partitions_and_shares_and_a_load_serves_the_re_formed_plan(cache_dir: Path) -> None:
    index = json.loads((cache_dir / "index.json").read_text())
    entry = reformed_entry(index)
    assert entry["failed"] == [str(VICTIM)] and entry["partitions"] == [list(p) for p in REFORMED]
    assert "recut" not in index  # a re-formed plan's cut is its shares: no re-cut plan here
    cache = PlanCache.load(cache_dir)
    assert list(cache.partitions.values()) == [REFORMED] and not cache.plans and may_reform(cache)
    (cut,) = cache.cuts.values()
    assert cut.shares and cut.share(0, M) + cut.share(1, M) == pytest.approx(2 * M)
    assert cache.lookup([VICTIM]).partitions == REFORMED
    mirrored = cache.lookup([Worker(0, 1)])  # the same scenario, pipelines renamed
    assert mirrored.partitions == REFORMED[::-1] and mirrored.cut.pipelines[1] == cut.pipelines[0]
    assert cache.lookup([Worker(1, 0)]).partitions is None  # re-routed: one partition for every pipeline
    assert not may_reform(PlanCache(3, 2, M, cache.costs))


def edited(index: dict, **changes: object) -> None:
    entry = reformed_entry(index)
    for key, value in changes.items():
        if value is None:
            entry.pop(key, None)
        else:
            entry[key] = value


def test_a_plan_whose_partitions_are_not_its_index_entrys_is_refused(cache_dir: Path, tmp_path: Path) -> None:
    cache = PlanCache.load(copy_cache(cache_dir, tmp_path, lambda i: edited(i, partitions=[[2, 2, 2], [4, 0, 2]])))
    with pytest.raises(PlanFormatError, match=r"its per-pipeline partitions \(2,2,2 \| 3,0,3\) differ from the ones "
                                              r"the index gives \(2,2,2 \| 4,0,2\)"):
        cache.lookup([VICTIM])


def test_an_index_that_says_nothing_of_a_re_formed_plan_is_refused(cache_dir: Path, tmp_path: Path) -> None:
    # as an index written before re-formed plans: without the entry's partitions its cut reads as a re-cut one
    with pytest.raises(PlanFormatError, match="has a 'cut' but the index does not say \"recut\""):
        PlanCache.load(copy_cache(cache_dir, tmp_path, lambda i: edited(i, partitions=None)))
    cache = PlanCache.load(copy_cache(cache_dir, tmp_path, lambda i: edited(i, partitions=None, cut=None)))
    assert not cache.partitions
    with pytest.raises(PlanFormatError, match=r"differs from the one the index gives \(none\)"):
        cache.lookup([VICTIM])


@pytest.mark.parametrize(("partitions", "message"), [
    ([[2, 2, 2], [3, 3, 0]], r"gives place 1 3 layers: a re-formed pipeline's failed places hold none"),
    ([[2, 2, 2]], r"has 1 entries but the plan has 2 pipelines"),
    ([[2, 2, 2], [3, 0, 4]], r"\[1\] holds 7 layers but pipeline 0's holds 6"),
    ("3,0,3", r"must be a list of per-pipeline partitions"),
])
def test_malformed_partitions_in_the_index_are_one_line_at_load(cache_dir: Path, tmp_path: Path, partitions: object,
                                                                message: str) -> None:
    pattern = r"^malformed plan cache index .*: scenario \d+: 'partitions'.*" + message
    with pytest.raises(PlanFormatError, match=pattern):
        PlanCache.load(copy_cache(cache_dir, tmp_path, lambda i: edited(i, partitions=partitions)))


def test_lookup_or_repair_passes_over_a_re_formed_plan_even_without_a_cut() -> None:
    # A re-formed plan with equal shares cuts nothing (its pipelines run M whole micro-batches each) but still has
    # its own partitions, which `repair` cannot re-route over: the repair starts from the fault-free plan.
    import dataclasses

    from schedcomp.compiler import compile
    from schedcomp.cut import NO_CUT
    from schedcomp.errors import RecoveryError
    from schedcomp.repair import lookup_or_repair

    whole = compile(3, 2, M, memory_limit=None)
    reformed = dataclasses.replace(compile(3, 2, M, failed=[str(VICTIM)], layers=2, reform=(1,), memory_limit=None),
                                   cut=NO_CUT)

    class Cached:
        def lookup(self, failed):
            found = {(): whole, (VICTIM,): reformed}.get(tuple(sorted(failed)))
            if found is None:
                raise RecoveryError("not cached")
            return found

    plan = lookup_or_repair(Cached(), [VICTIM, Worker(0, 2)], memory_limit=None)
    assert plan.partitions is None and plan.topology.failed == {VICTIM, Worker(0, 2)}
