"""Lower bounds on the steady-state period that hold for every schedule of a problem.

Work conservation: in steady state every worker does one iteration's share of compute, all-reduce and
optimizer step within each period. A live worker keeps its own M slots and the failed workers' slots
are shared among the stage's live workers; the best integer split (water-filling by speed factor,
`route.balanced_quota`) gives the smallest possible busiest-worker load, hence a bound.
"""

from __future__ import annotations

from schedcomp.route import balanced_quota
from schedcomp.solvers.problem import Problem


def work_bound(problem: Problem) -> float:
    """The busiest worker's compute under the best split, plus its all-reduce and optimizer step."""
    quota = balanced_quota(problem)
    m = problem.microbatches
    bound = 0.0
    for s, group in enumerate(problem.survivors):
        for w in group:
            wid = problem.worker_id(w)
            per_slot = sum(problem.duration(k, w) for k in problem.kinds)
            busy = (m + quota.get(wid, 0)) * per_slot + problem.allreduce_times[s] + problem.step_time(wid)
            bound = max(bound, busy)
    return bound
