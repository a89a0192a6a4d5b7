"""The solvers: their clock against the simulator, bounds, routing, and CP-SAT against brute force."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from solver_helpers import all_schedules, exact_makespan, exact_period, memory_ok

from schedcomp.adaptive import greedy
from schedcomp.check import check
from schedcomp.costs import CostModel
from schedcomp.errors import MemoryLimitError, RecoveryError
from schedcomp.lower import lower
from schedcomp.recut import recut
from schedcomp.route import assign_orphans, balanced_quota
from schedcomp.simulator import simulate
from schedcomp.solvers.bounds import lower_bound, memory_bound, work_bound
from schedcomp.solvers.cpsat import solve_cpsat
from schedcomp.solvers.greedy import ROUTINGS, W_POLICIES, GreedyParams, list_schedule
from schedcomp.solvers.greedy_tables import default_windows
from schedcomp.solvers.improve import FastTimer, improve
from schedcomp.solvers.problem import Problem
from schedcomp.solvers.timing import peak_memory, time_sequences, within_limits
from schedcomp.topology import Topology, Worker


@st.composite
def problems(draw, max_pp: int = 4, max_dp: int = 3, max_mb: int = 4, memory: bool = True,
             broken: bool = False) -> Problem:
    """`broken`: at least one failed worker and a memory limit (what a re-cut job's bound needs)."""
    pp = draw(st.integers(1, max_pp))
    dp = draw(st.integers(2 if broken else 1, max_dp))
    mb = draw(st.integers(1, max_mb))
    workers = [Worker(d, s) for d in range(dp) for s in range(pp)]
    failed = set(draw(st.lists(st.sampled_from(workers), min_size=1 if broken else 0, max_size=min(3, len(workers)),
                               unique=True)))
    for s in range(pp):  # keep one live worker per stage
        if all(Worker(d, s) in failed for d in range(dp)):
            failed.discard(Worker(0, s))
    times = st.sampled_from([0.5, 1.0, 1.5, 2.0])
    speed = draw(st.dictionaries(st.sampled_from(workers), st.sampled_from([0.5, 2.0]), max_size=2))
    costs = CostModel(
        forward=draw(st.lists(times, min_size=pp, max_size=pp)),
        backward_input=draw(st.lists(times, min_size=pp, max_size=pp)),
        backward_weight=draw(st.lists(times, min_size=pp, max_size=pp)),
        p2p=draw(st.sampled_from([0.0, 0.25])),
        allreduce=[draw(st.sampled_from([0.0, 1.0]))] * pp,
        optimizer=[draw(st.sampled_from([0.0, 0.5]))] * pp,
        activation=draw(st.lists(st.sampled_from([1.0, 2.0]), min_size=pp, max_size=pp)),
        b_frees=draw(st.sampled_from([0.0, 0.5, 1.0])),
        speed=speed,
    )
    if broken or (memory and draw(st.booleans())):
        costs = costs.with_memory_limit(max(costs.activation) * draw(st.sampled_from([1.0, 1.5, 3.0])))
    return Problem(Topology.of(pp, dp, failed), mb, costs, split=draw(st.booleans()))


# ---- the solvers' clock is the simulator's ----------------------------------------------------------


@given(problems())
def test_solver_clock_matches_the_simulator(problem):
    """Both op-level clocks give the simulator's period and makespan for the lowered plan."""
    sol = greedy(problem, time_budget=0.05)
    timing = time_sequences(problem, sol.seqs, 4)
    fast = FastTimer(problem, 4).score(sol.seqs)
    plan = lower(sol.order(), problem.costs)
    check(plan)
    sim = simulate(plan, iterations=4)
    assert timing.period == pytest.approx(sim.period, abs=1e-9)
    assert timing.makespan == pytest.approx(sim.makespan, abs=1e-9)
    assert fast == pytest.approx((sim.period, sim.makespan), abs=1e-9)
    assert peak_memory(problem, sol.seqs) == pytest.approx(sim.peak_memory, abs=1e-9)
    sync = simulate(plan, iterations=4, synchronous_optimizer=True)
    assert time_sequences(problem, sol.seqs, 4, synchronous=True).period == pytest.approx(sync.period, abs=1e-9)


@given(problems(max_pp=3, max_dp=2, max_mb=3))
def test_work_bound_is_below_the_exact_period(problem):
    sol = greedy(problem, time_budget=0.05)
    exact = exact_period(problem, sol.seqs)
    assert work_bound(problem) <= exact + 1e-9
    # ...and the helper agrees with a long run of the solvers' clock (the steady state is reached).
    assert FastTimer(problem, 40).score(sol.seqs)[0] == pytest.approx(exact, abs=1e-6)


@given(problems(max_pp=4, max_dp=3, max_mb=4), st.integers(0, 2))
def test_memory_bound_is_below_the_exact_period_of_any_schedule_found(problem, seed):
    """The warm-up bound holds for the greedy schedule and for local-search variants of it (other
    orders and routings), in both optimizer modes, against the independent max-plus period."""
    sol = greedy(problem, time_budget=0.05)
    seqs, _ = improve(problem, sol.seqs, work=20_000, seed=seed)
    for candidate in (sol.seqs, seqs):
        for synchronous in (False, True):
            assert lower_bound(problem) <= exact_period(problem, candidate, synchronous) + 1e-9
    if problem.costs.memory_limit is None:
        assert memory_bound(problem) == 0.0


@given(problems(max_pp=4, max_dp=3, max_mb=4, broken=True), st.sampled_from([2.0, 0.5]), st.integers(0, 2))
def test_memory_bound_of_a_re_cut_job_is_below_the_exact_period_of_any_schedule_found(problem, piece, seed):
    """With failed pipelines re-cut (`schedcomp.recut`) the warm-up bound comes from the workers running their
    own whole micro-batches only; it holds for the list scheduler's pinned-piece variants with and without
    lookahead (the schedules that reach such bounds), the greedy solver's schedule and local-search variants
    of it."""
    try:
        problem.check_memory()
    except MemoryLimitError:
        assume(False)  # no schedule at all: nothing to bound
    cut, routing = recut(problem, piece)
    problem = replace(problem, cut=cut)
    problem = replace(problem, routing=tuple(sorted((problem.slot_id(*k), w) for k, w in routing.items())))
    sol = greedy(problem, time_budget=0.05)
    seqs, _ = improve(problem, sol.seqs, work=20_000, seed=seed)
    quota = balanced_quota(problem)
    assignment = assign_orphans(problem, quota)
    window = default_windows(problem)["h2"]  # (the pinned-piece variants the portfolio tries first; each
    # candidate's exact period is costly, so a few of them)
    variants = [list_schedule(problem, GreedyParams(window, policy, "static", fill=True, lookahead=ahead),
                              assignment, quota) for policy in ("idle", "fit") for ahead in (False, True)]
    bound = lower_bound(problem)
    for candidate in (sol.seqs, seqs, *variants):
        if within_limits(problem, candidate):
            assert bound <= exact_period(problem, candidate) + 1e-9


def test_memory_bound_is_reached_where_the_limit_binds():
    """pp=4, one pipeline, M=8, 1F1B's memory (4 units at every stage): the bound is ZB-H1's period, 27
    (work 24 plus the 3 units stage 0 idles before its first gradient comes back), and the greedy
    scheduler reaches it."""
    problem = Problem(Topology.of(4, 1), 8, CostModel.uniform(4, memory_limit=4.0))
    assert work_bound(problem) == 24.0 and memory_bound(problem) == 27.0
    assert greedy(problem).period == pytest.approx(memory_bound(problem))


@pytest.mark.parametrize(("problem", "optimum"), [
    pytest.param(Problem(Topology.of(2, 2, [(1, 0)]), 1, CostModel.uniform(2, memory_limit=1.5)), 9.0, id="rerouted"),
    pytest.param(Problem(Topology.of(3, 2, [(1, 1)]), 1, CostModel.uniform(3, memory_limit=1.5)), 11.0, id="middle"),
    pytest.param(Problem(Topology.of(3, 1), 2, CostModel.uniform(3, memory_limit=1.0), split=False), 18.0,
                 id="fused"),
])
def test_memory_bound_is_the_optimum_over_every_schedule(problem, optimum):
    """Brute force over every schedule within the limit: the best period is `optimum`, well above the
    work bound, and the memory bound finds it (the bound is not always tight: pp=2, M=3 at a limit of
    one activation has 13 against an optimum of 15; the property test above checks it stays below)."""
    best = min(exact_period(problem, seqs) for seqs in all_schedules(problem) if memory_ok(problem, seqs))
    assert best == pytest.approx(optimum, abs=1e-6)
    assert work_bound(problem) < memory_bound(problem) == pytest.approx(best, abs=1e-9)


def test_a_deadlocking_order_has_no_period():
    problem = Problem(Topology.of(2, 1), 1, CostModel.uniform(2))
    # Stage 0 runs B before F: B waits for F.
    seqs = {0: [1, 0, 2], 1: [3, 4, 5]}
    assert not time_sequences(problem, seqs).ok
    assert math.isinf(FastTimer(problem).score(seqs)[0])
    assert math.isinf(exact_period(problem, seqs))


# ---- the greedy scheduler ------------------------------------------------------------------------------


@pytest.mark.parametrize(("limit", "split", "period"), [
    (None, True, 24.0),   # ZB-H2's zero bubble (with the staggered optimizer)
    (4.0, True, 27.0),    # at 1F1B's memory: ZB-H1's (p-1)(F+B-W) bubble
    (None, False, 33.0),  # fused backward: 1F1B's (p-1)(F+B+W) bubble
])
def test_greedy_reaches_the_zero_bubble_closed_forms(limit, split, period):
    problem = Problem(Topology.of(4, 1), 8, CostModel.uniform(4, memory_limit=limit), split)
    sol = greedy(problem)
    assert sol.period == pytest.approx(period)
    if limit is not None:
        assert peak_memory(problem, sol.seqs) <= limit


def test_greedy_fills_the_bubbles_with_one_failure():
    """Unit costs, pp=4, dp=4, M=8: the three peers absorb 8 micro-batches; the stage-1 peers each run
    10 or 11 slots (3 ops each), which the period must reach but not pass."""
    problem = Problem(Topology.of(4, 4, [(3, 1)]), 8, CostModel.uniform(4))
    sol = greedy(problem)
    assert work_bound(problem) == 33.0
    assert sol.period == pytest.approx(33.0)


@pytest.mark.parametrize("policy", W_POLICIES)
@pytest.mark.parametrize("routing", ROUTINGS)
def test_greedy_schedules_ops_of_zero_time(policy, routing):
    """Free W, and free F at stage 1: an op that ends the instant it starts makes workers due at that very
    instant (its own next op, the next stage's F); they still run (merged into that instant's workers),
    so nothing stalls and every op is scheduled once."""
    costs = CostModel(forward=[1.0, 0.0, 1.0], backward_input=[1.0] * 3, backward_weight=[0.0] * 3)
    problem = Problem(Topology.of(3, 3, [(1, 1)]), 4, costs)
    quota = balanced_quota(problem)
    params = GreedyParams(default_windows(problem)["h2"], policy, routing)
    seqs = list_schedule(problem, params, assign_orphans(problem, quota), quota)
    assert sorted(op for seq in seqs.values() for op in seq) == list(range(problem.n_slots * 3))
    assert time_sequences(problem, seqs).ok
    assert seqs == list_schedule(problem, params, assign_orphans(problem, quota), quota)


def test_local_search_never_makes_things_worse_and_keeps_memory():
    problem = Problem(Topology.of(3, 2, [(1, 1)]), 2, CostModel.uniform(3, p2p=0.5, allreduce=1.0,
                                                                        memory_limit=2.0))
    sol = greedy(problem, time_budget=0.0)
    seqs, score = improve(problem, sol.seqs, time_budget=1.0, max_moves=400)
    assert score <= (sol.period, sol.makespan)
    assert score == FastTimer(problem).score(seqs)
    assert memory_ok(problem, seqs)


# ---- routing -----------------------------------------------------------------------------------------------


def test_stragglers_take_fewer_rerouted_microbatches():
    costs = CostModel(forward=[1.0] * 2, backward_input=[1.0] * 2, backward_weight=[1.0] * 2,
                      speed={Worker(1, 1): 0.5})
    problem = Problem(Topology.of(2, 4, [(0, 1)]), 6, costs)
    quota = balanced_quota(problem)
    share = {problem.worker_of(w): n for w, n in quota.items() if n}
    assert sum(share.values()) == 6
    assert share.get(Worker(1, 1), 0) < share[Worker(2, 1)] == share[Worker(3, 1)]
    assignment = assign_orphans(problem, quota)
    assert sorted(assignment) == sorted(problem.orphan_slots[1])
    assert all(problem.worker_of(w).stage == 1 and w != problem.worker_id(Worker(0, 1)) for w in assignment.values())


def test_a_stage_without_live_workers_needs_a_checkpoint():
    problem = Problem(Topology.of(2, 2, [(0, 1), (1, 1)]), 2, CostModel.uniform(2))
    with pytest.raises(RecoveryError, match=r"stage 1.*checkpoint"):
        greedy(problem)


def test_an_impossible_memory_limit_names_the_stage_and_the_least_memory():
    costs = CostModel(forward=[1.0] * 3, backward_input=[1.0] * 3, backward_weight=[1.0] * 3,
                      activation=[1.0, 3.0, 2.0], memory_limit=2.5)
    problem = Problem(Topology.of(3, 2, [(0, 0)]), 2, costs)
    with pytest.raises(MemoryLimitError, match=r"stage 1: raise the limit to at least 3"):
        problem.check_memory()


# ---- CP-SAT against brute force -------------------------------------------------------------------------


def _nonuniform(pp: int, **kw) -> CostModel:
    return CostModel(forward=[1.0 + 0.5 * (s % 2) for s in range(pp)], backward_input=[2.0] * pp,
                     backward_weight=[1.0 - 0.5 * (s % 2) for s in range(pp)], **kw)


BRUTE_CASES = [
    pytest.param(Problem(Topology.of(2, 2, [(1, 0)]), 1, CostModel.uniform(2)), "period", False, id="reroute"),
    pytest.param(Problem(Topology.of(2, 1), 2, _nonuniform(2, p2p=0.5)), "period", False, id="two-microbatches"),
    pytest.param(Problem(Topology.of(2, 3, [(2, 1)]), 1,
                         _nonuniform(2, p2p=0.25, allreduce=[1.0, 1.0], optimizer=[0.5, 0.5],
                                     speed={Worker(1, 1): 0.5})), "period", False, id="straggler-peer"),
    pytest.param(Problem(Topology.of(3, 2, [(1, 1)]), 1,
                         _nonuniform(3, activation=[1.0, 1.0, 1.0], memory_limit=1.5)), "period", False,
                 id="memory-limit"),
    pytest.param(Problem(Topology.of(2, 2, [(1, 0)]), 1, _nonuniform(2, p2p=0.5), split=False), "period", False,
                 id="fused"),
    pytest.param(Problem(Topology.of(2, 2, [(0, 1)]), 1, _nonuniform(2, p2p=0.5, allreduce=[1.0, 0.5])),
                 "period", True, id="synchronous"),
    pytest.param(Problem(Topology.of(2, 2, [(1, 0)]), 1, _nonuniform(2, p2p=0.5)), "makespan", False,
                 id="makespan"),
]


@pytest.mark.parametrize(("problem", "objective", "synchronous"), BRUTE_CASES)
def test_cpsat_proves_the_optimum_that_brute_force_finds(problem, objective, synchronous):
    best = math.inf
    count = 0
    for seqs in all_schedules(problem):
        if not memory_ok(problem, seqs):
            continue
        count += 1
        value = exact_makespan(problem, seqs) if objective == "makespan" else exact_period(problem, seqs, synchronous)
        best = min(best, value)
    assert count > 1 and math.isfinite(best)
    result = solve_cpsat(problem, time_limit=20.0, objective=objective, synchronous=synchronous, num_workers=1)
    assert result.optimal, result.status
    assert result.value == pytest.approx(best, abs=1e-6)
    assert result.bound == pytest.approx(best, abs=1e-6)
    # The order CP-SAT returns really runs at that value, within the memory limit.
    got = exact_makespan(problem, result.seqs) if objective == "makespan" else \
        exact_period(problem, result.seqs, synchronous)
    assert got == pytest.approx(best, abs=1e-6)
    assert memory_ok(problem, result.seqs)


def test_cpsat_warm_start_is_never_worse_than_its_hint():
    problem = Problem(Topology.of(3, 2, [(1, 1)]), 2, _nonuniform(3, p2p=0.5))
    sol = greedy(problem, time_budget=0.0)
    timing = time_sequences(problem, sol.seqs, 4)
    result = solve_cpsat(problem, time_limit=5.0, hint=sol.seqs, hint_timing=timing, num_workers=1)
    assert result.seqs is not None
    assert result.bound <= exact_period(problem, result.seqs) + 1e-6
    assert exact_period(problem, result.seqs) <= exact_period(problem, sol.seqs) + 1e-6
