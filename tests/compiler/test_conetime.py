"""Re-timing only the cone of an edit (`schedcomp.conetime`, `OpTimes.edited`) gives exactly the times of
timing every op again (`solvers.timing.time_sequences`), and the same verdict where the edit deadlocks: on
random edits of random small jobs (a worker fails and its ops land anywhere on its peers, lanes shuffled),
and on every re-timed repair of the small plans of `bench/bench_repair_sweep.py`."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from solver_helpers import swap_neighbours

import schedcomp.optimes as optimes_module
import schedcomp.repair as repair_module
from schedcomp.compiler import compile
from schedcomp.conetime import successors
from schedcomp.costs import CostModel
from schedcomp.errors import RecoveryError
from schedcomp.optimes import OpTimes, retimed, timeline
from schedcomp.solvers.merged import merged_sequences
from schedcomp.solvers.plain import plain_sequences
from schedcomp.solvers.problem import Problem
from schedcomp.solvers.timing import time_sequences
from schedcomp.topology import PLACEMENTS, Topology, Worker

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # the sweep's plans, defined once
from bench_repair_sweep import PLANS


def full_times(problem: Problem, seqs: dict[int, np.ndarray]) -> np.ndarray | None:
    """Every op's first-iteration start, all ops timed (the solvers' engine), or None on a deadlock."""
    timing = time_sequences(problem, seqs, iterations=1)
    if not timing.ok:
        return None
    start = np.full(problem.n_slots * len(problem.kinds), np.nan)
    start[timing.ops] = timing.first
    return start


def same(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and np.array_equal(a, b, equal_nan=True))


@st.composite
def edits(draw):
    """(base timeline, problem after the edit, edited orders): a re-routed order of a random job (costs,
    speeds, latency, split or fused backward, one or two chunks, looped or V), then one more worker fails and
    each of its ops goes to a random live peer, anywhere or after the ops it had before it there (either may
    deadlock), and a few neighbouring ops of other lanes swap."""
    chunks = draw(st.integers(1, 2))
    placement = draw(st.sampled_from(PLACEMENTS)) if chunks > 1 else PLACEMENTS[0]
    pp, dp, mb = draw(st.integers(1, 3)), draw(st.integers(2, 3)), draw(st.integers(1, 4))
    workers = [Worker(d, s) for d in range(dp) for s in range(pp)]
    failed = set(draw(st.lists(st.sampled_from(workers), max_size=1)))
    times = st.lists(st.sampled_from([0.25, 0.5, 1.0, 1.5]), min_size=pp * chunks, max_size=pp * chunks)
    costs = CostModel(forward=draw(times), backward_input=draw(times), backward_weight=draw(times),
                      p2p=draw(st.sampled_from([0.0, 0.1, 0.5])), allreduce=draw(times), optimizer=draw(times),
                      speed=draw(st.dictionaries(st.sampled_from(workers), st.sampled_from([0.5, 0.8, 1.5]),
                                                 max_size=3)))
    problem = Problem(Topology.of(pp, dp, failed, chunks, placement), mb, costs, split=draw(st.booleans()))
    rng = random.Random(draw(st.integers(0, 2**16)))
    if chunks == 1:
        orders = plain_sequences(problem)
    else:  # each orphan chunk on a random peer at its place (a micro-batch's chunks may share one or not)
        peers = [[problem.worker_id(w) for w in group] for group in problem.survivors]
        orders = merged_sequences(problem, {slot: rng.choice(peers[place])
                                            for place, group in enumerate(problem.orphan_slots) for slot in group})
    seqs = {wid: np.asarray(seq, dtype=np.int64) for wid, seq in orders.items()}
    base = timeline(problem, seqs)
    assert base is not None and base.exact
    live = sorted(problem.topology.live_workers)
    movable = [w for w in live if len(problem.topology.stage_group(w.stage)) > 1]
    assume(movable)
    dead = draw(st.sampled_from(movable))
    after = problem.with_failed(Topology.of(pp, dp, failed | {dead}, chunks, placement), costs)
    new = {wid: list(seq) for wid, seq in seqs.items() if wid != problem.worker_id(dead)}
    peers = [problem.worker_id(w) for w in after.topology.stage_group(dead.stage)]
    shuffle = draw(st.booleans())  # anywhere (mostly deadlocks), or in the dead worker's order on each peer
    after_last = dict.fromkeys(peers, 0)
    for op in seqs[problem.worker_id(dead)].tolist():
        peer = rng.choice(peers)
        at = rng.randrange(0 if shuffle else after_last[peer], len(new[peer]) + 1)
        new[peer].insert(at, op)
        after_last[peer] = at + 1
    swap_neighbours(rng, problem, new, draw(st.integers(0, 3)))
    # Lanes the edit left alone keep their very arrays (as a repair hands them on).
    edited = {wid: seqs[wid] if lane == seqs[wid].tolist() else np.asarray(lane, dtype=np.int64)
              for wid, lane in new.items()}
    return base, after, edited


@settings(max_examples=150, deadline=None)
@given(edits())
def test_the_cone_is_timed_as_timing_everything_would(edit: tuple[OpTimes, Problem, dict[int, np.ndarray]]) -> None:
    base, problem, seqs = edit
    got = base.edited(problem, seqs)
    want = full_times(problem, seqs)
    assert same(None if got is None else got.start, want)
    if got is not None:
        assert got.exact and got.seqs is seqs  # a further edit starts from these


def test_an_edit_that_waits_on_itself_is_a_deadlock() -> None:
    problem = Problem(Topology.of(2, 2, set()), 2, CostModel.uniform(2, p2p=0.5))
    seqs = {wid: np.asarray(seq, dtype=np.int64) for wid, seq in plain_sequences(problem).items()}
    base = timeline(problem, seqs)
    assert base is not None
    after = problem.with_failed(Topology.of(2, 2, {Worker(1, 1)}), problem.costs)
    dead, peer = problem.worker_id(Worker(1, 1)), problem.worker_id(Worker(0, 1))
    # The dead worker's ops, backwards, ahead of its peer's: each backward before the forward it reads from.
    edited = {wid: seq for wid, seq in seqs.items() if wid != dead}
    edited[peer] = np.concatenate((seqs[dead][::-1], seqs[peer]))
    assert base.edited(after, edited) is None and full_times(after, edited) is None
    # The same ops in their own order after the peer's: it runs.
    edited[peer] = np.concatenate((seqs[peer], seqs[dead]))
    got = base.edited(after, edited)
    assert got is not None and same(got.start, full_times(after, edited))


def test_an_op_lost_or_run_twice_is_refused() -> None:
    problem = Problem(Topology.of(2, 2, set()), 2, CostModel.uniform(2))
    seqs = {wid: np.asarray(seq, dtype=np.int64) for wid, seq in plain_sequences(problem).items()}
    base = timeline(problem, seqs)
    assert base is not None
    lost = {**seqs, 0: seqs[0][1:]}
    twice = {**seqs, 0: np.concatenate((seqs[0], seqs[0][-1:])), 1: seqs[1][:-1]}
    assert base.edited(problem, lost) is None and base.edited(problem, twice) is None


def test_successors_read_every_dependency_the_other_way() -> None:
    pred = np.array([[-1, -1], [0, -1], [0, 1], [2, 0]])
    succ = successors(pred)
    assert {(int(p), v) for v, row in enumerate(pred) for p in row if p >= 0} == \
        {(p, int(v)) for p, row in enumerate(succ) for v in row if v >= 0}
    assert succ.shape == (4, 3) and not succ.flags.writeable


@pytest.mark.parametrize("kw", PLANS, ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
def test_every_re_timed_repair_is_timed_as_timing_everything_would(kw: dict[str, object],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    checked: list[bool] = []
    whole: list[int] = []  # timings of a whole plan: a repair's re-timing must do none (only its cone)
    real_timeline = optimes_module.timeline
    monkeypatch.setattr(optimes_module, "timeline", lambda *a, **k: whole.append(1) or real_timeline(*a, **k))

    def spied(times: OpTimes, topology, costs, orders):  # type: ignore[no-untyped-def]
        problem = times.problem.with_failed(topology, costs)
        want = full_times(problem, times._seqs_of(topology, orders))
        before = len(whole)
        got = retimed(times, topology, costs, orders)
        assert len(whole) == before, "re-timed the whole plan, not the cone of the edit"
        assert times.exact and same(None if got is None else got.start, want)
        checked.append(got is None)
        return got

    monkeypatch.setattr(repair_module, "retimed", spied)
    plan = compile(**kw)  # type: ignore[arg-type]
    for dead in sorted(plan.streams):
        if len(plan.topology.stage_group(dead.stage)) > 1:
            try:
                repair_module.repair(plan, dead, validate=False)
            except RecoveryError as exc:
                assert "memory" in str(exc)
    assert checked  # some forwards waited, so repair re-timed (and some of those deadlocked: refused)


def _moved(seqs: dict[int, np.ndarray], dead: int, peer: int) -> dict[int, np.ndarray]:
    """`seqs` with lane `dead` gone, its ops appended to lane `peer` (in their order: it runs)."""
    edited = {wid: seq for wid, seq in seqs.items() if wid != dead}
    edited[peer] = np.concatenate((seqs[peer], seqs[dead]))
    return edited


def test_other_costs_or_a_dead_lane_are_timed_whole() -> None:
    """A problem that is not this timeline's with more failures (other speeds, another latency), or lanes that
    still name a failed worker: nothing of the kept times holds, so everything is timed (as it would be)."""
    from dataclasses import replace

    problem = Problem(Topology.of(2, 2, set()), 2, CostModel.uniform(2, p2p=0.5))
    seqs = {wid: np.asarray(seq, dtype=np.int64) for wid, seq in plain_sequences(problem).items()}
    base = timeline(problem, seqs)
    assert base is not None
    after = problem.with_failed(Topology.of(2, 2, {Worker(1, 1)}), problem.costs)
    assert base.edited(after, dict(seqs)) is None and full_times(after, dict(seqs)) is None
    edited = _moved(seqs, problem.worker_id(Worker(1, 1)), problem.worker_id(Worker(0, 1)))
    for costs in (replace(problem.costs, speed={Worker(0, 0): 0.5}), replace(problem.costs, p2p=0.1)):
        other = Problem(Topology.of(2, 2, {Worker(1, 1)}), 2, costs)
        got = base.edited(other, edited)
        assert got is not None and same(got.start, full_times(other, edited))


def test_lanes_are_read_only_and_unknown_op_ids_are_refused() -> None:
    problem = Problem(Topology.of(2, 2, set()), 2, CostModel.uniform(2))
    base = timeline(problem, {wid: np.asarray(seq, dtype=np.int64) for wid, seq in plain_sequences(problem).items()})
    assert base is not None
    with pytest.raises(ValueError):  # an in-place edit would look unchanged to the cone (the very array)
        base.seqs[0][0] = base.seqs[0][1]
    assert base.edited(problem, {**base.seqs, 0: np.append(base.seqs[0], len(base.start))}) is None


def test_a_chain_of_edits_and_re_cut_sizes_are_timed_as_timing_everything_would() -> None:
    """An edit of a cone-timed timeline (a repair of a repaired plan), on a job whose failed pipeline is re-cut
    into micro-batches of several sizes (ops' durations scale with them)."""
    from dataclasses import replace

    from schedcomp.adaptive import greedy
    from schedcomp.recut import recut

    costs = CostModel(forward=[1.0, 1.5], backward_input=[1.0, 2.0], backward_weight=[0.5, 1.0], p2p=0.2)
    problem = Problem(Topology.of(2, 4, {Worker(3, 1)}), 4, costs)
    cut, _ = recut(problem, 0.5)
    problem = replace(problem, cut=cut)
    assert problem.slot_sizes is not None and len(set(problem.slot_sizes)) > 1
    seqs = {wid: np.asarray(seq, dtype=np.int64) for wid, seq in greedy(problem).seqs.items()}
    times = timeline(problem, seqs)
    assert times is not None
    failed = {Worker(3, 1)}
    for dead, peer in ((Worker(2, 1), Worker(0, 1)), (Worker(1, 0), Worker(0, 0))):
        failed.add(dead)
        after = problem.with_failed(Topology.of(2, 4, set(failed)), costs)
        edited = _moved(times.seqs, problem.worker_id(dead), problem.worker_id(peer))
        got = times.edited(after, edited)
        assert got is not None and got.exact and same(got.start, full_times(after, edited))
        times, problem = got, after
