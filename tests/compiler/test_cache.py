"""The plan cache: canonical failure sets, relabelling, lookups, files on disk, `schedcomp precompile`."""

from __future__ import annotations

import io
import itertools
import json
import re
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schedcomp.cache import PlanCache, canonical, precompile, relabel, scenarios
from schedcomp.check import check
from schedcomp.cli import main
from schedcomp.cli.progress import ProgressBar
from schedcomp.compiler import compile
from schedcomp.costs import CostModel
from schedcomp.errors import PlanFormatError, RecoveryError
from schedcomp.scenarios import legacy_key_name
from schedcomp.simulator import simulate
from schedcomp.topology import Topology, Worker


def _orbits(pp: int, dp: int, k: int) -> int:
    """Brute force: distinct recoverable failure sets of size <= k up to permuting the pipelines."""
    workers = [Worker(d, s) for d in range(dp) for s in range(pp)]
    seen = set()
    for n in range(k + 1):
        for failed in itertools.combinations(workers, n):
            if any(sum(w.stage == s for w in failed) >= dp for s in range(pp)):
                continue
            seen.add(min(tuple(sorted((perm[w.pipeline], w.stage) for w in failed))
                         for perm in itertools.permutations(range(dp))))
    return len(seen)


@pytest.mark.parametrize(("pp", "dp", "k"), [(2, 2, 1), (2, 2, 2), (3, 3, 2), (2, 3, 3), (4, 2, 2)])
def test_scenarios_are_the_orbits_under_relabelling_pipelines(pp, dp, k):
    found = scenarios(pp, dp, k)
    assert len(found) == _orbits(pp, dp, k)
    assert len({c.key for c in found}) == len(found)


def test_speed_factors_split_otherwise_equal_scenarios():
    costs = CostModel(forward=[1.0] * 2, backward_input=[1.0] * 2, backward_weight=[1.0] * 2,
                      speed={Worker(1, 0): 0.5})
    plain, slow = scenarios(2, 3, 1), scenarios(2, 3, 1, costs)
    assert len(slow) > len(plain)
    # Failing pipeline 0 or 2 is the same scenario; failing the pipeline with the straggler is not.
    same = canonical(Topology.of(2, 3, [(0, 1)]), costs).key == canonical(Topology.of(2, 3, [(2, 1)]), costs).key
    other = canonical(Topology.of(2, 3, [(0, 1)]), costs).key != canonical(Topology.of(2, 3, [(1, 1)]), costs).key
    assert same and other


@given(st.integers(2, 4), st.integers(2, 4), st.data())
def test_canonical_form_is_invariant_and_its_permutation_maps_back(pp, dp, data):
    workers = [Worker(d, s) for d in range(dp) for s in range(pp)]
    failed = data.draw(st.lists(st.sampled_from(workers), max_size=4, unique=True))
    perm = data.draw(st.permutations(range(dp)))
    topo = Topology.of(pp, dp, failed)
    moved = Topology.of(pp, dp, [(perm[w.pipeline], w.stage) for w in failed])
    c = canonical(topo)
    assert c.key == canonical(moved).key
    assert sorted(c.perm) == list(range(dp))
    back = {Worker(c.perm[i], s) for i, s in c.failed}
    assert back == topo.failed


@pytest.fixture(scope="module")
def small_cache(tmp_path_factory):
    directory = tmp_path_factory.mktemp("plans")
    costs = CostModel.uniform(3, p2p=0.1)
    cache = precompile(3, 3, 3, 2, costs=costs, directory=directory, time_limit=1.0)
    return cache, directory


def test_lookup_returns_a_valid_plan_for_the_concrete_failures(small_cache):
    cache, directory = small_cache
    loaded = PlanCache.load(directory)
    assert len(loaded) == len(cache) == len(scenarios(3, 3, 2))
    assert not loaded.plans  # read lazily...
    loaded.preload()
    assert len(loaded.plans) == len(cache)  # ...or all at once
    for failed in ([], [(2, 1)], [(0, 0), (1, 2)], [(1, 0), (2, 0)], [(2, 0), (2, 2)]):
        plan = loaded.lookup(failed)
        check(plan)
        assert plan.topology.failed == Topology.of(3, 3, failed).failed
        # Same schedule as the canonical one, renamed: same period.
        c = canonical(plan.topology, plan.costs)
        assert simulate(plan).period == pytest.approx(simulate(cache.plans[c.key]).period)
        assert failed in loaded


def test_relabel_is_a_bijection_that_composes(small_cache):
    cache, _ = small_cache
    plan = cache.lookup([(0, 1)])
    there = relabel(plan, (2, 0, 1))
    check(there)
    assert there.topology.failed == {Worker(2, 1)}
    assert relabel(there, {2: 0, 0: 1, 1: 2}) == plan


def test_lookup_explains_what_it_cannot_do(small_cache):
    cache, directory = small_cache
    with pytest.raises(RecoveryError, match="checkpoint"):
        cache.lookup([(0, 1), (1, 1), (2, 1)])
    with pytest.raises(RecoveryError, match=r"covers up to 2.*--max-failures 3"):
        cache.lookup([(0, 0), (1, 1), (2, 2)])
    (directory / "broken").mkdir()
    with pytest.raises(PlanFormatError, match="precompile"):
        PlanCache.load(directory / "broken")


def test_speed_factors_are_mapped_back_on_lookup(tmp_path):
    costs = CostModel(forward=[1.0] * 2, backward_input=[1.0] * 2, backward_weight=[1.0] * 2,
                      speed={Worker(2, 1): 0.5})
    cache = precompile(2, 3, 2, 1, costs=costs, time_limit=1.0)
    plan = cache.lookup([(0, 1)])
    check(plan)
    assert dict(plan.costs.speed) == {Worker(2, 1): 0.5}
    # The straggler (2, 1) takes no more re-routed micro-batches than the healthy peer (1, 1).
    def rerouted(w):
        return sum(op.pipeline != w.pipeline for op in plan.compute_ops(w))
    assert rerouted(Worker(2, 1)) <= rerouted(Worker(1, 1))


def test_precompile_cli_writes_the_cache_quietly_off_a_terminal(tmp_path, capsys):
    out = tmp_path / "plans"
    status = main(["precompile", "--pp", "2", "--dp", "3", "--microbatches", "2", "--max-failures", "2",
                   "-o", str(out), "--jobs", "1", "--time-limit", "1"])
    captured = capsys.readouterr()
    assert status == 0
    assert captured.err == ""  # no terminal, no progress bar
    index = json.loads((out / "index.json").read_text())
    assert index["pp"] == 2 and len(index["scenarios"]) == len(scenarios(2, 3, 2))
    assert all((out / entry["file"]).exists() for entry in index["scenarios"])
    # files are named as the CLI spells the failures
    assert all(e["file"] == f"failed-{','.join(e['failed'])}.json" for e in index["scenarios"] if e["failed"])
    assert "healthy.json" in {e["file"] for e in index["scenarios"]}
    check(PlanCache.load(out).lookup([(2, 0), (0, 1)]))


def test_precompile_in_two_processes_gives_the_same_plans(tmp_path):
    one = precompile(2, 2, 2, 1, jobs=1, time_limit=1.0)
    two = precompile(2, 2, 2, 1, jobs=2, time_limit=1.0)
    assert one.plans == two.plans


def test_progress_bar_draws_on_a_terminal_only():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    screen = Terminal()
    with ProgressBar("precompile", "plan", stream=screen) as bar:
        for k in range(3):
            bar(k + 1, 3, f"failed-0:{k}")
    assert "precompile" in screen.getvalue() and "3/3" in screen.getvalue() and "failed-0:2" in screen.getvalue()
    quiet, pipe = Terminal(), io.StringIO()
    for stream, flag in ((quiet, True), (pipe, False)):
        with ProgressBar("precompile", "plan", quiet=flag, stream=stream) as bar:
            bar(1, 1, "healthy")
        assert stream.getvalue() == ""


def test_caches_written_with_the_old_file_names_still_load(tmp_path):
    out = tmp_path / "old"
    precompile(2, 2, 2, 1, time_limit=1.0, directory=out)
    index = json.loads((out / "index.json").read_text())
    for entry in index["scenarios"]:  # rename every file as caches before readable names did
        key = (tuple(tuple(map(int, w.split(":"))) for w in entry["failed"]), tuple(entry["classes"]))
        (out / entry["file"]).rename(out / (legacy_key_name(key) + ".json"))
        entry["file"] = legacy_key_name(key) + ".json"
    assert "healthy.json" in {e["file"] for e in index["scenarios"]}
    assert all(re.fullmatch(r"f\d\.\d.json", e["file"]) for e in index["scenarios"] if e["failed"])
    (out / "index.json").write_text(json.dumps(index))
    check(PlanCache.load(out).lookup([(1, 1)]))


def test_relabel_renames_a_cut_and_keeps_the_partition() -> None:
    plan = compile(4, 8, 8, failed=["3:1"], recut=True, memory_limit=None)
    assert plan.cut.pipelines.keys() == {3}
    moved = relabel(replace(plan, partition=(1, 1, 1, 1)), {d: (d + 1) % 8 for d in range(8)})
    assert moved.cut.pipelines == {4: plan.cut.pipelines[3]} and moved.partition == (1, 1, 1, 1)
    assert moved.topology.failed == frozenset({Worker(4, 1)})
    check(moved)
