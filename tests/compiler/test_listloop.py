"""The list scheduler's two event loops (`solvers.greedy`: the Python loop, the reference, and the compiled one,
`_listloop.c` via `solvers.greedy_native`) give the same schedule op for op, and the same clock steps, on every
variant: routings, W policies, scaled windows, pinned pieces and lookahead on re-cut jobs (halves too), virtual
stages, p2p latency, speed factors, memory limits, ops of zero time."""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedcomp.adaptive import portfolio
from schedcomp.costs import CostModel
from schedcomp.errors import ScheduleError
from schedcomp.recut import PIECES, halve_the_rest, recut
from schedcomp.route import assign_orphans, balanced_quota
from schedcomp.solvers import greedy_native
from schedcomp.solvers.greedy import ROUTINGS, W_POLICIES, GreedyParams, list_schedule_steps
from schedcomp.solvers.greedy_loop import LoopInputs, python_loop
from schedcomp.solvers.greedy_tables import default_windows
from schedcomp.solvers.problem import Problem
from schedcomp.topology import Topology, Worker

native = pytest.mark.skipif(greedy_native._listloop is None and not os.environ.get("CI"),
                            reason="the compiled list loop was not built here (no C compiler at install)")


def both(problem: Problem, params: GreedyParams) -> tuple[object, object]:
    """Each loop's result, or the error it raised (type and message)."""
    quota = balanced_quota(problem)
    assignment = dict(problem.routing) if problem.routing else assign_orphans(problem, quota)
    out = []
    for loop in greedy_native.ENGINES:
        try:
            seqs, steps = list_schedule_steps(problem, params, assignment, quota, loop)
            out.append((seqs, steps.tolist()))
        except ScheduleError as exc:
            out.append((type(exc), str(exc)))
    return out[0], out[1]


@st.composite
def jobs(draw: st.DrawFn) -> Problem:
    """A random job: failures (a live worker kept per stage), per-stage times with zeros among them, p2p,
    speed factors, virtual stages, a memory limit or none, split or fused backward; sometimes re-cut."""
    chunks = draw(st.sampled_from([1, 1, 2]))
    pp, dp, mb = draw(st.integers(1, 4)), draw(st.integers(1, 4)), draw(st.integers(1, 6))
    workers = [Worker(d, s) for d in range(dp) for s in range(pp)]
    failed = set(draw(st.lists(st.sampled_from(workers), max_size=min(3, len(workers)), unique=True)))
    for s in range(pp):
        if all(Worker(d, s) in failed for d in range(dp)):
            failed.discard(Worker(0, s))
    stages = pp * chunks
    per_stage = st.lists(st.sampled_from([0.0, 0.5, 1.0, 1.25, 2.0]), min_size=stages, max_size=stages)
    costs = CostModel(forward=draw(per_stage), backward_input=draw(per_stage), backward_weight=draw(per_stage),
                      p2p=draw(st.sampled_from([0.0, 0.1, 0.25])),
                      activation=draw(st.lists(st.sampled_from([1.0, 2.0]), min_size=stages, max_size=stages)),
                      b_frees=draw(st.sampled_from([0.0, 0.5, 1.0])),
                      speed=draw(st.dictionaries(st.sampled_from(workers), st.sampled_from([0.5, 0.8, 2.0]),
                                                 max_size=2)))
    if draw(st.booleans()):
        costs = costs.with_memory_limit(max(costs.activation) * chunks * draw(st.sampled_from([1.0, 1.5, 3.0])))
    problem = Problem(Topology.of(pp, dp, failed, chunks=chunks), mb, costs, split=draw(st.booleans()))
    if chunks == 1 and failed and draw(st.booleans()):
        cut, routing = recut(problem, draw(st.sampled_from(PIECES)))
        if draw(st.booleans()):
            cut = halve_the_rest(cut, dp, mb)
        problem = replace(problem, cut=cut)
        problem = replace(problem, routing=tuple(sorted((problem.slot_id(*k), w) for k, w in routing.items())))
    return problem


@st.composite
def variants(draw: st.DrawFn, problem: Problem) -> GreedyParams:
    window = default_windows(problem)[draw(st.sampled_from(["h2", "rtt", "1f1b"]))]
    routing = draw(st.sampled_from(ROUTINGS))
    fill = bool(problem.cut) and draw(st.booleans())
    ahead = routing == "static" and problem.topology.chunks == 1 and draw(st.booleans())
    return GreedyParams(window, draw(st.sampled_from(W_POLICIES)), routing, draw(st.booleans()), fill, ahead)


@native
@settings(max_examples=300, deadline=None)
@given(st.data())
def test_the_compiled_loop_schedules_as_the_python_loop(data: st.DataObject) -> None:
    problem = data.draw(jobs())
    params = data.draw(variants(problem))
    python, compiled = both(problem, params)
    assert compiled == python


@native
def test_every_portfolio_variant_of_a_larger_job_is_the_same() -> None:
    """pp 8, dp 8, four failures (two at one stage), p2p and an all-reduce, the default memory limit, and the
    job re-cut with the others halved: every variant the adaptive solver would try."""
    topology = Topology.of(8, 8, [(1, 2), (5, 2), (3, 6), (6, 0)])
    base = Problem(topology, 12, CostModel.uniform(8, p2p=0.1, allreduce=1.0).with_memory_limit(6.0))
    cut, routing = recut(base, PIECES[0])
    cut_job = replace(base, cut=halve_the_rest(cut, 8, 12))
    cut_job = replace(cut_job, routing=tuple(sorted((cut_job.slot_id(*k), w) for k, w in routing.items())))
    for problem in (base, cut_job):
        for params in portfolio(problem):
            python, compiled = both(problem, params)
            assert compiled == python, params
            assert isinstance(python[0], dict) and sum(map(len, python[0].values())) == problem.n_present * 3


@native
def test_a_stalled_schedule_is_the_same_error_from_either_loop() -> None:
    """Static routing onto a worker with a window of 0 never runs its F: both loops stop and say so."""
    problem = Problem(Topology.of(2, 2, [(0, 1)]), 2, CostModel.uniform(2))
    python, compiled = both(problem, GreedyParams((1, 0), "idle", "static"))
    assert python[0] is ScheduleError and "stalled after" in python[1]
    assert compiled == python


@native
def test_the_compiled_loop_is_the_default_where_it_was_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SCHEDCOMP_LIST_LOOP", raising=False)
    assert greedy_native.engine() == "native"
    monkeypatch.setenv("SCHEDCOMP_LIST_LOOP", "python")
    assert greedy_native.engine() == "python"
    monkeypatch.setenv("SCHEDCOMP_LIST_LOOP", "fortran")
    with pytest.raises(ValueError, match="pick one of native, python"):
        greedy_native.engine()


@native
def test_wrong_tables_are_an_error_not_a_crash() -> None:
    """A table the loop would index out of range, or that holds a stage at a place that is not its own, is
    refused before the loop runs; a log that would overflow is an error after it (not a crash either way)."""
    good = LoopInputs(
        n_workers=4, pp=2, stages=2, nk=3, n_slots=8, n_ops=24, split=True, eager=False, idle=True, use_pool=False,
        capped=False, fill=False, ahead=False, cut=False, p2p=0.0, limits=[np.inf] * 4, window_open=[1.0] * 4,
        admit=[1.0] * 4, dur=[[1.0] * 6] * 4, cap=[], left_f=[0] * 4, live=[0, 1, 2, 3], first=[True, True],
        d_f=[1.0, 1.0], reserve=[0.0, 0.0], d_b=[0.0, 0.0], d_w=[-1.0, -1.0], place=(0, 1), unit=[1.0, 1.0],
        room=[], held=[(0,), (1,)], peers=[[0, 2], [1, 3]], runner=[0, 1, 2, 3] * 2, home=[], size=None,
        starts=[0, 4, 2, 6])
    log, steps, _ = greedy_native.native_loop(good)
    python_log, python_steps, _ = python_loop(good)
    assert len(log) == 24 and log.tolist() == python_log.tolist() and steps.tolist() == python_steps.tolist()
    for change, message in ((dict(runner=[0, 1, 9, 3] * 2), "table runner out of range"),
                            (dict(limits=[np.inf] * 3), "table limits: expected 4 items"),
                            (dict(held=[(1,), (0,)]), "table held out of range"),
                            (dict(held=[(0,), (0,)], place=(0, 0)), "table held out of range")):
        with pytest.raises(ValueError, match=message):
            greedy_native.native_loop(replace(good, **change))
    with pytest.raises(RuntimeError, match="more ops than the problem has"):  # (slot 0 delivered twice)
        greedy_native.native_loop(replace(good, starts=[0, 0, 4, 2, 6]))
    big_endian = replace(greedy_native.LoopTables.of(good), limits=np.full(4, np.inf, dtype=">f8"))
    with pytest.raises(ValueError, match="table limits"):
        greedy_native.run_tables(good, big_endian)
