"""Adaptive plans under failures: valid, round-tripping, never worse than the plain construction."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from schedcomp.adaptive import adaptive_order, cpsat_fits, solve
from schedcomp.baselines import rerouted_1f1b_order
from schedcomp.check import check
from schedcomp.compiler import compile
from schedcomp.costs import CostModel
from schedcomp.errors import MemoryLimitError, RecoveryError, ScheduleError, ValidationError
from schedcomp.ir import OpKind, Plan
from schedcomp.lower import lower
from schedcomp.simulator import simulate
from schedcomp.solvers.problem import Problem
from schedcomp.topology import Topology, Worker


@st.composite
def jobs(draw, max_pp: int = 4, max_dp: int = 4, max_mb: int = 6):
    """(topology, micro-batches, costs): any failure set that leaves every stage a live worker."""
    pp = draw(st.integers(1, max_pp))
    dp = draw(st.integers(1, max_dp))
    mb = draw(st.integers(1, max_mb))
    workers = [Worker(d, s) for d in range(dp) for s in range(pp)]
    failed = set(draw(st.lists(st.sampled_from(workers), max_size=min(4, len(workers)), unique=True)))
    for s in range(pp):
        if all(Worker(d, s) in failed for d in range(dp)):
            failed.discard(Worker(draw(st.integers(0, dp - 1)), s))
    if draw(st.booleans()):
        costs = CostModel.uniform(pp, p2p=draw(st.sampled_from([0.0, 0.1])))
    else:
        times = st.sampled_from([0.5, 1.0, 1.25, 2.0])
        costs = CostModel(
            forward=draw(st.lists(times, min_size=pp, max_size=pp)),
            backward_input=draw(st.lists(times, min_size=pp, max_size=pp)),
            backward_weight=draw(st.lists(times, min_size=pp, max_size=pp)),
            p2p=draw(st.sampled_from([0.0, 0.1, 0.5])),
            allreduce=[draw(st.sampled_from([0.0, 1.0]))] * pp,
            optimizer=[draw(st.sampled_from([0.0, 0.25]))] * pp,
            activation=draw(st.lists(st.sampled_from([1.0, 1.5]), min_size=pp, max_size=pp)),
            b_frees=draw(st.sampled_from([0.25, 0.5, 1.0])),
            speed=draw(st.dictionaries(st.sampled_from(workers), st.sampled_from([0.5, 0.8, 1.5]), max_size=3)),
        )
    if draw(st.booleans()):
        costs = costs.with_memory_limit(max(costs.activation) * draw(st.sampled_from([1.0, 2.0, 4.0])))
    return Topology(pp, dp, frozenset(failed)), mb, costs


def _every_slot_once(plan: Plan) -> None:
    """Each (pipeline, micro-batch, stage) has one F and one B and W (or one BW), all on one worker."""
    topo = plan.topology
    seen: Counter = Counter()
    runner: dict = {}
    for w in plan.workers:
        for op in plan.compute_ops(w):
            assert op.stage == w.stage
            seen[(op.key, op.kind)] += 1
            assert runner.setdefault(op.key, w) == w
    kinds = {k for _, k in seen}
    for d in range(topo.dp):
        for m in range(plan.microbatches):
            for s in range(topo.pp):
                for k in kinds:
                    assert seen[((d, m, s), k)] == 1


def _period_of(order, costs) -> float:
    """Simulated period of a compute order, inf if it deadlocks or breaks the memory limit."""
    plan = lower(order, costs)
    try:
        check(plan)
    except ValidationError:
        return math.inf
    return simulate(plan).period


@given(jobs())
def test_adaptive_plans_validate_round_trip_and_beat_the_plain_construction(job):
    topology, mb, costs = job
    plan = compile(topology.pp, topology.dp, mb, failed=topology.failed, schedule="adaptive", costs=costs,
                   solver="greedy", time_limit=1.0)  # compile runs check(plan)
    assert plan.topology == topology
    assert plan.family == "adaptive" and plan.solver == "greedy"
    _every_slot_once(plan)
    assert Plan.from_json(plan.to_json()) == plan
    assert Plan.from_text(plan.to_text()) == plan
    sim = simulate(plan)
    if costs.memory_limit is not None:
        assert sim.peak_memory <= costs.memory_limit + 1e-9
    assert plan.lower_bound is not None and plan.lower_bound > 0
    plain = _period_of(rerouted_1f1b_order(topology, mb), costs)
    assert sim.period <= plain + 1e-9


# Found by random seeds: no variant of the (work-conserving) list scheduler matches fused 1F1B's strict
# alternation here (19.75 against 19.5); the greedy solver times the plain construction too.
@example((Topology.of(3, 3), 3, CostModel(forward=[0.5, 2.0, 0.5], backward_input=[1.25, 0.5, 0.5],
                                          backward_weight=[2.0, 2.0, 0.5], p2p=0.5, b_frees=0.25)))
@pytest.mark.slow  # over ~5 s: make test-fast leaves it to make test
@given(jobs(max_pp=3, max_dp=3, max_mb=4))
def test_fused_and_synchronous_variants_validate(job):
    topology, mb, costs = job
    for split, synchronous in ((False, False), (True, True)):
        order, bound, used = adaptive_order(topology, mb, costs, solver="greedy", time_limit=1.0, split=split,
                                            synchronous=synchronous)
        plan = lower(order, costs, solver=used, lower_bound=bound)
        check(plan)
        _every_slot_once(plan)
        kinds = {op.kind for w in plan.workers for op in plan.compute_ops(w)}
        assert (OpKind.BW in kinds) == (not split)
        plain = _period_of(rerouted_1f1b_order(topology, mb, split=split), costs)
        if not synchronous:
            assert simulate(plan).period <= plain + 1e-9


def test_rerouted_work_goes_to_live_peers_of_the_same_stage():
    plan = compile(4, 3, 6, failed=[(0, 1), (2, 3)], schedule="adaptive", solver="greedy")
    for w in plan.workers:
        for op in plan.compute_ops(w):
            assert w not in plan.topology.failed and op.stage == w.stage
            if op.pipeline != w.pipeline:
                assert Worker(op.pipeline, op.stage) in plan.topology.failed
    # Both peers of each failed worker take some of its micro-batches.
    for failed in plan.topology.failed:
        takers = {w for w in plan.workers for op in plan.compute_ops(w) if op.pipeline == failed.pipeline
                  and w.stage == failed.stage}
        assert len(takers) == 2


def test_one_failure_in_the_bubbles_costs_little():
    """A failure at a light stage (half the compute of the others): with the memory limit lifted, its
    peers absorb the re-routed micro-batches in time they would idle anyway, so the period stays within
    2% of fault-free. (The default, memory-safe plan holds them within ZB-H1's per-stage peak instead,
    which costs time here: see test_memory_limits.py.)"""
    light = CostModel(forward=[1, 0.5, 1, 1], backward_input=[1, 0.5, 1, 1], backward_weight=[1, 0.5, 1, 1],
                      p2p=0.05, allreduce=[0.5] * 4)
    healthy = simulate(compile(4, 4, 8, schedule="adaptive", costs=light, solver="greedy")).period
    failed = simulate(compile(4, 4, 8, failed=[(2, 1)], schedule="adaptive", costs=light, solver="greedy",
                              memory_limit=None)).period
    assert failed <= healthy * 1.02


def test_auto_uses_cpsat_on_small_jobs_and_greedy_on_large_ones():
    # pp=2, M=2: no schedule reaches the work bound (6): CP-SAT proves the optimum, 7, is one.
    small = Problem(Topology.of(2, 1), 2, CostModel.uniform(2))
    large = Problem(Topology.of(8, 8, [(1, 0)]), 16, CostModel.uniform(8))
    assert cpsat_fits(small, 10.0) and not cpsat_fits(large, 10.0)
    auto = solve(small, solver="auto", time_limit=5.0)
    greedy_only = solve(small, solver="greedy")
    assert greedy_only.solver == "greedy" and greedy_only.bound == 6.0
    assert auto.solver == "cpsat" and auto.bound == pytest.approx(7.0) and auto.period == pytest.approx(7.0)
    # At the work bound the greedy schedule is optimal: CP-SAT is not run even when asked for.
    at_bound = Problem(Topology.of(2, 2, [(1, 0)]), 2, CostModel.uniform(2))
    assert solve(at_bound, solver="cpsat").solver == "greedy"


def test_cpsat_plans_validate_and_carry_a_proven_bound():
    costs = CostModel(forward=[1.1, 1.0, 1.5], backward_input=[1.2, 1.1, 1.65], backward_weight=[1.0, 0.9, 1.35],
                      p2p=0.05, allreduce=[0.3] * 3, optimizer=[0.1] * 3)
    plan = compile(3, 3, 2, failed=[(0, 0), (1, 2)], schedule="adaptive", costs=costs, solver="cpsat",
                   time_limit=3.0)  # compile validates it
    assert plan.solver == "cpsat"
    period = simulate(plan, iterations=8).period
    assert plan.lower_bound is not None and plan.lower_bound <= period + 1e-6


def test_errors_are_one_line_and_say_how_to_fix():
    with pytest.raises(RecoveryError, match="checkpoint") as exc:
        compile(2, 2, 2, failed=[(0, 1), (1, 1)])
    assert "\n" not in str(exc.value)
    with pytest.raises(MemoryLimitError, match=r"stage 0.*at least 2") as exc:
        compile(2, 2, 2, failed=[(0, 1)], costs=CostModel(forward=[1, 1], backward_input=[1, 1],
                                                          backward_weight=[1, 1], activation=[2, 1]),
                memory_limit=1.5)
    with pytest.raises(ScheduleError, match="unknown solver"):
        compile(2, 2, 2, failed=[(0, 1)], solver="magic")
