"""The timing core's engines agree: the simulator (a lowered plan on `run_lanes`), the solvers'
`time_sequences` (numpy levels) and `FastTimer` (op sequences on `run_lanes`) give the same iteration
ends, period and makespan on random valid orders, and the same verdict on deadlocking ones: with one
stage per worker, and with virtual stages whose re-routed chunks may or may not share a worker (a
hand-off on one worker has no p2p latency in all three)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from solver_helpers import problems, swap_neighbours

from schedcomp.adaptive import Solution
from schedcomp.check import check
from schedcomp.costs import CostModel
from schedcomp.errors import ValidationError
from schedcomp.lower import lower
from schedcomp.simulator import simulate
from schedcomp.solvers.improve import FastTimer
from schedcomp.solvers.merged import merged_sequences
from schedcomp.solvers.plain import plain_sequences
from schedcomp.solvers.problem import Problem
from schedcomp.solvers.timing import time_sequences
from schedcomp.timecore import Graph, run_lanes, run_levels
from schedcomp.topology import PLACEMENTS, Topology, V, Worker


@st.composite
def orders(draw):
    """(problem, per-worker op sequences): the plain re-routed 1F1B shuffled by random neighbour swaps
    (which may deadlock it), over random failures, costs, speeds and split or fused backward."""
    problem = draw(problems())
    seqs = {wid: list(seq) for wid, seq in plain_sequences(problem).items()}
    return problem, _swap_neighbours(draw, problem, seqs)


@st.composite
def chunked_orders(draw):
    """(problem, per-worker op sequences) with virtual stages (loop or V placement) and failures: the
    merged family order with every orphan slot on a random peer at its place (so a micro-batch's chunks
    there may be split between peers, or share one), shuffled by random neighbour swaps."""
    placement = draw(st.sampled_from(PLACEMENTS))
    chunks = 2 if placement == V else draw(st.integers(2, 3))
    pp, dp, mb = draw(st.integers(1, 3)), draw(st.integers(2, 3)), draw(st.integers(1, 4))
    workers = [Worker(d, s) for d in range(dp) for s in range(pp)]
    failed = set(draw(st.lists(st.sampled_from(workers), min_size=1, max_size=2, unique=True)))
    for s in range(pp):
        if all(Worker(d, s) in failed for d in range(dp)):
            failed.discard(Worker(0, s))  # keep a live worker at every place
    stages = pp * chunks
    times = st.lists(st.sampled_from([0.25, 0.5, 1.0, 1.5]), min_size=stages, max_size=stages)
    costs = CostModel(forward=draw(times), backward_input=draw(times), backward_weight=draw(times),
                      p2p=draw(st.sampled_from([0.1, 0.5])), allreduce=draw(times), optimizer=draw(times),
                      speed=draw(st.dictionaries(st.sampled_from(workers), st.sampled_from([0.5, 1.5]), max_size=2)))
    topology = Topology.of(pp, dp, failed, chunks, placement)
    problem = Problem(topology, mb, costs, split=draw(st.booleans()))
    rng = random.Random(draw(st.integers(0, 2**16)))
    peers = [[problem.worker_id(w) for w in group] for group in problem.survivors]
    assignment = {slot: rng.choice(peers[p]) for p, group in enumerate(problem.orphan_slots) for slot in group}
    return problem, _swap_neighbours(draw, problem, merged_sequences(problem, assignment))


def _swap_neighbours(draw, problem: Problem, seqs: dict[int, list[int]]) -> dict[int, list[int]]:
    """`seqs` after up to 12 random swaps of neighbouring ops of different slots (which may deadlock it)."""
    return swap_neighbours(random.Random(draw(st.integers(0, 2**16))), problem, seqs, draw(st.integers(0, 12)))


@given(st.one_of(orders(), chunked_orders()), st.integers(1, 5), st.booleans())
def test_simulator_and_solver_timers_agree(job, iterations, synchronous):
    problem, seqs = job
    timing = time_sequences(problem, seqs, iterations, synchronous)
    fast = FastTimer(problem, iterations, synchronous).score(seqs)
    plan = lower(Solution(problem, seqs, 0.0, 0.0, 0.0, "greedy", "").order(), problem.costs)
    if not timing.ok:
        assert fast == (math.inf, math.inf)
        # (an op placed before its producer on its own worker is reported as that, not as a deadlock)
        with pytest.raises(ValidationError, match=r"deadlock|runs before"):
            check(plan)
        return
    sim = simulate(plan, iterations, synchronous)
    assert sim.iteration_ends == timing.iteration_ends
    assert (sim.period, sim.makespan) == (timing.period, timing.makespan) == fast


def test_a_collective_starts_at_the_last_arrival_and_ends_for_all_at_once():
    # Lane 0: node 0 (2), then collective node 2; lane 1: node 1 (5), then collective node 3 (1 long).
    graph = Graph(preds=[(), (), (), ()], members=[(), (), (2, 3), (2, 3)])
    run = run_lanes(graph, [[0, 2], [1, 3]], [[2.0, 5.0, 1.0, 1.0]] * 2, iterations=2, keep=(0, 1))
    assert run.starts[0][2:] == [5.0, 5.0] and run.ends[0][2:] == [6.0, 6.0]
    assert run.iteration_ends == (6.0, 12.0) and run.releases[1] == (6.0, 6.0)


def test_a_producer_waited_for_in_a_cycle_is_reported_as_stuck():
    # Node 0 (lane 0) waits for node 1 (lane 1), which waits for node 0.
    graph = Graph(preds=[((1, 0.5),), ((0, 0.5),)], members=[(), ()])
    run = run_lanes(graph, [[0], [1]], [[1.0]] * 2, iterations=3)
    assert run.stuck is not None and run.stuck.iteration == 0 and run.stuck.positions == (0, 0)
    assert run.iteration_ends == ()


def test_a_producer_on_the_same_lane_hands_off_without_latency():
    # Node 1 reads node 0 over an edge of latency 0.5: counted between two lanes, not within one.
    graph = Graph(preds=[(), ((0, 0.5),)], members=[(), ()])
    assert run_lanes(graph, [[0, 1]], [[1.0, 1.0]], iterations=1).iteration_ends == (2.0,)
    assert run_lanes(graph, [[0], [1]], [[1.0, 1.0]] * 2, iterations=1).iteration_ends == (2.5,)
    pred, lat, dur, tail = np.array([[-1], [0]]), np.array([[0.0], [0.5]]), np.ones(2), np.zeros((2, 2))
    one = run_levels(np.array([2, 0]), pred, lat, dur, np.array([0, 1]), tail, iterations=1)
    two = run_levels(np.array([1, 1]), pred, lat, dur, np.array([0, 1]), tail, iterations=1)
    assert one is not None and two is not None
    assert (one.iteration_ends, two.iteration_ends) == ((2.0,), (2.5,))


@pytest.mark.parametrize("split_peers", [False, True])
def test_re_routed_chunks_on_one_peer_or_two_time_alike_in_all_three(split_peers):
    # ZB-V, pp=2: place 1 holds chunks 1 and 2, so the failed worker's micro-batches hand off from chunk
    # 1 to chunk 2 at place 1: locally when one peer takes both, over p2p when two peers share them.
    problem = Problem(Topology.of(2, 3, [(0, 1)], chunks=2, placement=V), 2, CostModel.uniform(4, p2p=0.5))
    peers = [problem.worker_id(w) for w in problem.survivors[1]]
    assignment = {slot: peers[problem.slot_key(slot)[2] - 1 if split_peers else 0] for slot in problem.orphan_slots[1]}
    seqs = merged_sequences(problem, assignment)
    timing = time_sequences(problem, seqs, 3)
    plan = lower(Solution(problem, seqs, 0.0, 0.0, 0.0, "greedy", "").order(), problem.costs)
    sim = simulate(plan, 3)
    assert sim.iteration_ends == timing.iteration_ends
    assert (sim.period, sim.makespan) == (timing.period, timing.makespan) == FastTimer(problem, 3).score(seqs)
    assert timing.makespan == (30.5 if split_peers else 29.0)  # the split pays p2p on its hand-offs
