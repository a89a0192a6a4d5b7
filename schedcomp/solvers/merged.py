"""The plain construction with virtual stages: the fault-free family of the placement (interleaved-1f1b
for "loop", zb-v for "v") run as one pipeline over every pipeline's micro-batches, each worker keeping
the ops of the micro-batches it holds.

Think of the job as a single pipeline of dp x M micro-batches (micro-batch m of pipeline d is unit
m dp + d) whose place p is shared by the live workers at p: a unit runs at p on its home worker, or, when
that one failed, on the peer `route.assign_orphans` names (all chunks of a micro-batch at a place go to one
peer). Each worker runs the family's order for place p restricted to its units. That cannot deadlock:
its dependency graph is the fault-free single pipeline's with some stream-order edges removed, and
removing edges keeps a graph acyclic. Nor does it hold more memory than that pipeline at p, since every
micro-batch's held activation is never negative (F comes before its B and W). A peer then interleaves its
own and re-routed micro-batches as the family would a longer batch: with two pipelines ZB-V stays
bubble-free on the busiest peer (pp=4, dp=2, M=4, one failure: the bound, 24), but with more pipelines a
worker gets only every dp-th unit of the family's in-flight window and the list scheduler does better;
the greedy solver times it first and keeps the better (as `solvers.plain` with one chunk). Without
failures no place is shared and each pipeline runs the family on its own micro-batches.
"""

from __future__ import annotations

from collections.abc import Mapping

from schedcomp.errors import ScheduleError
from schedcomp.ir import OpKind
from schedcomp.memory import reference_family
from schedcomp.schedules import get_family
from schedcomp.solvers.problem import Problem


def merged_sequences(problem: Problem, assignment: Mapping[int, int]) -> dict[int, list[int]]:
    """Worker id -> op ids of the merged family order (see the module docstring)."""
    pp, nk, topology = problem.pp, len(problem.kinds), problem.topology
    # Without failures every pipeline runs the family on its own (no place is shared).
    dp = problem.dp if topology.failed else 1
    units = dp * problem.microbatches
    family = get_family(reference_family(topology))
    try:
        orders = family.orders(pp, units, topology.chunks)
    except ScheduleError:  # interleaved-1f1b runs equal rounds: pad with units nobody runs (a subgraph still)
        orders = family.orders(pp, -(-units // pp) * pp, topology.chunks)
    seqs: dict[int, list[int]] = {problem.worker_id(w): [] for w in topology.live_workers}
    for copy in range(problem.dp // dp):  # (one pass over the merged pipeline, or one per pipeline)
        for ops in orders:
            for op in ops:
                if op.microbatch < units:
                    m, d = divmod(op.microbatch, dp)
                    _append(problem, seqs, assignment, problem.slot_id(d + copy, m, op.stage), op.kind, nk)
    return seqs


def _append(problem: Problem, seqs: dict[int, list[int]], assignment: Mapping[int, int], slot: int,
            kind: OpKind, nk: int) -> None:
    """Append the op ids of `kind` at `slot` to the sequence of the worker that runs the slot."""
    index = {k: i for i, k in enumerate(problem.kinds)}
    home = problem.home_of(slot)
    out = seqs[home] if home in seqs else seqs[assignment[slot]]
    if kind is OpKind.BW and nk == 3:  # a fused family, split backward: B then W at once
        out += [slot * nk + index[OpKind.B], slot * nk + index[OpKind.W]]
    elif kind in (OpKind.B, OpKind.W) and nk == 2:  # a split family, fused backward: BW at B
        if kind is OpKind.B:
            out.append(slot * nk + index[OpKind.BW])
    else:
        out.append(slot * nk + index[kind])
