"""A resilient job whose failure plan cuts the model elsewhere: the survivors move layers, exactly.

The pp = 4, dp = 2 chaos job (`chaos_job`) trains an 8-layer `nn.Sequential` with Adam (CHAOS_MOVES). Its
fault-free plan leaves the cut to the runtime (even: 2, 2, 2, 2); every failure plan of the cache moves a
layer off stage 1 onto stage 0 in every pipeline (3, 1, 2, 2). Worker 0:1 is killed in iteration 1: the
survivors roll back, switch, and layer 2 goes to 0:0 from 1:1 (its own pipeline's holder is dead) and to
1:0 from 1:1. Every survivor's layers equal the fault-free model trained in one process (float64, 1e-10).
Checkpoints hold each layer, so a job keeps taking them under a moved cut, and a restart restores them into
its own first plan's cut. Also: the policies that keep layers in place refuse such a cache in one line,
before any group is made.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from chaos_job import DP, ITERATIONS, MICROBATCHES, PP, launch
from resilient_procs import adam, chaos_sequential

from schedcomp.cache import PlanCache, precompile
from schedcomp.costs import CostModel
from schedcomp.errors import RuntimeSetupError
from schedcomp.topology import Worker

LAYERS, MOVED = 8, (3, 1, 2, 2)


def moving_cache(directory: Path) -> str:
    """The chaos job's cache (one failure at most) with every failure plan cut as MOVED."""
    cache = precompile(PP, DP, MICROBATCHES, 1, time_limit=1.0)
    for key, plan in list(cache.plans.items()):
        if key[0]:
            cache.plans[key] = dataclasses.replace(plan, partition=MOVED)
    cache.save(directory)
    return str(directory)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return moving_cache(tmp_path_factory.mktemp("plans"))


VICTIM = Worker(0, 1)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_layers_move_back_when_a_replacement_rejoins(cache_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # 0:1 dies in iteration 1 (layer 2 moves to stage 0: from 1:1 to 1:0 in its own pipeline, from 1:1 to 0:0
    # for want of 0:1) and is replaced; at its admission the plan is the fault-free one again: the survivors
    # move layer 2 back among themselves and the replacement gets its stage, in the even cut, from its donor
    # 1:1. (The failure switch alone, with a compiled cache: the test below.)
    iterations = 7
    monkeypatch.setenv("CHAOS_MOVES", str(LAYERS))
    results = launch(cache_dir, f"{VICTIM}@1.5", iterations=iterations, respawn=1, hold=3, timeout=200.0)
    check(results, {str(Worker(d, s)) for d in range(DP) for s in range(PP)}, (2, 2, 2, 2), iterations)
    joined = results[str(VICTIM)]
    assert joined["incarnation"] == 1 and joined["resumed_at"] in (4, 5, 6)
    assert all(r["admitted"] == [joined["resumed_at"]] for w, r in results.items() if w != str(VICTIM))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_compiled_cache_moves_layers_where_its_failure_plan_cuts(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # End to end: `precompile(layers=2, reform="never")` (8 layers, 2 per stage) re-partitions each failure
    # plan; for 0:1 failed it moves layer 3 from stage 1 to stage 2 (2, 1, 3, 2). The survivors switch to it
    # and move layer 3 to 0:2 and 1:2 from 1:1, the only live holder. (The default, "auto", re-forms pipeline
    # 0 here instead: test_fault_reformed runs such plans.)
    cache = precompile(PP, DP, MICROBATCHES, 1, time_limit=1.0, layers=LAYERS // PP, reform="never")
    cut = cache.lookup([VICTIM]).partition
    assert cut is not None and cut[1] < 2 and sum(cut) == LAYERS
    cache.save(tmp_path)
    stream = cache.lookup([]).streams[VICTIM]
    monkeypatch.setenv("CHAOS_MOVES", str(LAYERS))
    results = launch(str(tmp_path), f"{VICTIM}@1.{len(stream) // 2}")
    check(results, {str(Worker(d, s)) for d in range(DP) for s in range(PP)} - {str(VICTIM)}, cut, ITERATIONS)
    assert all(r["failed"] == [str(VICTIM)] for r in results.values())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_moved_cut_keeps_checkpointing_and_a_restart_restores_into_its_own_cut(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # The job's own cut is (3, 1, 2, 2), the healthy plan's (not the runtime's even split); its failure plans
    # re-route (reform="never": one cut for every pipeline, which this test moves). 1:0 (no checkpoint
    # writer: pipeline 0 writes) dies in iteration 1; its failure plan moves a layer, (2, 1, 3, 2), and the
    # survivors go on checkpointing under that cut, per layer (before, checkpoints stopped while the cut was
    # moved: iteration 0's was the last complete one). A second run of the job starts without 0:3 (dead
    # before joining): its first plan cuts (3, 1, 3, 1), so each worker builds that cut and restores, from
    # the checkpoint written under (2, 1, 3, 2), exactly the layers it holds (stage 0's come from two stage
    # directories), then trains on to the fault-free model.
    from schedcomp.partition import spans
    from schedcomp.runtime.fault.checkpoint import MANIFEST, checkpoint_dir, latest_complete

    victim, absent = Worker(1, 0), Worker(0, 3)
    cache = precompile(PP, DP, MICROBATCHES, 1, time_limit=1.0, layers=LAYERS // PP, partition=MOVED, reform="never")
    moved, later = cache.lookup([victim]).partition, cache.lookup([absent]).partition
    assert cache.lookup([]).partition == MOVED and len({MOVED, moved, later}) == 3, (moved, later)
    cache.save(tmp_path / "plans")
    stream = cache.lookup([]).streams[victim]
    everyone = {str(Worker(d, s)) for d in range(DP) for s in range(PP)}
    monkeypatch.setenv("CHAOS_MOVES", str(LAYERS))
    monkeypatch.setenv("CHAOS_CHECKPOINT", str(tmp_path / "ckpt"))
    results = launch(str(tmp_path / "plans"), f"{victim}@1.{len(stream) // 2}")
    check(results, everyone - {str(victim)}, moved, ITERATIONS)
    assert latest_complete(tmp_path / "ckpt", PP, LAYERS) == ITERATIONS - 1
    for s, held in enumerate(spans(moved)):  # written under the moved cut
        manifest = json.loads((checkpoint_dir(tmp_path / "ckpt", ITERATIONS - 1, s) / MANIFEST).read_text())
        assert [entry["index"] for entry in manifest["layers"]] == list(held)

    monkeypatch.setenv("CHAOS_ABSENT", str(absent))
    results = launch(str(tmp_path / "plans"), "", iterations=ITERATIONS + 2)
    check(results, everyone - {str(absent)}, later, ITERATIONS + 2)
    for r in results.values():
        assert r["failed"] == [str(absent)] and not r["recoveries"]
        assert sorted(map(int, r["ledger"])) == [ITERATIONS, ITERATIONS + 1]  # resumed after the checkpoint


def check(results: dict[str, dict], expected: set[str], cut: tuple[int, ...], iterations: int) -> None:
    """Every worker of `expected` trained `iterations`, holds the layers `cut` gives its stage, each equal to
    the fault-free model trained in one process on the same batches (float64, 1e-10: the worker compares,
    `resilient_procs.held_layers`), and counted every micro-batch once."""
    assert set(results) == expected, sorted(results)
    for r in results.values():
        assert r["iterations"] == iterations
        stage = int(r["worker"].split(":")[1])
        assert sorted(map(int, r["layers"])) == list(range(sum(cut[:stage]), sum(cut[: stage + 1])))
        for layer, diff in r["layers"].items():
            assert diff <= 1e-10, (r["worker"], layer, diff)
        for i, counts in r["ledger"].items():
            assert counts == [1.0] * DP * MICROBATCHES, (r["worker"], i)


@pytest.mark.parametrize("policy", ["lossy", "logging"])
def test_policies_that_keep_layers_in_place_refuse_plans_that_move_them(tmp_path: Path, policy: str) -> None:
    from schedcomp.compiler import compile
    from schedcomp.runtime.fault.boundary_log import LoggingPolicy
    from schedcomp.runtime.fault.restart import CheckpointPolicy
    from schedcomp.runtime.resilient import ResilientTrainer

    plan = compile(PP, DP, MICROBATCHES)
    cache = PlanCache(PP, DP, MICROBATCHES, CostModel.uniform(PP),
                      plans={((), 0): plan, (((0, 1),), 1): dataclasses.replace(plan, partition=MOVED)})
    options = ({"policy": "lossy"} if policy == "lossy" else
               {"logging": LoggingPolicy(), "checkpoint": CheckpointPolicy(tmp_path / "ck", 1)})
    even = dataclasses.replace(plan, partition=(2, 2, 2, 2))  # the runtime's own cut, written out: no move
    same = PlanCache(PP, DP, MICROBATCHES, CostModel.uniform(PP), plans={((), 0): plan, (((1, 1),), 1): even})
    ResilientTrainer(same, chaos_sequential(LAYERS), lambda y, t: y, adam, lambda i: None, session=object(), **options)
    with pytest.raises(RuntimeSetupError, match=r"keeps each stage's layers in place, but the plans cut the model in "
                                                r"2 ways \(\[2, 2, 2, 2\], \[3, 1, 2, 2\]\)"):
        ResilientTrainer(cache, chaos_sequential(LAYERS), lambda y, t: y, adam, lambda i: None, **options)
    # a cache with layer costs whose background compiles may re-partition: known before any plan moves a layer
    from schedcomp.improving import ImprovingPlans

    layered = ImprovingPlans(precompile(PP, DP, MICROBATCHES, 0, time_limit=1.0, layers=LAYERS // PP))
    with pytest.raises(RuntimeSetupError, match="may switch to plans that move them"):
        ResilientTrainer(layered, chaos_sequential(LAYERS), lambda y, t: y, adam, lambda i: None, **options)
    from schedcomp.runtime.fault.policies import may_cut_elsewhere

    # (then every stage's optimizer is checked movable at start: `moves.check_movable`)
    assert may_cut_elsewhere(layered, chaos_sequential(LAYERS)) and may_cut_elsewhere(cache, chaos_sequential(LAYERS))
    assert not may_cut_elsewhere(same, chaos_sequential(LAYERS)) and not may_cut_elsewhere(layered, lambda s: None)
