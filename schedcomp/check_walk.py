"""The validator's scan, instruction by instruction: the walk `check` takes where a plan's streams have no
columns (`schedcomp.check_columns` settles a lowered plan's sound case), and to name the first rule broken.

One pass over the streams into plain dicts keyed by integers (op, slot, tensor and channel ids: hashing
dataclasses dominated the run; places packed as `rank << 32 | index`) and typed arrays, per-worker tables
in lists indexed by rank. Each op names a stage its worker holds and a micro-batch of the job, no op runs
twice, a LOAD loads a forward at the first or last stage and only once, and no worker holds more activation
memory than its limit.
"""

from __future__ import annotations

from array import array
from collections import defaultdict
from typing import Any

from schedcomp.ir import Instruction, OpKind
from schedcomp.memory import limit_top, stage_deltas
from schedcomp.opcolumns import OP_CODES
from schedcomp.partitions import held_ends
from schedcomp.semantics import (
    ROLE_ALLREDUCE,
    ROLE_COMPUTE,
    ROLE_LOAD,
    ROLE_RECV,
    ROLE_SEND,
    ROLE_STEP,
    roles,
    semantics_of,
)

_KIND_ID = {kind: code for code, kind in enumerate(OP_CODES)}
_NO_DELTAS: defaultdict[object, float] = defaultdict(float)  # no limit: memory is not tracked
_INF = float("inf")
_LOW = (1 << 32) - 1  # the index part of a packed place


class _Roles(dict):  # type: ignore[type-arg]
    """kind -> role, -1 for a kind the table does not know (a subscript is cheaper than `.get` per instruction)."""

    def __missing__(self, kind: object) -> int:
        return -1



def walk(checker: Any) -> None:
    """The scan's per-instruction part: every rule that reads one instruction at a time, and the tables."""
    plan, topo = checker.plan, checker.plan.topology
    dp, mbs, pp, ns = topo.dp, checker.mbs, checker.pp, checker.ns
    chunked = ns != pp
    place = [topo.place_of(s) for s in range(ns)] if chunked else []
    # Streams by rank, in one pass over the items (`plan.streams[w]` would hash each `Worker` once more).
    stream_of: list[tuple[Instruction, ...]] = [()] * checker.nw
    for w, stream in plan.streams.items():
        stream_of[w.pipeline * pp + w.stage] = stream
    checker.lengths = list(map(len, stream_of))
    comp = checker.comp = array("q", [-1]) * (dp * mbs * ns * 4)
    loads, sends, recvs, kid = checker.loads, checker.sends, checker.recvs, _KIND_ID
    send_kinds, recv_kinds = checker.send_kinds, checker.recv_kinds
    tops = [limit_top(lim) for lim in plan.costs.stage_limits]  # one number if chunked
    role_of = _Roles(roles())  # every kind's role, read off the semantics table once per run
    cut = plan.cut or None  # re-cut micro-batches hold their activation times their size (None: a
    # plain truth test per instruction, not Cut.__bool__)
    # Re-formed pipelines: per pipeline its first and last held stage, the ones LOAD feeds.
    ends = None if checker.reach is None else [held_ends(p) for p in plan.partitions]
    for w in checker.workers:
        ws = w.stage
        rank = w.pipeline * pp + ws
        own = plan.pipeline_costs.get(w.pipeline)  # a re-formed pipeline's workers: its own costs and limits
        costs = plan.costs if own is None else own
        top = tops[ws] if own is None else limit_top(own.stage_limits[ws])
        limited = top != _INF  # memory is tracked only under a limit
        deltas, held = (stage_deltas(costs, ws) if limited else _NO_DELTAS), 0.0
        # With virtual stages each chunk has its own activation size: its deltas, by its stage.
        chunk_deltas = {s: stage_deltas(plan.costs, s) for s in topo.chunks_of(ws)} if chunked else {}
        reduce: list[int] = []
        step: list[int] = []
        checker.tail[rank] = (reduce, step)
        base = rank << 32
        last = None  # the op of the previous instruction: a lowered stream names one in a row (LOAD, op, SEND)
        for i, ins in enumerate(stream_of[rank]):
            op, kind = ins.op, ins.kind
            role = role_of[kind]
            if op is None:
                if role == ROLE_ALLREDUCE:
                    reduce.append(i)
                elif role == ROLE_STEP:
                    step.append(i)
                elif role < 0:
                    checker.unknown(w, i, kind)
                continue
            if op is not last:  # the same op object again passed these already, on this worker
                last = op
                d, m, os = op.pipeline, op.microbatch, op.stage
                if os != ws and not (chunked and type(os) is int and 0 <= os < ns and place[os] == ws):
                    held_here = ", ".join(map(str, topo.chunks_of(ws))) if chunked else str(ws)
                    checker.fail(w, i, f"names stage {os} but {w} runs stage{'s' if chunked else ''} {held_here}")
                if not (0 <= d < dp and 0 <= m < (mbs if not cut else cut.count(d, plan.microbatches))):
                    count = mbs if not cut or not 0 <= d < dp else cut.count(d, plan.microbatches)
                    checker.fail(w, i, f"no such micro-batch: pipelines are 0..{dp - 1}, micro-batches 0..{count - 1}")
                slot = (d * mbs + m) * ns + os
                if type(slot) is not int:  # hand-made fields such as 1.0 (== a stage): the tables are typed
                    if any(not isinstance(f, (int, float)) or f != int(f) for f in (d, m, os)):
                        checker.fail(w, i, f"names op fields {d!r}, {m!r}, {os!r}: pipeline, micro-batch and stage "
                                  "must be whole numbers")
                    slot, os = int(slot), int(os)
            if role == ROLE_SEND:  # what the transfer rules read, taken while the instruction is at hand
                sends.extend((base | i, slot, os))
                send_kinds.extend((kind, op.kind, ins.peer))
            elif role == ROLE_RECV:
                recvs.extend((base | i, slot, os))
                recv_kinds.extend((kind, op.kind, ins.peer))
            elif role == ROLE_COMPUTE:
                cid = slot * 4 + kid[op.kind]
                first = comp[cid]
                if first >= 0:
                    fw, fi = checker.where(first)
                    checker.fail(w, i, f"{op} runs twice (first on {fw} at instruction {fi}): keep one")
                comp[cid] = base | i
                if limited:
                    delta = chunk_deltas[os][kind] if chunked else deltas[kind]
                    held += delta * cut.size(d, m) if cut else delta
                    if held > top and w not in checker.over:
                        checker.over[w] = (i, held)
            elif role == ROLE_LOAD:
                if op.kind is not OpKind.F or (0 < os < ns - 1 if ends is None else os not in ends[d]):
                    checker.fail(w, i, f"{semantics_of(kind).rule}: drop it")
                if slot in loads:
                    checker.fail(w, i, f"{op} is loaded twice (first at instruction {loads[slot] & _LOW})")
                loads[slot] = base | i
            elif role < 0:
                checker.unknown(w, i, kind)
