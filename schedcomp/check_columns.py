"""The validator's scan over a lowered plan's columns (`schedcomp.streamcolumns`), all rows at once.

`check._Checker.scan` reads every instruction of every stream into its tables (op places, sends, receives,
loads, each worker's ALLREDUCE and STEP) and applies the rules that need one instruction at a time: each
op names a stage its worker holds and a micro-batch of the job, no op runs twice, a LOAD loads a forward
at the first or last stage and only once, and no worker holds more activation memory than its limit. At
pp = 32, dp = 256 that walk over 3.6 million objects was most of `check`. Here the same tables are made
with numpy from the columns the plan's streams were built from, and the same rules are array tests.

Only the sound case is settled here: where any of those rules is broken, `scan_columns` returns False
without touching the checker, and the walk runs instead and names the first problem, so every message
stays the walk's. The rest of `check` (transfers, FIFO, deadlock, ...) reads the tables either way, in
the same order (transfers by packed place `rank << 32 | index`, as the walk appends them).
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING, Any

import numpy as np

from schedcomp.check_transfers import TRANSFER_ROWS, TransferColumns
from schedcomp.ir import OpKind
from schedcomp.memory import limit_top, stage_deltas
from schedcomp.opcolumns import OP_CODES
from schedcomp.runsums import running_sums
from schedcomp.semantics import ROLE_ALLREDUCE, ROLE_STEP, semantics_of
from schedcomp.streamcolumns import LOAD, RECV, ROW_KINDS, SEND, StreamColumns

if TYPE_CHECKING:
    from numpy.typing import NDArray

_F = OP_CODES.index(OpKind.F)


def scan_columns(checker: Any, columns: StreamColumns) -> bool:
    """Fill `checker`'s scan tables from `columns` and return True, or return False (the checker untouched)
    where the plan breaks a rule of the scan or is not the plain case (see the module docstring).

    `checker` is a `check._Checker` whose plan-wide part of the scan ran (`by_rank`, `workers`)."""
    plan = checker.plan
    topo, pp, ns, mbs, dp = plan.topology, checker.pp, checker.ns, checker.mbs, plan.topology.dp
    workers = columns.workers
    tail_roles = [semantics_of(ins.kind).role if ins.op is None else -1 for ins in columns.tail]
    if any(role not in (ROLE_ALLREDUCE, ROLE_STEP) for role in tail_roles):
        return False
    ends = columns.ends
    lengths = np.diff(ends, prepend=0)
    cut = plan.cut
    ranks = np.array([w.pipeline * pp + w.stage for w in workers], np.int64)
    n = len(columns.kinds)
    x = np.repeat(np.arange(len(workers)), lengths)  # each row's worker (a number in `workers`)
    index = np.arange(n, dtype=np.int64) - np.repeat(ends - lengths, lengths)  # its index in its stream
    rank = ranks[x]
    here = (rank << 32) | index
    kinds = columns.kinds.astype(np.int64)
    op = columns.op_of
    ops = columns.ops
    code, d, m, s = (c[op] for c in (ops.code, ops.pipeline, ops.microbatch, ops.stage))
    place = rank % pp
    # Each op names a stage its worker holds and a micro-batch of the job.
    if ns != pp:
        places = np.array([topo.place_of(k) for k in range(ns)], np.int64)
        if not ((s >= 0) & (s < ns)).all() or not (places[np.clip(s, 0, ns - 1)] == place).all():
            return False
    elif not (s == place).all():
        return False
    counts = np.array([cut.count(p, plan.microbatches) if cut else plan.microbatches for p in range(dp)], np.int64)
    if not ((d >= 0) & (d < dp) & (m >= 0)).all() or not (m < counts[d]).all():
        return False
    slot = (d * mbs + m) * ns + s
    # No op runs twice: one place per op id (`slot * 4 + code`, as the walk numbers them).
    compute = kinds < LOAD
    ck = kinds[compute]
    if not (ck == code[compute]).all():
        return False
    cid = slot[compute] * 4 + ck
    comp = np.full(dp * mbs * ns * 4, -1, np.int64)
    comp[cid] = here[compute]
    if np.count_nonzero(comp >= 0) != len(cid):
        return False
    if not _within_memory(plan, place[compute], s[compute], ck, d[compute], m[compute], x[compute], len(workers)):
        return False
    # LOADs: of a forward, at the first or last stage, once each.
    load = kinds == LOAD
    load_slot = slot[load]
    if (code[load] != _F).any() or ((s[load] > 0) & (s[load] < ns - 1)).any():
        return False
    ordered = np.sort(load_slot)  # (not `np.unique`: its first call imports numpy.ma, 0.1 s of a CLI compile)
    if (ordered[1:] == ordered[:-1]).any():
        return False
    # Every check passed: the tables, in the walk's order (by packed place).
    by_place = np.argsort(here, kind="stable") if (np.diff(here) < 0).any() else None
    checker.comp = array("q", comp.tobytes())
    checker.loads = dict(zip(load_slot.tolist(), here[load].tolist(), strict=True))
    peer_rank = np.append(ranks, -1)[columns.peer]  # (peer -1: none)
    checker.sends = _transfers((kinds >= SEND) & (kinds < RECV), by_place, here, slot, s, kinds, code, peer_rank)
    checker.recvs = _transfers(kinds >= RECV, by_place, here, slot, s, kinds, code, peer_rank)
    checker.send_kinds, checker.recv_kinds = [], []
    checker.lengths = [0] * checker.nw
    for w, n_rows in zip(workers, lengths.tolist(), strict=True):
        reduce = [n_rows + k for k, role in enumerate(tail_roles) if role == ROLE_ALLREDUCE]
        step = [n_rows + k for k, role in enumerate(tail_roles) if role == ROLE_STEP]
        checker.tail[w.pipeline * pp + w.stage] = (reduce, step)
        checker.lengths[w.pipeline * pp + w.stage] = n_rows + len(tail_roles)
    return True


def _within_memory(plan: Any, place: NDArray[np.int64], stage: NDArray[np.int64], kinds: NDArray[np.int64],
                   d: NDArray[np.int64], m: NDArray[np.int64], x: NDArray[np.int64], n_workers: int) -> bool:
    """Whether no worker's activation memory passes its limit, summed as the walk sums it: each worker's
    compute ops' deltas (times a re-cut micro-batch's size) in stream order, one float64 addition each. The
    arguments are the compute rows' (place, stage, kind, pipeline, micro-batch and worker number), in order."""
    costs, cut, ns = plan.costs, plan.cut, plan.topology.stages
    tops = np.array([limit_top(lim) for lim in costs.stage_limits])
    top = tops[place]  # (per compute row, its worker's limit: by place, one number if chunked)
    limited = np.isfinite(top)
    if not limited.any():
        return True
    deltas = np.array([[stage_deltas(costs, k)[kind] for kind in ROW_KINDS[:LOAD]] for k in range(ns)])
    delta = deltas[stage, kinds]
    if cut:
        mbs = cut.width(plan.microbatches)
        sizes = np.ones(plan.topology.dp * mbs)
        for p, _ in cut.bounds:
            if p < plan.topology.dp:
                sizes[p * mbs:p * mbs + cut.count(p, plan.microbatches)] = cut.sizes(p, plan.microbatches)
        delta = delta * sizes[d * mbs + m]
    # Per worker a running sum over its compute ops, each started from 0.0: every sum is the walk's, bit for bit.
    held = running_sums(delta, x, n_workers)
    return not (limited & (held > top)).any()


def _transfers(rows: NDArray[np.bool_], by_place: NDArray[np.int64] | None, here: NDArray[np.int64],
               slot: NDArray[np.int64], stage: NDArray[np.int64], kinds: NDArray[np.int64], code: NDArray[np.int64],
               peer_rank: NDArray[np.int64]) -> TransferColumns:
    """One side's transfers (the rows `rows` picks), in the walk's order."""
    order = by_place[rows[by_place]] if by_place is not None else np.flatnonzero(rows)
    row_of = np.array([TRANSFER_ROWS.index(k) if k in TRANSFER_ROWS else -1 for k in ROW_KINDS], np.int64)
    return TransferColumns(here[order], slot[order], stage[order], row_of[kinds[order]], code[order], None,
                           peer_rank[order])
