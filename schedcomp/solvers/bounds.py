"""Lower bounds on the steady-state period that hold for every schedule of a problem.

Work conservation: in steady state every worker does one iteration's share of compute, all-reduce and
optimizer step within each period. A live worker keeps its own M slots and the failed workers' slots
are shared among the stage's live workers; the best integer split (water-filling by speed factor,
`route.balanced_quota`) gives the smallest possible busiest-worker load, hence a bound.

With virtual stages (chunks > 1) the same holds per worker: its own slots are M per chunk it holds, the
re-routed slots of a place are those of every chunk a failed worker held (`work_bound`).

Memory warm-up (`memory_bound`, only under a memory limit and one chunk per worker): a worker X of stage
s running n slots starts each iteration holding nothing (every W of the previous one ran before its
step). Let S be the start of its first F. Then, for every schedule:

1. until the first gradient comes back (at least f + RT after S, RT the round trip through the stages
   below at their fastest) X can only run forwards, at most k0 = floor(limit / activation) of them, so
   it idles at least I = f + RT - min(k0, n) f;
2. before its n-th F, X must have freed n a - limit of activation (a per F), which takes at least
   T_free of B and W time (cheapest mix of B's and W's, a W only after its B);
   so the n-th F starts at S + (n - 1) f + T_free + I or later;
3. that slot's gradient then travels the round trip and back up to every stage j <= s; stage j steps
   only after the slot's W there, and X's next first F needs a forward from stage j of the next
   iteration to pass stages j..s-1. Hence X's next first F starts at least
   chain_j = (n-th F start) + f + RT + b + (B's from s-1 down to j) + W_j + all-reduce_j + step_j
   + (F's from j to s-1) after S.
The period is at least the largest of these (and of X's work plus I), for the busiest split of the
re-routed slots, minimised over splits (water-filling over a non-decreasing function is optimal).
Both optimizer modes obey it (a synchronous step waits for every stage's). With a limit that binds,
this is what the schedulers reach: e.g. pp=4 dp=8 M=8 with worker 3:1 failed under ZB-H1's per-stage
peaks has a work bound of 30 and a memory bound of 33, the period the greedy scheduler finds.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from schedcomp.route import balanced_quota
from schedcomp.solvers.problem import Problem
from schedcomp.topology import Worker

_TOL = 1e-9


def work_bound(problem: Problem) -> float:
    """The busiest worker's compute under the best split, plus its all-reduce and optimizer step.

    With virtual stages a worker's own load is M slots of each chunk it holds, and the re-routed slots of
    a place are the failed workers' slots of all those chunks. Where the chunks of a place cost the same,
    slots are identical and the integer water-filling (`route.balanced_quota`) is exact, as with one
    chunk; otherwise, and with re-cut micro-batches (`schedcomp.cut`, whose pieces may be any size), the
    fractional water-filling of the re-routed work is the bound (any integer split is one of its points)."""
    quota = balanced_quota(problem)
    m, chunks_of, nk = problem.microbatches, problem.topology.chunks_of, len(problem.kinds)
    bound = 0.0
    for s, group in enumerate(problem.survivors):
        held = chunks_of(s)
        # (Each slot's op times off the solvers' table, `Problem.op_times`: the same floats, added in the same
        # order, with a lookup per op rather than a cost-model call: 8,000 workers at pp = 32, dp = 256.)
        costs = {w: [sum(row[c * nk:(c + 1) * nk]) for c in held]
                 for w in group for row in (problem.op_times[problem.worker_id(w)],)}
        fixed = {w: problem.allreduce_times[s] + problem.step_time(problem.worker_id(w)) for w in group}
        if all(max(c) - min(c) <= _TOL * max(1.0, max(c)) for c in costs.values()) and not problem.cut:
            for w in group:
                busy = (m * len(held) + quota.get(problem.worker_id(w), 0)) * costs[w][0] + fixed[w]
                bound = max(bound, busy)
        else:
            c = problem.costs  # the base cost of a slot: F + B + W, fused or not
            per_microbatch = sum(c.forward[j] + c.backward_input[j] + c.backward_weight[j] for j in held)
            lost = sum(1 for w in problem.topology.failed if w.stage == s)  # each a pipeline's M micro-batches
            orphan_work = lost * m * per_microbatch
            own = {w: m * sum(costs[w]) + fixed[w] for w in group}
            speeds = {w: problem.costs.speed.get(w, 1.0) for w in group}
            bound = max(bound, _water_level(own, speeds, orphan_work))
    return bound


def _water_level(own: dict[Worker, float], speeds: dict[Worker, float], work: float) -> float:
    """The least L with sum over workers of (L - own) x speed >= `work` (where L > own) and L >= every
    own: the busiest load when `work` may be split finely among workers already busy for `own`."""
    level = max(own.values())
    order = sorted(own, key=own.__getitem__)
    rate = weighted = 0.0
    for i, w in enumerate(order):
        rate += speeds[w]
        weighted += own[w] * speeds[w]
        fill = (work + weighted) / rate  # the level when `work` fills only the first i + 1 workers
        if i + 1 == len(order) or fill <= own[order[i + 1]]:
            return max(level, fill)
    return level


def lower_bound(problem: Problem) -> float:
    """The larger of `work_bound` and `memory_bound`."""
    return max(work_bound(problem), memory_bound(problem))


def memory_bound(problem: Problem) -> float:
    """The memory warm-up bound of the module docstring (0.0 without a memory limit).

    With re-cut micro-batches (`schedcomp.cut`: pieces of any size) it is derived only for the workers that
    run their own M whole micro-batches and nothing else: those of a pipeline not cut (every micro-batch of
    theirs is whole at every stage) at a place with no failed worker (so they take no pieces). The argument
    above then holds as is: it follows the worker's own micro-batches only, and anything else sharing the
    stages below or above can only make them later. A cut that halves the other pipelines too
    (`recut.halve_the_rest`) leaves no such worker, so its bound is the work bound."""
    if problem.costs.memory_limit is None or problem.topology.chunks > 1:
        # With virtual stages the worker's own later chunks lie on the round trip: not derived.
        return 0.0
    fast = _Fastest.of(problem)
    memo: dict[tuple[int, float, int], float] = {}

    def warmup(w: Worker, n: int) -> float:  # workers of a stage differ only by their speed factor
        key = (w.stage, problem.costs.speed.get(w, 1.0), n)
        if key not in memo:
            memo[key] = _warmup(problem, fast, w, n)
        return memo[key]

    bound = 0.0
    m = problem.microbatches
    if problem.cut:
        cut, lost = problem.cut.pipelines, {w.stage for w in problem.topology.failed}
        whole = [w for s, group in enumerate(problem.survivors) if s not in lost for w in group
                 if w.pipeline not in cut]
        return max((warmup(w, m) for w in whole), default=0.0)
    for s, group in enumerate(problem.survivors):
        counts = dict.fromkeys(group, m)
        # Water-filling: each re-routed slot goes where the bound grows least (optimal for a min-max of
        # non-decreasing functions), a heap keyed by each worker's bound with one slot more.
        heap = [(warmup(w, m + 1), w) for w in group] if problem.orphan_slots[s] else []
        heapq.heapify(heap)
        for _ in problem.orphan_slots[s]:
            _, w = heapq.heappop(heap)
            counts[w] += 1
            heapq.heappush(heap, (warmup(w, counts[w] + 1), w))
        bound = max(bound, max(warmup(w, n) for w, n in counts.items()))
    return bound


@dataclass(frozen=True)
class _Fastest:
    """Per stage, the fastest live worker's F, backward (B or BW) and W time, and its cheapest step."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    weight: tuple[float, ...]
    step: tuple[float, ...]

    @classmethod
    def of(cls, problem: Problem) -> _Fastest:
        def fastest(k: int) -> tuple[float, ...]:
            if k >= len(problem.kinds):
                return (0.0,) * problem.pp  # fused: the W is part of BW
            return tuple(min(problem.duration(problem.kinds[k], w) for w in g) for g in problem.survivors)

        step = tuple(min(problem.step_time(problem.worker_id(w)) for w in g) for g in problem.survivors)
        return cls(fastest(0), fastest(1), fastest(2), step)


def _warmup(problem: Problem, fast: _Fastest, worker: Worker, n: int) -> float:
    """Least time from one iteration's first F on `worker` (running `n` slots) to the next one's."""
    costs, pp, s = problem.costs, problem.pp, worker.stage
    split = len(problem.kinds) == 3
    f, b = problem.duration(problem.kinds[0], worker), problem.duration(problem.kinds[1], worker)
    w = problem.duration(problem.kinds[2], worker) if split else 0.0
    a, limit = costs.activation[s], costs.limit_at(s)
    rt = sum(fast.forward[j] + fast.backward[j] for j in range(s + 1, pp)) + 2 * (pp - 1 - s) * costs.p2p
    k0 = n if a <= 0 else min(n, math.floor(limit / a + _TOL))
    idle = max(0.0, f + rt - k0 * f)
    own_step = problem.allreduce_times[s] + problem.step_time(problem.worker_id(worker))
    work = n * (f + b + w) + idle + own_step
    t_free = _time_to_free(n * a - limit * (1 + _TOL), a, costs.frees_at(s) if split else 1.0, b, w, n - 1)
    if t_free is None:
        return work  # the n-th F can never run (check_memory refuses such limits): nothing more to claim
    last_f = (n - 1) * f + t_free + (idle if t_free > 0 else 0.0)
    back = last_f + f + rt + b  # the end of that slot's B on `worker`
    best = max(work, back + w + own_step)
    forward = 0.0
    for j in range(s - 1, -1, -1):
        back += costs.p2p + fast.backward[j]
        forward += fast.forward[j] + costs.p2p
        best = max(best, back + fast.weight[j] + problem.allreduce_times[j] + fast.step[j] + forward)
    return best


def _time_to_free(need: float, a: float, beta: float, b: float, w: float, most: int) -> float | None:
    """Least B and W time freeing `need` activation, with at most `most` B's (B frees beta a, its W the
    rest); 0.0 when nothing must be freed, None when it cannot be freed."""
    if need <= 0:
        return 0.0
    best = None
    for x in range(most + 1):
        rest = need - x * beta * a
        if rest <= _TOL * max(1.0, need):
            y = 0
        elif (1 - beta) * a > 0:
            y = math.ceil(rest / ((1 - beta) * a) - _TOL)
            if y > x:
                continue
        else:
            continue
        cost = x * b + y * w
        best = cost if best is None or cost < best else best
    return best
