"""The simulator's view of a plan: each stream's blocking instructions as lanes of the timing core's graph.

Split out of `schedcomp.simulator` so the engine there reads as the semantics it implements.
A checked plan's transfers are paired by its `PlanIndex` (the pairs `check` proved); a plan timed
unvalidated (`simulate(..., validate=False)`) is paired here by `transfer_key`. Broken transfers
(a send without a receive, a receive after its consumer, a peer without a stream) are raised as
`ValidationError` before any time is simulated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from schedcomp.check import index_of
from schedcomp.errors import ValidationError
from schedcomp.ir import COMPUTE_KINDS, Instruction, Plan
from schedcomp.partitions import Reach, Segment, reach, segments, segments_by_holder
from schedcomp.planindex import PlanIndex, transfer_key
from schedcomp.semantics import (
    OPTIMIZER,
    ROLE_ALLREDUCE,
    ROLE_COMPUTE,
    ROLE_INERT,
    ROLE_LOAD,
    ROLE_RECV,
    ROLE_SEND,
    ROLE_STEP,
    semantics_of,
)
from schedcomp.timecore import Graph
from schedcomp.topology import Worker

# The engine's codes are the semantics table's roles; an inert kind is timed as a LOAD (it takes no time).
COMPUTE, LOAD, SEND, RECV, ALLREDUCE, STEP = (
    ROLE_COMPUTE, ROLE_LOAD, ROLE_SEND, ROLE_RECV, ROLE_ALLREDUCE, ROLE_STEP)

Pair = tuple[int, int, int, int]  # (sender stream, send index, receiver stream, receive index)


def _code(kind: object) -> int:
    role = semantics_of(kind).role  # an unknown kind raises here, before anything is timed
    return LOAD if role == ROLE_INERT else role


class _Codes(dict):  # type: ignore[type-arg]
    """kind -> `_code(kind)`, each kind looked up once."""

    def __missing__(self, kind: object) -> int:
        code = self[kind] = _code(kind)
        return code


@dataclass
class Stream:
    """One worker's stream. Its blocking instructions (compute, ALLREDUCE, STEP), k = 0..nb-1, are
    the core's nodes `first + k`; `at[k]` is the stream index of the k-th."""

    worker: Worker
    instrs: tuple[Instruction, ...]
    codes: list[int]
    first: int  # node id of its blocking instruction 0
    at: list[int]
    dur: list[float]  # per blocking k
    inputs: list[tuple[int, ...]]  # per blocking k: stream indices of the receives it waits for
    block_of: dict[Any, int]  # op -> blocking number of its compute
    source: dict[int, int]  # stream index of a SEND or RECV -> node id of the compute producing its tensor
    segments: list[int] = field(default_factory=list)  # re-formed pipelines: its ALLREDUCE's segments, one node each


@dataclass(frozen=True)
class Lanes:
    """A plan ready for `timecore.run_lanes`: its streams, graph, lanes and durations."""

    streams: list[Stream]
    graph: Graph
    seqs: list[list[int]]
    durations: list[list[float]]
    groups: list[tuple[int, ...]]  # per stream: the streams of its stage group


def compile_streams(plan: Plan) -> Lanes:
    """Flatten the streams into the core's graph: a compute op waits for the producers of the
    receives it consumes (`costs.p2p` later), an ALLREDUCE meets the same ALLREDUCE of its stage's
    other workers."""
    workers = plan.workers
    index_of_worker = {w: i for i, w in enumerate(workers)}
    # Re-formed pipelines: an ALLREDUCE is one collective per segment the worker holds, in layer order.
    segs = None if plan.partitions is None else segments(plan.partitions, plan.topology.failed)
    mine = _segments_of(segs, plan.layer_allreduce) if segs is not None else {}
    streams = [_stream(plan, wi, w, index_of_worker, mine.get(w)) for wi, w in enumerate(workers)]
    offset = 0
    for st in streams:
        st.first, offset = offset, offset + len(st.at)
    index = index_of(plan)
    reached = None if plan.partitions is None else reach(plan.partitions)
    pairs = _pairs_from_index(index, index_of_worker) if index is not None else _pairs_by_key(streams, reached)
    p2p = plan.costs.p2p
    preds: list[tuple[tuple[int, float], ...]] = [()] * offset
    recv_at: dict[tuple[int, int], int] = {}  # (receiver stream, receive index) -> producer node
    for wi, j, pwi, pj in pairs:
        st = streams[wi]
        producer = st.block_of.get(st.instrs[j].op)
        if producer is None:
            raise ValidationError(f"worker {st.worker}, instruction {j} ({st.instrs[j]}) sends the output of "
                                  f"{st.instrs[j].op}, which this worker never runs: re-lower the plan",
                                  worker=st.worker, index=j)
        node = st.first + producer
        st.source[j] = streams[pwi].source[pj] = recv_at[pwi, pj] = node
    for wi, st in enumerate(streams):
        for k, inputs in enumerate(st.inputs):
            if inputs:
                preds[st.first + k] = tuple((recv_at[wi, r], p2p) for r in inputs)
    members: list[tuple[int, ...]] = [()] * offset
    groups = _stage_groups(streams)
    allreduces = [[st.first + k for k, j in enumerate(st.at) if st.codes[j] == ALLREDUCE] for st in streams]
    phantom = offset  # a member that never reaches an ALLREDUCE: a node in no lane, so its group waits
    if segs is not None:
        phantom = _segment_meetings(streams, segs, allreduces, index_of_worker, members, phantom)
    else:
        phantom = _stage_meetings(streams, groups, allreduces, members, phantom)
    extra = phantom - offset
    graph = Graph(preds + [()] * extra, members + [()] * extra)
    durations = [d for st in streams for d in st.dur] + [0.0] * extra
    seqs = [list(range(st.first, st.first + len(st.at))) for st in streams]
    return Lanes(streams, graph, seqs, [durations] * len(streams), groups)


def _stage_meetings(streams: list[Stream], groups: list[tuple[int, ...]], allreduces: list[list[int]],
                    members: list[tuple[int, ...]], phantom: int) -> int:
    """Each stage group's ALLREDUCEs, met by ordinal (a member short of one: a phantom node, so its group
    waits); returns the next phantom id."""
    meetings: dict[tuple[tuple[int, ...], int], tuple[int, ...]] = {}  # (stage group, ordinal) -> its nodes
    for wi, st in enumerate(streams):
        for ordinal, node in enumerate(allreduces[wi]):
            group = meetings.get((groups[wi], ordinal))
            if group is None:
                ids = []
                for v in groups[wi]:
                    if ordinal < len(allreduces[v]):
                        ids.append(allreduces[v][ordinal])
                    else:
                        ids.append(phantom)
                        phantom += 1
                group = meetings[groups[wi], ordinal] = tuple(ids)
            members[node] = group
            if len(group) == 1:
                st.dur[node - st.first] = 0.0  # an all-reduce over one worker: there is nobody to reduce with
    return phantom


def _stage_groups(streams: list[Stream]) -> list[tuple[int, ...]]:
    by_stage: dict[int, list[int]] = {}
    for wi, st in enumerate(streams):
        by_stage.setdefault(st.worker.stage, []).append(wi)
    return [tuple(by_stage[st.worker.stage]) for st in streams]


def _segments_of(segs: tuple[Segment, ...],
                 layer_allreduce: tuple[float, ...]) -> dict[Worker, list[tuple[int, float]]]:
    """Per holder, its segments in layer order as (segment number, all-reduce time: its layers' sum)."""
    times = [math.fsum(layer_allreduce[i] for i in seg.layers) if len(seg.holders) > 1 else 0.0  # alone: free
             for seg in segs]
    return {h: [(k, times[k]) for k in mine] for h, mine in segments_by_holder(segs).items()}


def _segment_meetings(streams: list[Stream], segs: tuple[Segment, ...], allreduces: list[list[int]],
                      index_of_worker: dict[Worker, int], members: list[tuple[int, ...]], phantom: int) -> int:
    """Each segment's collective: the nodes of its holders' ALLREDUCEs for it (a holder without one: a phantom
    node, so the others wait, as for stage groups); returns the next phantom id."""
    node_of: dict[tuple[int, int], int] = {}  # (stream, segment number) -> its node
    for wi, st in enumerate(streams):
        nodes = allreduces[wi]
        if len(st.segments) and len(nodes) == len(st.segments):
            node_of.update(((wi, k), node) for k, node in zip(st.segments, nodes, strict=True))
    for k, seg in enumerate(segs):
        ids = []
        for h in seg.holders:
            node = node_of.get((index_of_worker.get(h, -1), k))
            if node is None:
                node, phantom = phantom, phantom + 1
            ids.append(node)
        group = tuple(ids)
        for node in ids:
            if node < len(members):
                members[node] = group
    return phantom


def _stream(plan: Plan, wi: int, w: Worker, index_of_worker: dict[Worker, int],
            segs: list[tuple[int, float]] | None = None) -> Stream:
    costs = plan.costs_of(w.pipeline)  # (a re-formed pipeline's workers: its own stage costs)
    instrs = tuple(plan.streams[w])
    code_of = _Codes()  # (per kind, not per instruction: the semantics lookup was a tenth of a re-formed plan's run)
    codes = [code_of[i.kind] for i in instrs]
    speed = costs.speed.get(w, 1.0)
    times = {k: costs.compute_time(k.value, w) for k in COMPUTE_KINDS}
    held = plan.topology.chunks_of(w.stage)  # its chunks: one ALLREDUCE and one STEP cover them all
    chunked = len(held) > 1
    cut = plan.cut or None  # (None: a plain truth test per instruction, not Cut.__bool__)
    st = Stream(w, instrs, codes, 0, [], [], [], {}, {})
    waiting: dict[Any, list[int]] = {}  # op -> receives posted before its compute
    for j, ins in enumerate(instrs):
        c = codes[j]
        if c == COMPUTE:
            st.block_of.setdefault(ins.op, len(st.at))
            inputs: tuple[int, ...] = tuple(waiting.pop(ins.op, ()))
            op = ins.op
            d = costs.compute_time(ins.kind.value, w, op.stage) if chunked and op is not None else times[ins.kind]
            if cut and op is not None:  # a re-cut micro-batch: compute is linear in its samples
                d *= cut.size(op.pipeline, op.microbatch)
        elif c == STEP:
            inputs = ()
            d = costs.optimizer_of(held) / speed if semantics_of(ins.kind).cost == OPTIMIZER else 0.0
        elif c == ALLREDUCE and segs is not None:  # one node per segment, in layer order
            for k, time in segs:
                st.segments.append(k)
                st.inputs.append(())
                st.at.append(j)
                st.dur.append(time)
            continue
        elif c == ALLREDUCE:
            inputs = ()
            d = costs.allreduce_of(held)
        else:
            if c in (RECV, SEND) and ins.peer not in index_of_worker:
                verb = "receives from" if c == RECV else "sends to"
                raise ValidationError(f"worker {w}, instruction {j} ({ins}) {verb} {ins.peer}, which has no stream "
                                      "in this plan: re-lower the plan", worker=w, index=j)
            if c == RECV:
                waiting.setdefault(ins.op, []).append(j)
            continue
        st.inputs.append(inputs)
        st.at.append(j)
        st.dur.append(d)
    for op, late in waiting.items():
        consumer = next((k for k in range(len(st.at)) if instrs[st.at[k]].op == op), None)
        if consumer is not None:
            j = late[0]
            raise ValidationError(
                f"worker {w}, instruction {j} ({instrs[j]}) is posted after {op} (instruction {st.at[consumer]}) "
                "that consumes it: move the receive before its consumer", worker=w, index=j)
    return st


def _pairs_from_index(index: PlanIndex, index_of_worker: dict[Worker, int]) -> list[Pair]:
    """The transfers `check` paired (its `PlanIndex`), as stream numbers and indices."""
    pairs = []
    for t, at in index.sent.items():
        sender, j = index.where(at)
        receiver, pj = index.where(index.received[t])
        pairs.append((index_of_worker[sender], j, index_of_worker[receiver], pj))
    return pairs


def _pairs_by_key(streams: list[Stream], reached: Reach | None = None) -> list[Pair]:
    """Match every send of an unchecked plan with the receive carrying the same tensor
    (`transfer_key`) between the same two workers (FIFO if a hand-made plan repeats one)."""
    index_of_worker = {st.worker: wi for wi, st in enumerate(streams)}
    recvs: dict[tuple[Any, ...], list[tuple[int, int]]] = {}
    for wi, st in enumerate(streams):
        for j, ins in enumerate(st.instrs):
            if st.codes[j] == RECV:
                recvs.setdefault((transfer_key(ins, reached), index_of_worker[ins.peer], wi), []).append((wi, j))
    pairs = []
    for wi, st in enumerate(streams):
        w = st.worker
        for j, ins in enumerate(st.instrs):
            if st.codes[j] != SEND:
                continue
            if ins.op not in st.block_of:
                raise ValidationError(f"worker {w}, instruction {j} ({ins}) sends the output of {ins.op}, which "
                                      "this worker never runs: re-lower the plan", worker=w, index=j)
            queue = recvs.get((transfer_key(ins, reached), wi, index_of_worker[ins.peer]))
            if not queue:
                raise ValidationError(f"worker {w}, instruction {j} ({ins}) has no matching receive on {ins.peer}: "
                                      "every send needs one receive of the same micro-batch", worker=w, index=j)
            pairs.append((wi, j, *queue.pop(0)))
    for queue in recvs.values():
        if queue:
            wi, j = queue[0]
            st = streams[wi]
            raise ValidationError(f"worker {st.worker}, instruction {j} ({st.instrs[j]}) has no matching send on "
                                  f"{st.instrs[j].peer}: every receive needs one send", worker=st.worker, index=j)
    return pairs
