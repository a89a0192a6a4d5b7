"""Re-routing: which live peer runs each micro-batch of a failed worker.

A failed worker (d, s) leaves M slots (d, m, s) without a home (M per chunk it held, with virtual
stages). They run at stage s on live workers of other pipelines at the same place, which hold the same
chunks; the activations travel (d, s-1) -> peer -> (d, s+1) and the gradients back the same way, which
the lowering adds. This module decides how many re-routed slots each peer takes, balanced by
the peers' speed factors (a straggler takes fewer), and a concrete spread of slots over peers; the
greedy scheduler may instead hand the slots out dynamically, where the bubbles are.
"""

from __future__ import annotations

import heapq

from schedcomp.errors import RecoveryError
from schedcomp.solvers.problem import Problem
from schedcomp.topology import Topology


def check_recoverable(topology: Topology) -> None:
    """Raise `RecoveryError` when some stage has no live worker left (re-routing cannot help)."""
    for s in range(topology.pp):
        if not topology.stage_group(s):
            raise RecoveryError(
                f"every worker of stage {s} has failed, so its micro-batches cannot be re-routed: "
                "recovery needs a checkpoint (restart from the last one, or keep at least one replica per stage)"
            )


def balanced_quota(problem: Problem) -> dict[int, int]:
    """Re-routed slots per live worker (worker id -> count), minimising the slowest worker's load.

    Each live worker of stage s already runs its own M slots (M per chunk it holds, with virtual
    stages); a slot costs F + B + W divided by the worker's speed factor. Slots go one at a time to the
    worker that would finish its load first (water-filling), ties to the lower rank, which is optimal for
    identical slots (with chunks of unequal cost it balances slot counts, a heuristic).
    """
    _ = problem.survivors  # raises RecoveryError early
    if problem.routing:  # pinned (re-cut pieces): the quota is what each worker was given
        pinned: dict[int, int] = {}
        for _, wid in problem.routing:
            pinned[wid] = pinned.get(wid, 0) + 1
        return pinned
    quota: dict[int, int] = {}
    m = problem.microbatches * problem.topology.chunks
    for s, orphans in enumerate(problem.orphan_slots):
        group = problem.survivors[s]
        speeds = {problem.worker_id(w): problem.costs.speed.get(w, 1.0) for w in group}
        heap = [((m + 1) / v, wid) for wid, v in speeds.items()]
        heapq.heapify(heap)
        count = dict.fromkeys(speeds, 0)
        for _ in orphans:
            _, wid = heapq.heappop(heap)
            count[wid] += 1
            heapq.heappush(heap, ((m + count[wid] + 1) / speeds[wid], wid))
        quota.update(count)
    return quota


def assign_orphans(problem: Problem, quota: dict[int, int] | None = None) -> dict[int, int]:
    """A concrete routing (orphan slot -> worker id) meeting `quota`.

    Orphans are taken in micro-batch order and dealt so that each peer's share is spread evenly over the
    iteration (the peer whose share is least used so far comes next), not bunched at its end.
    With virtual stages a micro-batch's chunks at one place go to one peer together (its hand-offs
    between them stay local, and the memory the scheduler reserves for them is where they run); the
    quota, counted in slots, is then met to within a micro-batch's chunks.
    """
    if problem.routing:
        return dict(problem.routing)
    quota = balanced_quota(problem) if quota is None else quota
    assignment: dict[int, int] = {}
    for s, orphans in enumerate(problem.orphan_slots):
        group = [problem.worker_id(w) for w in problem.survivors[s]]
        heap = [(0.0, wid) for wid in group if quota.get(wid, 0) > 0]
        heapq.heapify(heap)
        used = dict.fromkeys(group, 0)
        units: dict[tuple[int, int], list[int]] = {}  # (pipeline, micro-batch) -> its slots here
        for slot in orphans:
            units.setdefault(problem.slot_key(slot)[:2], []).append(slot)
        for unit in units.values():
            if not heap:  # every quota met, chunks left over: to the least loaded peer
                heap = [(used[wid] / max(1, quota.get(wid, 0)), wid) for wid in group]
                heapq.heapify(heap)
            _, wid = heapq.heappop(heap)
            for slot in unit:
                assignment[slot] = wid
            used[wid] += len(unit)
            if used[wid] < quota.get(wid, 0):
                heapq.heappush(heap, (used[wid] / quota[wid], wid))
    return assignment
