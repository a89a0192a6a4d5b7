"""Adaptive re-routing with virtual stages: a failed worker's micro-batches at every chunk it held run on
live workers holding the same chunks; the plans validate and simulate, never lose to dropping the
broken pipelines, and stay within the bound, the memory limit and the solver's own clock."""

from __future__ import annotations

import math

import pytest

from schedcomp.adaptive import solve
from schedcomp.check import check, peak_memory
from schedcomp.compiler import compile
from schedcomp.costs import CostModel
from schedcomp.errors import ScheduleError
from schedcomp.lower import lower
from schedcomp.memory import family_stage_peaks
from schedcomp.simulator import simulate
from schedcomp.solvers.bounds import work_bound
from schedcomp.solvers.problem import Problem
from schedcomp.topology import LOOP, Topology, V, Worker

FAST = 0.2  # seconds of nominal solver time: a small, fixed amount of local search

CASES = [  # (family, pp, dp, failed, M): M such that the dropped job's batch is a valid one for the family
    ("interleaved-1f1b", 2, 2, [(0, 1)], 4),
    ("interleaved-1f1b", 4, 2, [(1, 0)], 4),
    ("interleaved-1f1b", 3, 4, [(1, 0), (2, 2)], 3),
    ("interleaved-1f1b", 4, 3, [(2, 3)], 8),
    ("interleaved-1f1b", 2, 3, [(0, 1), (0, 0)], 4),
    ("zb-v", 2, 2, [(0, 1)], 4),
    ("zb-v", 4, 2, [(1, 0)], 4),
    ("zb-v", 3, 4, [(1, 0), (2, 2)], 3),
    ("zb-v", 4, 3, [(0, 0), (1, 3)], 4),
    ("zb-v", 2, 3, [(2, 1)], 2),
]


@pytest.mark.parametrize(("family", "pp", "dp", "failed", "m"), CASES)
def test_rerouted_plans_run_every_chunk_on_a_holder_and_beat_dropping_the_pipelines(
    family: str, pp: int, dp: int, failed: list[tuple[int, int]], m: int
) -> None:
    plan = compile(pp, dp, m, failed=failed, schedule=family, time_limit=10.0)  # compile runs check
    topo = plan.topology
    assert topo.chunks == 2 and topo.placement == (V if family == "zb-v" else LOOP)
    orphans = 0
    for worker in plan.workers:
        ops = plan.compute_ops(worker)
        assert all(topo.place_of(op.stage) == worker.stage for op in ops)  # only chunks it holds
        orphans += sum(Worker(op.pipeline, worker.stage) in topo.failed for op in ops)
    assert orphans == len(failed) * m * topo.chunks * 3  # every failed slot's F, B and W ran somewhere
    period = simulate(plan).period
    assert plan.lower_bound is not None and plan.lower_bound <= period * (1 + 1e-9)
    broken = len({d for d, _ in failed})
    dropped = compile(pp, dp - broken, math.ceil(dp * m / (dp - broken)), schedule=family)
    assert period <= simulate(dropped).period * (1 + 1e-9)


@pytest.mark.parametrize(("family", "pp", "dp", "failed", "m", "period"), [
    ("zb-v", 4, 2, [(1, 0)], 4, 24.0),  # the merged ZB-V keeps the busiest peer bubble-free
    ("interleaved-1f1b", 2, 2, [(0, 1)], 8, 48.0),
    ("interleaved-1f1b", 3, 2, [(0, 2)], 8, 48.0),
])
def test_the_solver_reaches_the_work_bound(
    family: str, pp: int, dp: int, failed: list[tuple[int, int]], m: int, period: float
) -> None:
    """Unit model, chunks of 1/2 a stage: the peer of a failed worker runs 2M micro-batches of 3 units of
    work (F + B + W over its two chunks), which is the work bound and what the solver reaches."""
    plan = compile(pp, dp, m, failed=failed, schedule=family, time_limit=FAST)
    assert plan.lower_bound == period == 2 * m * 3.0
    assert simulate(plan).period == pytest.approx(period, abs=1e-9)


def test_the_work_bound_with_chunks_of_unequal_cost_is_the_fractional_water_level() -> None:
    """Place 0 holds chunks 0 and 2 (a slot costs 3 and 4): two peers share the failed worker's 2 x 2 slots;
    any split leaves one peer at least half the re-routed work, 14 / 2, on top of its own 2 x (3 + 4)."""
    costs = CostModel.from_dict({"forward": [1, 1, 2, 1], "backward_input": [1] * 4, "backward_weight": [1] * 4})
    problem = Problem(Topology.of(2, 3, [(2, 0)], chunks=2), 2, costs)
    assert work_bound(problem) == 14 + 7
    solution = solve(problem, solver="greedy", time_limit=FAST)
    assert solution.bound == 21 and solution.period >= 21


@pytest.mark.parametrize("placement", [LOOP, V])
def test_the_solvers_clock_is_the_simulators_with_local_hand_offs(placement: str) -> None:
    costs = CostModel.uniform(8, forward=0.5, backward_input=0.5, backward_weight=0.5, activation=0.5, p2p=0.25)
    problem = Problem(Topology.of(4, 2, [(1, 0), (0, 3)], chunks=2, placement=placement), 6, costs)
    solution = solve(problem, solver="greedy", time_limit=FAST)
    assert simulate(lower(solution.order(), costs)).period == pytest.approx(solution.period, abs=1e-9)


@pytest.mark.parametrize("family", ["interleaved-1f1b", "zb-v"])
def test_memory_limits_hold_per_worker_over_its_chunks(family: str) -> None:
    default = compile(4, 2, 8, failed=[(1, 1)], schedule=family, time_limit=FAST)
    # By default no worker holds more than the fault-free family of the same placement does.
    reference = max(family_stage_peaks(family, 4, 8, default.costs))
    assert default.costs.memory_limit == reference
    assert max(peak_memory(default).values()) <= reference * (1 + 1e-9)
    tight = compile(4, 2, 8, failed=[(1, 1)], schedule=family, time_limit=FAST, memory_limit=1.5)
    assert max(peak_memory(tight).values()) <= 1.5 * (1 + 1e-9)
    assert simulate(tight).period >= simulate(default).period - 1e-9  # less memory never buys time here


def test_adaptive_takes_chunks_without_failures_and_cpsat_is_refused_with_them() -> None:
    plan = compile(4, 2, 8, schedule="adaptive", chunks=2, time_limit=FAST)
    assert plan.topology.chunks == 2 and plan.topology.placement == LOOP
    with pytest.raises(ScheduleError, match="one stage per worker"):
        compile(4, 2, 8, failed=[(1, 1)], schedule="zb-v", solver="cpsat")


# ---- the CLI and the plan cache -------------------------------------------------------------------


def test_cli_compiles_and_shows_rerouted_chunks(capsys, tmp_path) -> None:
    import json

    from schedcomp.cli import main

    out = tmp_path / "plan.json"
    argv = ["--pp", "4", "--dp", "2", "--chunks", "2", "-m", "8", "--fail", "1:0", "--time-limit", "0.4"]
    assert main(["compile", *argv, "--json", "-o", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["chunks"], summary["placement"], summary["failed"]) == (2, "loop", ["1:0"])
    assert summary["lower_bound"] == 48.0 and summary["period"] >= 48.0
    assert main(["show", str(out)]) == 0
    drawn = capsys.readouterr().out
    assert "failed" in drawn and "F0.1@4" in drawn  # pipeline 1's micro-batch 0 at chunk 4 ran on 0:0
    assert main(["show", "--schedule", "zb-v", "--pp", "4", "--dp", "2", "-m", "8", "--fail", "1:0",
                 "--time-limit", "0.4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["placement"] == "v"
    assert main(["compile", *argv, "--placement", "v", "--schedule", "interleaved-1f1b"]) == 2
    assert "places its chunks 'loop', not 'v'" in capsys.readouterr().err


def test_the_plan_cache_keys_carry_chunks_and_placement(tmp_path) -> None:
    from schedcomp.cache import PlanCache, precompile
    from schedcomp.errors import RecoveryError

    precompile(2, 2, 2, 1, directory=tmp_path, time_limit=FAST, chunks=2, placement=V)
    again = PlanCache.load(tmp_path)
    assert (again.chunks, again.placement, len(again)) == (2, V, 3)  # none failed, 0:0, 0:1
    plan = again.lookup([(1, 1)])
    assert plan.topology == Topology.of(2, 2, [(1, 1)], chunks=2, placement=V)
    assert Worker(1, 1) not in plan.streams and Worker(0, 1) in plan.streams  # the stored 0:1 plan, renamed
    check(plan)
    with pytest.raises(RecoveryError, match="chunks=2 placement=v"):
        again.lookup(Topology.of(2, 2, [(1, 1)], chunks=2))


def test_compare_keeps_the_chunks_for_the_schedulers_and_folds_them_for_1f1b_baselines() -> None:
    from schedcomp.baselines import compare, one_stage_view

    outcomes = {o.strategy: o for o in compare(4, 2, 8, [(1, 0)], chunks=2, placement=V, time_limit=FAST)}
    assert outcomes["fault-free"].period == 24.0  # fault-free ZB-V's, not 1F1B's
    assert outcomes["adaptive"].period <= outcomes["drop-pipeline"].period
    assert all(math.isfinite(o.period) for o in outcomes.values())
    topo = Topology.of(2, 1, chunks=2, placement=V)
    folded_topo, folded = one_stage_view(topo, CostModel.from_dict({"forward": [1, 2, 3, 4], "backward_input": [1] * 4,
                                                                    "backward_weight": [1] * 4}))
    assert folded_topo.chunks == 1 and folded.forward == (1 + 4, 2 + 3)  # place 0 holds stages 0 and 3


def test_a_limit_below_one_micro_batch_over_a_workers_chunks_is_refused() -> None:
    from schedcomp.errors import MemoryLimitError

    # Each chunk's 0.5 fits under 0.75, but a worker holds both of its chunks' activations at once.
    with pytest.raises(MemoryLimitError, match="place 0, which holds them for its chunks 0, 3 at once"):
        compile(2, 2, 4, failed=[(1, 0)], schedule="zb-v", memory_limit=0.75)


def test_rerouted_chunk_plans_are_deterministic() -> None:
    """Every rank may compile the plan on its own: the same inputs give the same plan."""
    def once() -> str:
        return compile(4, 3, 4, failed=[(0, 0), (1, 3)], schedule="zb-v", time_limit=FAST).to_json()

    assert once() == once()
