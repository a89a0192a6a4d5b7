"""The plain construction every adaptive schedule must match or beat: 1F1B with the re-routed
micro-batches appended (`rerouted_1f1b_order`), and the same order as the solvers' op-id sequences.

The list scheduler is work-conserving (a worker starts a ready forward rather than wait for a backward
that is about to arrive), which with uneven stage costs can lose to 1F1B's strict alternation; the greedy
solver therefore times this construction as one more candidate, so an adaptive plan is never slower
than it where it runs (no deadlock, within the memory limit).
"""

from __future__ import annotations

from collections.abc import Iterable

from schedcomp.errors import RecoveryError
from schedcomp.ir import Op, OpKind, Order
from schedcomp.schedules.one_f_one_b import stage_order
from schedcomp.solvers.problem import Problem
from schedcomp.topology import Topology, Worker


def rerouted_1f1b_order(topology: Topology, microbatches: int, *, split: bool = True) -> Order:
    """Plain "1F1B with re-routed micro-batches appended": every live worker runs its own pipeline's
    1F1B (with split backward, B then W at once), then, for each failed worker of its stage, a
    contiguous block of that worker's micro-batches (blocks dealt to the peers in pipeline order),
    each block as its own 1F1B. It can deadlock when failures cross (two pipelines each running the
    other's micro-batches); the adaptive schedules must never be slower than it where it runs."""
    pp, m = topology.pp, microbatches
    for s in range(pp):
        if not topology.stage_group(s):
            raise RecoveryError(f"every worker of stage {s} has failed: recovery needs a checkpoint")

    def expand(ops: Iterable[Op]) -> list[Op]:
        out: list[Op] = []
        for o in ops:
            if split and o.kind is OpKind.BW:
                out += [o.with_kind(OpKind.B), o.with_kind(OpKind.W)]
            else:
                out.append(o)
        return out

    seqs: dict[Worker, list[Op]] = {}
    for w in topology.live_workers:
        seqs[w] = expand(Op(o.kind, w.pipeline, o.microbatch, w.stage) for o in stage_order(pp, m, w.stage))
    for failed in sorted(topology.failed):
        peers = topology.stage_group(failed.stage)
        sizes = [m // len(peers) + (1 if i < m % len(peers) else 0) for i in range(len(peers))]
        first = 0
        for peer, size in zip(peers, sizes, strict=True):
            block = list(range(first, first + size))
            first += size
            if not block:
                continue
            one = stage_order(pp, size, failed.stage)
            seqs[peer] += expand(Op(o.kind, failed.pipeline, block[o.microbatch], failed.stage) for o in one)
    return Order(topology, m, {w: tuple(v) for w, v in seqs.items()}, "1f1b-rerouted")


def plain_sequences(problem: Problem) -> dict[int, list[int]]:
    """`rerouted_1f1b_order` for `problem`, as worker id -> op ids (see `solvers.problem`)."""
    order = rerouted_1f1b_order(problem.topology, problem.microbatches, split=problem.split)
    nk = len(problem.kinds)
    index = {kind: i for i, kind in enumerate(problem.kinds)}
    return {problem.worker_id(w): [problem.slot_id(o.pipeline, o.microbatch, o.stage) * nk + index[o.kind]
                                   for o in ops] for w, ops in order.ops.items()}
