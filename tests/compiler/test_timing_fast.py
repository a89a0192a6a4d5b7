"""The solvers' timing over columns gives what it gave one worker at a time, or by the general path:
`time_sequences` given the list scheduler's steps as its levels (`greedy.list_schedule_steps`,
`timecore.run_levels`'s `layers`) times as with Kahn's levels (the same iteration ends and the same start of
every op, on random problems and every variant; steps that some dependency does not climb are refused), and
each worker's memory peak and busy time (`worker_peaks`, `simfast`) are the floats a loop over its ops adds."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from solver_helpers import problems

from schedcomp import timecore
from schedcomp.adaptive import ITERATIONS, portfolio
from schedcomp.costs import CostModel
from schedcomp.memory import stage_deltas
from schedcomp.recut import PIECES, recut
from schedcomp.route import assign_orphans, balanced_quota
from schedcomp.simfast import solver_timing
from schedcomp.solvers.greedy import list_schedule_steps
from schedcomp.solvers.problem import Problem
from schedcomp.solvers.timing import Timing, dependencies_of, op_dependencies, time_sequences, worker_peaks
from schedcomp.topology import Topology


@st.composite
def scheduled(draw: st.DrawFn) -> tuple[Problem, dict[int, list[int]], np.ndarray]:
    """(problem, sequences, steps) of one list-scheduler variant on a random problem: failures, uneven costs
    (some zero: ops of no time, whose steps may not climb), speeds, split or fused backward, memory limits."""
    problem = draw(problems(max_pp=4, max_microbatches=5, times=(0.0, 0.5, 1.0, 1.25, 2.0)))
    params = draw(st.sampled_from(portfolio(problem)))
    quota = balanced_quota(problem)
    seqs, steps = list_schedule_steps(problem, params, assign_orphans(problem, quota), quota)
    return problem, seqs, steps


def _same(a: Timing, b: Timing) -> bool:
    return (a.iteration_ends == b.iteration_ends and np.array_equal(a.ops, b.ops)
            and np.array_equal(a.first, b.first) and np.array_equal(a.last, b.last))


@given(scheduled(), st.integers(1, 5), st.booleans())
def test_steps_time_as_kahns_levels(job: tuple[Problem, dict[int, list[int]], np.ndarray], iterations: int,
                                    synchronous: bool) -> None:
    problem, seqs, steps = job
    kahn = time_sequences(problem, seqs, iterations, synchronous)
    assert kahn.ok
    assert _same(time_sequences(problem, seqs, iterations, synchronous, steps), kahn)


@given(problems(max_pp=4, max_microbatches=5), st.data())
def test_an_ops_own_dependencies_are_its_rows_of_the_table(problem: Problem, data: st.DataObject) -> None:
    """`time_sequences` works out only its ops' dependencies: the same rows as the table of every op id."""
    pred, lat = op_dependencies(problem)
    ops = np.array(data.draw(st.lists(st.integers(0, len(pred) - 1), max_size=40)), dtype=np.int64)
    own_pred, own_lat = dependencies_of(ops, problem.stages, len(problem.kinds), problem.costs.p2p)
    assert np.array_equal(own_pred, pred[ops]) and np.array_equal(own_lat, lat[ops])


@pytest.mark.parametrize(("pp", "dp", "failed"), [(4, 3, [(0, 1), (2, 3)]), (6, 2, [(1, 0)]), (3, 1, [])])
def test_the_schedulers_steps_are_taken_where_they_are_few(
        pp: int, dp: int, failed: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch) -> None:
    """Unit costs (the scale case's): about as many steps as levels, which the core takes."""
    problem = Problem(Topology.of(pp, dp, failed), 8, CostModel.uniform(pp), split=True)
    quota = balanced_quota(problem)
    seqs, steps = list_schedule_steps(problem, portfolio(problem)[0], assign_orphans(problem, quota), quota)
    kahn = time_sequences(problem, seqs, 4)

    def no_kahn(*args: object) -> None:
        raise AssertionError("Kahn's levels were worked out")

    monkeypatch.setattr(timecore, "_levels", no_kahn)
    assert _same(time_sequences(problem, seqs, 4, steps=steps), kahn)


def test_steps_that_a_dependency_does_not_climb_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps turned upside down (every edge goes down), all equal, or each op's own (valid, but many more than
    the levels): Kahn's levels, the same times."""
    problem = Problem(Topology.of(4, 2, [(1, 2)]), 6, CostModel.uniform(4), split=True)
    quota = balanced_quota(problem)
    seqs, steps = list_schedule_steps(problem, portfolio(problem)[0], assign_orphans(problem, quota), quota)
    kahn = time_sequences(problem, seqs, 3)
    calls = []
    levels = timecore._levels
    monkeypatch.setattr(timecore, "_levels", lambda *args: calls.append(1) or levels(*args))
    assert _same(time_sequences(problem, seqs, 3, steps=steps), kahn) and not calls
    ranked = np.zeros_like(steps)  # (each op its own step, in the order of the scheduler's steps)
    ranked[np.argsort(steps, kind="stable")] = np.arange(len(steps))
    for wrong in (-steps, np.zeros_like(steps), ranked):
        assert _same(time_sequences(problem, seqs, 3, steps=wrong), kahn)
    assert len(calls) == 3


def _peaks_one_by_one(problem: Problem, seqs: dict[int, list[int]]) -> dict[int, float]:
    """Each worker's running sum of its ops' memory deltas, its largest (as `worker_peaks` did per worker)."""
    nk = len(problem.kinds)
    peaks = {}
    for wid, seq in seqs.items():
        if seq:
            deltas = [stage_deltas(problem.costs, op // nk % problem.stages)[problem.kinds[op % nk]] for op in seq]
            sizes = [1.0 if problem.slot_sizes is None else problem.slot_sizes[op // nk] for op in seq]
            peaks[wid] = float(np.cumsum(np.array(deltas) * np.array(sizes)).max())
    return peaks


@given(scheduled(), st.booleans())
def test_peaks_and_busy_times_are_a_loops_sums(job: tuple[Problem, dict[int, list[int]], np.ndarray],
                                               synchronous: bool) -> None:
    problem, seqs, _ = job
    assert worker_peaks(problem, seqs) == _peaks_one_by_one(problem, seqs)
    timed = solver_timing(problem, seqs, time_sequences(problem, seqs, ITERATIONS, synchronous), ITERATIONS,
                          synchronous)
    assert timed is not None
    snk = problem.stages * len(problem.kinds)
    assert list(timed.timing.busy) == [problem.worker_of(wid) for wid in sorted(seqs)]
    assert timed.timing.busy == {problem.worker_of(wid): sum(problem.op_times[wid][op % snk] for op in seq)
                                 for wid, seq in seqs.items()}


def test_peaks_of_re_cut_micro_batches_scale_with_their_size() -> None:
    problem = Problem(Topology.of(4, 3, [(1, 2)]), 6, CostModel.uniform(4, p2p=0.1), split=True)
    cut, routing = recut(problem, PIECES[-1])
    cut_problem = replace(problem, cut=cut)
    cut_problem = replace(cut_problem, routing=tuple(sorted((cut_problem.slot_id(*key), wid)
                                                             for key, wid in routing.items())))
    assert cut_problem.slot_sizes is not None and len(set(cut_problem.slot_sizes)) > 1
    seqs = list_schedule_steps(cut_problem, portfolio(cut_problem)[0], dict(cut_problem.routing))[0]
    assert worker_peaks(cut_problem, seqs) == _peaks_one_by_one(cut_problem, seqs)
