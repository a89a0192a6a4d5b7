"""A resilient job whose failure plan re-forms the pipeline that lost a worker: the survivors switch to it, exactly.

pp = 3, dp = 2, M = 3 (6 worker processes, CPU, gloo), a 6-layer float64 `nn.Sequential` (Linear + Tanh blocks)
trained with Adam (`resilient_procs`, CHAOS_MOVES). The cache (`reformed_cache`) holds the fault-free plan
(2, 2, 2 in both pipelines) and, for worker 1:1 failed, the plan `compile(..., reform=(1,))` makes: pipeline 1
re-formed over its places 0 and 2 (3, 0, 3), both pipelines' shares of the batch by throughput (3.6 and 2.4
micro-batches, cut into pieces). Worker 1:1 is SIGKILLed in the middle of iteration 1: the survivors roll back
and switch, and the dead worker's layers come from its live replica in pipeline 0 (layer 2 to 1:0, layer 3 to
1:2, both from 0:1). Every survivor's layers equal one process training the whole model on the same batches
(float64, 1e-10), and its ledger, per segment, shows every row entered each update once (all ones, exactly).
Then with 0:1 the victim: checkpoints per layer under each writer's own pipeline's partition, a replacement
that rejoins (layers move back, its donor holds its layers), and a run started without 0:1 that restores into
its re-formed cut. Also: the policies that keep layers in place and whole micro-batches refuse such a cache in
one line, and a replacement's donor must hold its layers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fault_procs import run_job
from reformed_cache import DP, LAYERS, PP, REFORMED, VICTIM, M, reformed_cache
from resilient_procs import HERE, adam, chaos_sequential

from schedcomp.cache import PlanCache
from schedcomp.errors import RuntimeSetupError
from schedcomp.scenarios import canonical
from schedcomp.topology import Worker

ITERATIONS = 4


def launch(plans: Path, victim: Worker | None, iterations: int, respawn: int = 0, hold: int = -1) -> dict[str, dict]:
    """Run the job (CHAOS_MOVES: the Adam `nn.Sequential`) with `victim` killed in the middle of iteration 1."""
    spec = f"{victim}@1.{len(PlanCache.load(plans).lookup([]).streams[victim]) // 2}" if victim is not None else ""
    results, _ = run_job(PP, DP, ["--respawn", str(respawn)],
                         [str(HERE), "resilient", str(iterations), str(plans), spec, str(hold)], timeout=150.0)
    return results


def check(results: dict[str, dict], expected: set[str], partitions: tuple[tuple[int, ...], ...] | None,
          iterations: int, first: int | None = None) -> None:
    """Every worker of `expected` trained `iterations`, ends on a plan with `partitions`, holds its own pipeline's
    span of them, each layer equal to one process's training (1e-10), and counted every row once in each iteration
    it ran (from `first`, else from where it joined)."""
    assert set(results) == expected, sorted(results)
    for r in results.values():
        worker = Worker.parse(r["worker"])
        assert r["iterations"] == iterations
        assert r["partitions"] == ([list(p) for p in partitions] if partitions is not None else None)
        own = (partitions or ((LAYERS // PP,) * PP,) * DP)[worker.pipeline]
        start = sum(own[:worker.stage])
        assert sorted(map(int, r["layers"])) == list(range(start, start + own[worker.stage])), r["worker"]
        for layer, diff in r["layers"].items():
            assert diff <= 1e-10, (r["worker"], layer, diff)
        assert sorted(map(int, r["ledger"])) == list(range(first if first is not None else r["resumed_at"] or 0,
                                                           iterations))
        for i, counts in r["ledger"].items():
            assert counts == [1.0] * DP * M, (r["worker"], i, counts)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_survivors_switch_to_a_re_formed_plan_and_train_the_fault_free_model(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    reformed_cache(tmp_path)
    cache = PlanCache.load(tmp_path)
    assert cache.partitions == {canonical(cache.lookup([VICTIM]).topology, cache.costs).key: REFORMED}
    monkeypatch.setenv("CHAOS_MOVES", str(LAYERS))
    results = launch(tmp_path, VICTIM, ITERATIONS)
    # the plan the survivors run is the re-formed one, and each holds its own pipeline's span of it: pipeline 1's
    # workers took the dead worker's layers (2 and 3: from 0:1, their only live holder)
    check(results, {str(Worker(d, s)) for d in range(DP) for s in range(PP)} - {str(VICTIM)}, REFORMED, ITERATIONS)
    for r in results.values():
        assert r["failed"] == [str(VICTIM)]
        assert [rec["rerun"] for rec in r["recoveries"]] in ([1], [2]), r["recoveries"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_re_formed_job_checkpoints_per_pipeline_rejoins_and_restarts_into_a_re_formed_cut(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 0:1 dies: pipeline 0 re-forms (3, 0, 3) and its workers write places 0 and 2's checkpoints under their own
    # partition (layers 0-2, 3-5), 1:1 place 1's (2-3). Its replacement is admitted at iteration 3 or later: the
    # plan is the fault-free one again, 0:0 and 0:2 drop a layer each and the replacement receives layers 2-3
    # from 1:1 (the donor holding them).
    from schedcomp.runtime.fault.checkpoint import MANIFEST, checkpoint_dir, latest_complete

    victim, iterations = Worker(0, 1), 6
    reformed_cache(tmp_path / "plans")
    monkeypatch.setenv("CHAOS_MOVES", str(LAYERS))
    monkeypatch.setenv("CHAOS_CHECKPOINT", str(tmp_path / "ckpt"))
    results = launch(tmp_path / "plans", victim, iterations, respawn=1, hold=3)
    check(results, {str(Worker(d, s)) for d in range(DP) for s in range(PP)}, None, iterations)
    joined = results[str(victim)]
    assert joined["incarnation"] == 1 and joined["resumed_at"] in (4, 5)
    assert all(r["admitted"] == [joined["resumed_at"]] for w, r in results.items() if w != str(victim))
    assert latest_complete(tmp_path / "ckpt", PP, LAYERS) == iterations - 1
    written = [[e["index"] for e in json.loads((checkpoint_dir(tmp_path / "ckpt", 2, s) / MANIFEST).read_text())[
        "layers"]] for s in range(PP)]
    assert written == [[0, 1, 2], [2, 3], [3, 4, 5]]  # iteration 2: under the re-formed plan

    # A second run starts without 0:1 (dead before joining): its first plan re-forms pipeline 0, so each worker
    # builds its own pipeline's cut and restores exactly those layers from the checkpoint of iteration 5 (written
    # under the fault-free cut: 0:0's three from two stage directories), then trains on.
    monkeypatch.setenv("CHAOS_ABSENT", str(victim))
    results = launch(tmp_path / "plans", None, iterations + 2)
    check(results, {str(Worker(d, s)) for d in range(DP) for s in range(PP)} - {str(victim)}, REFORMED[::-1],
          iterations + 2, first=iterations)
    assert all(r["failed"] == [str(victim)] and not r["recoveries"] for r in results.values())


@pytest.mark.parametrize("policy", ["lossy", "logging"])
def test_policies_that_keep_stages_in_place_refuse_a_re_formed_cache_in_one_line(tmp_path: Path, policy: str) -> None:
    from schedcomp.runtime.fault.boundary_log import LoggingPolicy
    from schedcomp.runtime.fault.restart import CheckpointPolicy
    from schedcomp.runtime.resilient import ResilientTrainer

    reformed_cache(tmp_path / "plans")
    cache = PlanCache.load(tmp_path / "plans")
    options = ({"policy": "lossy"} if policy == "lossy" else
               {"logging": LoggingPolicy(), "checkpoint": CheckpointPolicy(tmp_path / "ck", 1)})
    with pytest.raises(RuntimeSetupError, match=r"^the \w+ policy keeps each stage's layers and whole micro-batches, "
                                                r"but this plan source serves plans with re-formed pipelines.*"
                                                r"precompile --reform never\)$"):
        ResilientTrainer(cache, chaos_sequential(LAYERS), lambda y, t: y, adam, lambda i: None, **options)
    assert not cache.plans  # known from the index alone
    from schedcomp.runtime.fault.policies import may_cut_elsewhere

    # (and that layers may move: every stage's optimizer is checked movable at start; a cache with layer costs
    # reads its plans for that, so a failure reads none)
    assert may_cut_elsewhere(cache, chaos_sequential(LAYERS)) and cache.plans
    unlayered = PlanCache(PP, DP, M, cache.costs, partitions=cache.partitions)  # no layer costs, no plan read
    assert may_cut_elsewhere(unlayered, chaos_sequential(LAYERS))
    # rollback takes it (a stage builder cannot: a re-formed plan's layers are cut from one model)
    ResilientTrainer(cache, chaos_sequential(LAYERS), lambda y, t: y, adam, lambda i: None, session=object())
    with pytest.raises(RuntimeSetupError, match=r"pass the model as an nn\.Sequential"):
        ResilientTrainer(cache, lambda s: None, lambda y, t: y, adam, lambda i: None, session=object())


@pytest.fixture(scope="module")
def one_layer_caches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """pp 2, dp 2, M 4, one layer per stage, one failure at most: precompiled by default (re-forming) and with
    reform="never" (re-routing cannot move a layer here, so every plan cuts the model (1, 1))."""
    from schedcomp.cache import precompile

    root = tmp_path_factory.mktemp("one-layer")
    for reform in ("auto", "never"):
        precompile(2, 2, 4, 1, time_limit=1.0, layers=1, reform=reform, directory=root / reform)  # type: ignore[arg-type]
    return {"auto": root / "auto", "never": root / "never"}


@pytest.mark.parametrize("policy", ["lossy", "logging"])
def test_a_default_precompiled_cache_is_refused_by_lossy_and_logging_naming_reform_never(
        one_layer_caches: dict[str, Path], tmp_path: Path, policy: str) -> None:
    # precompile re-forms by default (as compile): the pipeline that lost a worker runs on its live one, which
    # lossy and logging-based recovery cannot run. They say so before training, in one line naming the way out,
    # and run the cache precompiled with --reform never, whose plans all keep each stage's layer in place.
    from schedcomp.runtime.fault.boundary_log import LoggingPolicy
    from schedcomp.runtime.fault.restart import CheckpointPolicy
    from schedcomp.runtime.resilient import ResilientTrainer

    options = ({"policy": "lossy"} if policy == "lossy" else
               {"logging": LoggingPolicy(), "checkpoint": CheckpointPolicy(tmp_path / "ck", 1)})
    default, never = PlanCache.load(one_layer_caches["auto"]), PlanCache.load(one_layer_caches["never"])
    assert sorted(default.partitions.values()) == [((1, 1), (0, 2)), ((1, 1), (2, 0))] and not never.partitions
    with pytest.raises(RuntimeSetupError, match=r"^the \w+ policy .* re-formed pipelines: use "
                                                r"policy='rollback' \(the default\), or plans compiled with "
                                                r"reform='never' \(schedcomp precompile --reform never\)$"):
        ResilientTrainer(default, chaos_sequential(2), lambda y, t: y, adam, lambda i: None, **options)
    ResilientTrainer(never, chaos_sequential(2), lambda y, t: y, adam, lambda i: None, session=object(), **options)
    # the default policy runs the default cache
    ResilientTrainer(default, chaos_sequential(2), lambda y, t: y, adam, lambda i: None, session=object())


def test_a_replacements_donor_holds_its_layers_where_pipelines_hold_different_ones() -> None:
    # dp 3, pipeline 2 re-formed (3, 3, 0): at place 1, 2:1 holds layers 3-5, not the 2-3 a replacement of 1:1
    # holds. With 0:1 rejoining too (no state to give), 2:1 is place 1's only old member: no donor, so the
    # replacement's start is a RecoveryError (a restart from the checkpoint) rather than a load of other layers.
    from types import SimpleNamespace

    from schedcomp.runtime.fault.session import FaultSession
    from schedcomp.runtime.moves import holds_like
    from schedcomp.topology import Topology

    holds = holds_like(((2, 2, 2), (2, 2, 2), (3, 3, 0)), Worker(1, 1))
    assert holds(Worker(0, 1)) and not holds(Worker(2, 1))
    assert holds_like(((2, 2, 2),) * 3, Worker(1, 1))(Worker(2, 1)) and holds_like(None, Worker(1, 1))(Worker(2, 1))
    session = FaultSession.__new__(FaultSession)
    topology = Topology.of(3, 3, [Worker(2, 2)])
    session.view = SimpleNamespace(topology=topology)
    session.previous = SimpleNamespace(members=[w for w in topology.workers if w not in (Worker(0, 1), Worker(1, 1))])
    assert session.donor_for(1) == Worker(2, 1) and session.donor_for(1, holds) is None
    session.previous.members.append(Worker(0, 1))
    assert session.donor_for(1, holds) == Worker(0, 1)
