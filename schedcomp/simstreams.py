"""The simulator's view of a plan: each stream flattened into arrays, every send matched to its receive.

Split out of `schedcomp.simulator` so the engine there reads as the semantics it implements.
Broken transfers (a send without a receive, a receive after its consumer, a peer without a
stream) are found here and raised as `ValidationError` before any time is simulated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from schedcomp.errors import ValidationError
from schedcomp.ir import COMPUTE_KINDS, Instruction, Plan
from schedcomp.planindex import transfer_key
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
from schedcomp.topology import Worker

# The engine's codes are the semantics table's roles; an inert kind is timed as a LOAD (it takes no time).
COMPUTE, LOAD, SEND, RECV, ALLREDUCE, STEP = (
    ROLE_COMPUTE, ROLE_LOAD, ROLE_SEND, ROLE_RECV, ROLE_ALLREDUCE, ROLE_STEP)


def _code(kind: object) -> int:
    role = semantics_of(kind).role  # an unknown kind raises here, before anything is timed
    return LOAD if role == ROLE_INERT else role


@dataclass
class Stream:
    """One worker's stream as flat arrays. Blocking instructions (compute, ALLREDUCE, STEP) are
    numbered k = 0..nb-1; `at[k]` is the stream index of the k-th."""

    worker: Worker
    instrs: tuple[Instruction, ...]
    codes: list[int]
    at: list[int]
    dur: list[float]  # per blocking k
    inputs: list[tuple[int, ...]]  # per blocking k: stream indices of the receives it waits for
    sends: list[list[tuple[int, int, int]]]  # per blocking k: (send index, peer stream, peer receive index)
    ordinal: list[int]  # per blocking k: which ALLREDUCE of the stream it is
    block_of: dict[Any, int]  # op -> blocking number of its compute


def compile_streams(plan: Plan) -> list[Stream]:
    """Flatten the streams and match every send with its receive: the one carrying the same tensor
    (`schedcomp.planindex.transfer_key`) between the same two workers (FIFO if a hand-made plan repeats one)."""
    workers = plan.workers
    index_of = {w: i for i, w in enumerate(workers)}
    costs = plan.costs
    streams: list[Stream] = []
    recvs: dict[tuple[Any, ...], list[tuple[int, int]]] = {}
    pending_sends: list[tuple[int, int, Instruction]] = []
    for wi, w in enumerate(workers):
        instrs = tuple(plan.streams[w])
        codes = [_code(i.kind) for i in instrs]
        speed = costs.speed.get(w, 1.0)
        times = {k: costs.compute_time(k.value, w) for k in COMPUTE_KINDS}
        held = plan.topology.chunks_of(w.stage)  # its chunks: one ALLREDUCE and one STEP cover them all
        chunked = len(held) > 1
        st = Stream(w, instrs, codes, [], [], [], [], [], {})
        block_of = st.block_of
        waiting: dict[Any, list[int]] = {}  # op -> receives posted before its compute
        n_allreduce = 0
        for j, ins in enumerate(instrs):
            c = codes[j]
            if c == COMPUTE:
                block_of.setdefault(ins.op, len(st.at))
                inputs: tuple[int, ...] = tuple(waiting.pop(ins.op, ()))
                op = ins.op
                d = costs.compute_time(ins.kind.value, w, op.stage) if chunked and op is not None else times[ins.kind]
            elif c == STEP:
                inputs = ()
                d = costs.optimizer_of(held) / speed if semantics_of(ins.kind).cost == OPTIMIZER else 0.0
            elif c == ALLREDUCE:
                inputs = ()
                d = costs.allreduce_of(held)
                n_allreduce += 1
            else:
                if c == RECV:
                    if ins.peer not in index_of:
                        raise ValidationError(f"worker {w}, instruction {j} ({ins}) receives from {ins.peer}, which "
                                              "has no stream in this plan: re-lower the plan", worker=w, index=j)
                    waiting.setdefault(ins.op, []).append(j)
                    recvs.setdefault((transfer_key(ins), index_of[ins.peer], wi), []).append((wi, j))
                elif c == SEND:
                    pending_sends.append((wi, j, ins))
                continue
            st.inputs.append(inputs)
            st.ordinal.append(n_allreduce - 1)
            st.at.append(j)
            st.dur.append(d)
            st.sends.append([])
        for op, late in waiting.items():
            consumer = next((k for k in range(len(st.at)) if instrs[st.at[k]].op == op), None)
            if consumer is not None:
                j = late[0]
                raise ValidationError(
                    f"worker {w}, instruction {j} ({instrs[j]}) is posted after {op} (instruction {st.at[consumer]}) "
                    "that consumes it: move the receive before its consumer", worker=w, index=j)
        streams.append(st)
    for wi, j, ins in pending_sends:
        st = streams[wi]
        w = st.worker
        producer = st.block_of.get(ins.op)
        if producer is None:
            raise ValidationError(f"worker {w}, instruction {j} ({ins}) sends the output of {ins.op}, which this "
                                  "worker never runs: re-lower the plan", worker=w, index=j)
        if ins.peer not in index_of:
            raise ValidationError(f"worker {w}, instruction {j} ({ins}) sends to {ins.peer}, which has no stream in "
                                  "this plan: re-lower the plan", worker=w, index=j)
        queue = recvs.get((transfer_key(ins), wi, index_of[ins.peer]))
        if not queue:
            raise ValidationError(f"worker {w}, instruction {j} ({ins}) has no matching receive on {ins.peer}: every "
                                  "send needs one receive of the same micro-batch", worker=w, index=j)
        pwi, pj = queue.pop(0)
        st.sends[producer].append((j, pwi, pj))
    for queue in recvs.values():
        if queue:
            wi, j = queue[0]
            st = streams[wi]
            raise ValidationError(f"worker {st.worker}, instruction {j} ({st.instrs[j]}) has no matching send on "
                                  f"{st.instrs[j].peer}: every receive needs one send", worker=st.worker, index=j)
    return streams
