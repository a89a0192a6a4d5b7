"""The list scheduler's lookahead variant (`GreedyParams.lookahead`, `solvers.greedy`) and the memory warm-up
bound of re-cut jobs (`solvers.bounds.memory_bound`): issue 14's last two table-6 misses (bench/README.md)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from schedcomp.adaptive import greedy, portfolio
from schedcomp.costs import CostModel
from schedcomp.errors import ScheduleError
from schedcomp.recut import recut
from schedcomp.route import assign_orphans, balanced_quota
from schedcomp.solvers.bounds import lower_bound, memory_bound, work_bound
from schedcomp.solvers.greedy import GreedyParams, list_schedule
from schedcomp.solvers.greedy_tables import boundary_room, default_windows
from schedcomp.solvers.problem import Problem
from schedcomp.solvers.timing import time_sequences, within_limits
from schedcomp.topology import Topology

# Table 6's pp 4 job (16 layers, K = 4) re-partitioned to 4, 4, 5, 3 layers per stage: the stage model of
# that partition under the default limit (ZB-H1's per-stage peaks, each stage's device total unchanged).
SHARES = (1.0, 1.0, 1.25, 0.75)
COSTS = CostModel(forward=SHARES, backward_input=SHARES, backward_weight=SHARES, activation=SHARES,
                  memory_limit=(4.0, 3.5, 3.0, 2.5))


def cut_problem(base: Problem, piece: float) -> Problem:
    """`base` with its failed pipelines re-cut as `adaptive.recut_solution` does."""
    cut, routing = recut(base, piece)
    problem = replace(base, cut=cut)
    return replace(problem, routing=tuple(sorted((problem.slot_id(*k), w) for k, w in routing.items())))


def period(problem: Problem, params: GreedyParams) -> float:
    quota = balanced_quota(problem)
    seqs = list_schedule(problem, params, assign_orphans(problem, quota), quota)
    assert within_limits(problem, seqs)
    return time_sequences(problem, seqs, 4).period


def test_boundary_room_is_the_chain_from_a_stage_s_last_b_to_its_next_f() -> None:
    """Unit costs: stage 2's next F waits for stage 0's B, W, step and F, and stage 1's B and F: 5 (so 4
    W after the last B, 3 held before it); with p2p 0.5, all-reduce 1 (dp 2) and step 0.5, each hop
    adds 0.5 and each step 1.5, and the stage's own all-reduce and step come off its room."""
    unit = Problem(Topology.of(4, 1), 4, CostModel.uniform(4))
    assert boundary_room(unit) == [0.0, 3.0, 5.0, 7.0]
    slow = Problem(Topology.of(4, 2), 4, CostModel.uniform(4, p2p=0.5, allreduce=1.0, optimizer=0.5))
    assert boundary_room(slow) == [-1.5, 4.0, 7.0, 10.0]


def test_lookahead_keeps_the_w_for_after_the_last_b() -> None:
    """One pipeline, M 16, the 5-layer stage the bottleneck: its memory (2.4 micro-batches) leaves room for
    2 W after its last B. Without lookahead the scheduler runs one of them in the short wait before that
    B, so the chain to the next iteration (B up two stages, W, step, two F: 5) idles the stage 1.25 longer:
    64.0 against 63.5 (bound 63.0), in every window and W policy that defers W."""
    problem = Problem(Topology.of(4, 1), 16, COSTS)
    assert lower_bound(problem) == pytest.approx(63.0)
    for window in default_windows(problem).values():
        for policy in ("idle", "fit"):
            params = GreedyParams(window, policy, "static")
            assert period(problem, params) == pytest.approx(64.0)
            assert period(problem, replace(params, lookahead=True)) == pytest.approx(63.5)


def test_lookahead_turns_the_re_cut_job_of_table_6() -> None:
    """pp 4, dp 4, worker 1:3 failed, the 4, 4, 5, 3 partition, pipeline 1 re-cut in half micro-batches:
    every pinned-piece variant stopped at 64.27 (pieces at the last stage and W run just before the last B
    delayed the healthy pipelines' last round trip); with lookahead 63.5, within 1% of oobleck's 63.0 (the
    partition's bound: the warm-up of its 5-layer stage, whose workers run whole micro-batches only)."""
    problem = cut_problem(Problem(Topology.of(4, 4, [(1, 3)]), 16, COSTS), 0.5)
    assert work_bound(problem) == pytest.approx(60.0) and memory_bound(problem) == pytest.approx(63.0)
    windows = default_windows(problem)
    for name in ("h2", "1f1b"):
        params = GreedyParams(windows[name], "fit", "static", fill=True)
        assert period(problem, params) == pytest.approx(64.26515, abs=1e-4)
        assert period(problem, replace(params, lookahead=True)) == pytest.approx(63.5)
    assert any(v.lookahead for v in portfolio(problem))
    assert 63.0 <= greedy(problem, time_budget=0.25).period <= 63.5 + 1e-9


def test_the_cut_job_s_memory_bound_comes_from_its_whole_micro_batches() -> None:
    """A re-cut job keeps the warm-up bound of the workers that run their own whole micro-batches only (a
    pipeline not cut, a place with no failure): 63.75 for the 4, 5, 4, 3 partition, as without the cut,
    so that partition cannot reach 63.6 however its pieces are scheduled. Pieces alone give nothing."""
    five = (1.0, 1.25, 1.0, 0.75)
    costs = CostModel(forward=five, backward_input=five, backward_weight=five, activation=five,
                      memory_limit=(4.0, 3.5, 3.0, 2.5))
    base = Problem(Topology.of(4, 4, [(1, 3)]), 16, costs)
    for piece in (2.0, 0.5):
        problem = cut_problem(base, piece)
        assert memory_bound(problem) == pytest.approx(memory_bound(base)) == pytest.approx(63.75)
        assert lower_bound(problem) <= greedy(problem, time_budget=0.05).period + 1e-9
    # Every pipeline broken somewhere and cut: no worker runs only whole micro-batches of its own.
    broken = cut_problem(Problem(Topology.of(2, 2, [(0, 1), (1, 0)]), 4, CostModel.uniform(2, memory_limit=2.0)),
                         0.5)
    assert memory_bound(broken) == 0.0


def test_lookahead_needs_static_routing_and_one_stage_per_worker() -> None:
    problem = Problem(Topology.of(4, 2, [(1, 1)]), 4, CostModel.uniform(4))
    window = default_windows(problem)["h2"]
    with pytest.raises(ScheduleError, match="static routing"):
        list_schedule(problem, GreedyParams(window, "idle", "pool", lookahead=True), None, balanced_quota(problem))
    chunked = Problem(Topology.of(2, 2, [(1, 1)], chunks=2), 4, CostModel.uniform(4))
    quota = balanced_quota(chunked)
    with pytest.raises(ScheduleError, match="one stage per worker"):
        list_schedule(chunked, GreedyParams((3, 3), "idle", "static", lookahead=True),
                      assign_orphans(chunked, quota), quota)
