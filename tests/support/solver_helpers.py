"""Test helpers for the solvers: an exact steady-state period, and brute-force enumeration of schedules.

The exact period is computed independently of `schedcomp.solvers.timing`: the schedule repeated forever
is a max-plus system, and its period is the largest cycle ratio (weight over iterations crossed) of its
event graph, found by bisection with Bellman-Ford (no positive cycle iff the period is large enough).
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator, Mapping, Sequence

from hypothesis import strategies as st

from schedcomp.costs import CostModel
from schedcomp.solvers.problem import Problem
from schedcomp.topology import Topology, Worker


def exact_period(problem: Problem, seqs: Mapping[int, Sequence[int]], synchronous: bool = False) -> float:
    """The steady-state period of per-worker op sequences (math.inf if they deadlock); a re-cut
    micro-batch's ops take their stage's time times its size."""
    nk, pp, costs = len(problem.kinds), problem.pp, problem.costs
    live = [problem.worker_id(w) for w in problem.topology.live_workers]
    sizes = problem.slot_sizes
    dur = {}
    where = {}
    for wid in live:
        for op in seqs[wid]:
            dur[op] = problem.duration(problem.kinds[op % nk], problem.worker_of(wid))
            dur[op] *= 1.0 if sizes is None else sizes[op // nk]
            where[op] = wid
    edges: list[tuple[object, object, float, int]] = []  # (u, v, weight, iterations crossed)
    for wid in live:
        seq = seqs[wid]
        for u, v in itertools.pairwise(seq):
            edges.append((u, v, dur[u], 0))
        stage = wid % pp
        edges.append((seq[-1], ("ar", stage), dur[seq[-1]], 0))
        step = problem.allreduce_times[stage] + problem.step_time(wid)
        edges.append((("ar", stage), ("se", wid), step, 0))
        if synchronous:
            edges.append((("se", wid), "barrier", 0.0, 0))
            edges.append(("barrier", seq[0], 0.0, 1))
        else:
            edges.append((("se", wid), seq[0], 0.0, 1))
    for op in dur:
        slot, k = divmod(op, nk)
        s = slot % pp
        if k == 0 and s > 0:
            edges.append(((slot - 1) * nk, op, dur[(slot - 1) * nk] + costs.p2p, 0))
        elif k == 1:
            edges.append((slot * nk, op, dur[slot * nk], 0))
            if s < pp - 1:
                edges.append(((slot + 1) * nk + 1, op, dur[(slot + 1) * nk + 1] + costs.p2p, 0))
        elif k == 2:
            edges.append((slot * nk + 1, op, dur[slot * nk + 1], 0))
    nodes = {n for e in edges for n in e[:2]}
    if has_cycle(nodes, edges):
        return math.inf  # a cycle within one iteration: the sequences deadlock
    lo, hi = 0.0, sum(w for _, _, w, _ in edges) + 1.0
    for _ in range(80):
        mid = (lo + hi) / 2
        if _positive_cycle(nodes, edges, mid):
            lo = mid
        else:
            hi = mid
    return hi


def _positive_cycle(nodes: set, edges: list, period: float) -> bool:
    """Bellman-Ford for longest paths with weights w - period * crossed: True if some cycle is positive."""
    use = [(u, v, w - period * c) for u, v, w, c in edges]
    dist = dict.fromkeys(nodes, 0.0)
    eps = 1e-12
    for _ in range(len(nodes)):
        changed = False
        for u, v, w in use:
            if dist[u] + w > dist[v] + eps:
                dist[v] = dist[u] + w
                changed = True
        if not changed:
            return False
    return True


def has_cycle(nodes: set, edges: list) -> bool:
    succ: dict = {}
    for u, v, _, c in edges:
        if not c:
            succ.setdefault(u, []).append(v)
    state: dict = {}

    def visit(n: object) -> bool:
        state[n] = 1
        for m in succ.get(n, ()):
            if state.get(m) == 1 or (m not in state and visit(m)):
                return True
        state[n] = 2
        return False

    return any(n not in state and visit(n) for n in nodes)


def exact_makespan(problem: Problem, seqs: Mapping[int, Sequence[int]]) -> float:
    """One iteration's end (last step) from a cold start, by longest paths (math.inf on a deadlock)."""
    from schedcomp.solvers.improve import FastTimer

    return FastTimer(problem, iterations=1).score(seqs)[1]


def interleavings(chains: Sequence[Sequence[int]]) -> Iterator[list[int]]:
    """Every merge of `chains` that keeps each chain's order."""
    chains = [list(c) for c in chains if c]
    if not chains:
        yield []
        return
    for i, chain in enumerate(chains):
        rest = [*chains[:i], chain[1:], *chains[i + 1:]]
        for tail in interleavings(rest):
            yield [chain[0], *tail]


def all_schedules(problem: Problem) -> Iterator[dict[int, list[int]]]:
    """Every schedule of `problem`: each re-routed slot on each live peer, every per-worker order."""
    nk, pp = len(problem.kinds), problem.pp
    orphans = [slot for group in problem.orphan_slots for slot in group]
    choices = [[problem.worker_id(w) for w in problem.survivors[slot % pp]] for slot in orphans]
    live = [problem.worker_id(w) for w in problem.topology.live_workers]
    for runners in itertools.product(*choices):
        slots: dict[int, list[int]] = {wid: [] for wid in live}
        for slot in range(problem.n_slots):
            d, _, s = problem.slot_key(slot)
            if problem.home_live(d, s):
                slots[d * pp + s].append(slot)
        for slot, wid in zip(orphans, runners, strict=True):
            slots[wid].append(slot)
        per_worker = [list(interleavings([[slot * nk + k for k in range(nk)] for slot in slots[wid]]))
                      for wid in live]
        for combo in itertools.product(*per_worker):
            yield dict(zip(live, combo, strict=True))


def memory_ok(problem: Problem, seqs: Mapping[int, Sequence[int]]) -> bool:
    from schedcomp.solvers.improve import FastTimer

    timer = FastTimer(problem)
    return all(timer.memory_ok(wid, seq) for wid, seq in seqs.items())


def swap_neighbours(rng: random.Random, problem: Problem, seqs: dict[int, list[int]],
                    swaps: int) -> dict[int, list[int]]:
    """`seqs` after up to `swaps` random swaps of neighbouring ops of different slots (which may deadlock it)."""
    nk = len(problem.kinds)
    for _ in range(swaps):
        seq = seqs[rng.choice(sorted(seqs))]
        if len(seq) > 1:
            i = rng.randrange(len(seq) - 1)
            if seq[i] // nk != seq[i + 1] // nk:  # a slot's own ops stay in order
                seq[i], seq[i + 1] = seq[i + 1], seq[i]
    return seqs


@st.composite
def problems(draw: st.DrawFn, max_pp: int = 3, max_microbatches: int = 4,
             times: Sequence[float] = (0.5, 1.0, 1.25, 2.0)) -> Problem:
    """A random problem: up to two failed workers (a live one kept on every stage), per-stage costs drawn from
    `times`, a p2p latency, speed factors, split or fused backward."""
    pp, dp, mb = draw(st.integers(1, max_pp)), draw(st.integers(1, 3)), draw(st.integers(1, max_microbatches))
    workers = [Worker(d, s) for d in range(dp) for s in range(pp)]
    failed = set(draw(st.lists(st.sampled_from(workers), max_size=2, unique=True)))
    for s in range(pp):
        if all(Worker(d, s) in failed for d in range(dp)):
            failed.discard(Worker(0, s))  # keep a live worker on every stage
    per_stage = st.lists(st.sampled_from(list(times)), min_size=pp, max_size=pp)
    costs = CostModel(forward=draw(per_stage), backward_input=draw(per_stage), backward_weight=draw(per_stage),
                      p2p=draw(st.sampled_from([0.0, 0.1, 0.5])), allreduce=draw(per_stage),
                      optimizer=draw(per_stage),
                      speed=draw(st.dictionaries(st.sampled_from(workers), st.sampled_from([0.5, 0.8, 1.5]),
                                                 max_size=2)))
    return Problem(Topology(pp, dp, frozenset(failed)), mb, costs, split=draw(st.booleans()))
