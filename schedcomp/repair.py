"""Plan repair: the plan in use and one more failed worker in, a valid plan out at once.

`repair(plan, worker)` re-routes only the failed worker's work and keeps everything else. It works on one
global timeline, the start times of the plan in use (`optimes.op_times`): every stream runs its ops in the
order of their times, and every op starts after the ops it reads from. So

1. the failed worker's slots (each micro-batch it ran at its stage), in the order of their F, go to live
   peers of its stage, each op at its time on the failed worker: inserted into the peer's compute order
   where that time falls, its W right after its B (which frees the memory soonest). Every touched stream
   stays sorted by time and every moved op keeps a time between its producers' and its consumers', so one
   global order is consistent with all streams and all dependencies, and the plan cannot deadlock (the
   standard list-scheduling argument);
2. where the peer would exceed the memory limit, the F waits (a later time, but before its consumer at the
   next stage) and the backward comes as early as its producers allow; never against the timeline. Where
   every peer (of the `repair_place.TRIALS` least loaded) is full all that while (adaptive plans fill the fault-free
   limit), the F waits for memory past its consumer's time: the times are then no longer a timeline, so
   the result is timed, which finds any wait cycle: only the ops the edit can move, from the kept timeline
   (`OpTimes.edited`, `conetime`: 0.1-0.2 s at pp = 32, dp = 256, where timing the whole plan took
   0.5-0.7 s). Where it finds one, the fallback (`repair_place.pipelines_last`): the slots' pipelines run
   after every other pipeline's ops on the lanes that run them beside others', in the order of the
   timeline, the failed worker's slots on the least loaded peers, merged by time with those peers' own ops
   of these pipelines. No other pipeline then waits for theirs, so that cannot deadlock, and it keeps to
   the memory limit wherever a peer has room for them: a slower stop-gap, but a valid plan at once. Memory
   is thus the only reason to refuse (compile for the new failure set);
3. the streams whose compute order changed (the peers that took slots; with the fallback, every lane of
   the moved pipelines) and the failed worker's neighbours are lowered again (`lower`'s per-worker step,
   over their new compute orders, with who runs each neighbouring slot read off the streams' own
   transfers); every other stream is the very tuple it was.

The work is that of the few streams touched, not of the job, once the timeline is known: a plan's
timeline at pp = 32, dp = 256 takes about 2.5 s (`optimes`), so it is kept with the plan (the runtime can
time the plan in use before any failure) and a repaired plan carries its own, so repairs chain with no
timing unless memory made an F wait (2.; each repair 0.1-0.4 s, `bench/bench_compile_speed.py --scale`).
The result is still checked (`check`, seconds at that scale) unless `validate=False`; a check that fails
is a `RecoveryError`. The repaired plan is a stop-gap: its period is worse than a full compile's for the
new failure set, which replaces it at an iteration boundary.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from schedcomp.check import check, peak_memory
from schedcomp.costs import CostModel
from schedcomp.errors import RecoveryError, SchedcompTypeError, ScheduleError, TopologyError, ValidationError
from schedcomp.ir import COMPUTE_KINDS, Instruction, Op, OpKind, Plan
from schedcomp.lower import _stream
from schedcomp.memory import FAULT_FREE, MemoryLimit, is_fault_free, limit_top, resolve_limit, stage_peak_memory
from schedcomp.optimes import op_times, remember, retimed
from schedcomp.repair_place import compute_ops, pipelines_last, place, slots_of
from schedcomp.semantics import InstrKind
from schedcomp.streamcolumns import EditedStreams
from schedcomp.topology import Topology, Worker, as_workers

__all__ = ["lookup_or_repair", "repair"]


def repair(plan: Plan, failed: Worker | tuple[int, int] | str, *, validate: bool = True,
           memory_limit: MemoryLimit = FAULT_FREE) -> Plan:
    """`plan` with `failed` dead too, by a local re-route (see the module docstring); checked unless
    `validate=False`. `memory_limit`: by default the plan's own limit, or for a fault-free plan (which
    carries none) its own per-stage peaks, so a peer never holds more than its stage held before the
    failure (the memory the job was sized for); a plan with failures compiled with no limit keeps none.
    Any other value is `compile`'s (`memory_limit=None`: no limit). Raises `TopologyError` for a
    worker outside the job or already failed, `RecoveryError` when its stage has no live worker left or
    no peer has the memory for a slot, `ScheduleError` for plans with virtual stages, re-cut
    micro-batches or streams `lower` did not make."""
    if not isinstance(plan, Plan):
        raise SchedcompTypeError(f"repair needs a Plan, got {type(plan).__name__}")
    topo = plan.topology
    worker = _worker(topo, failed)
    if topo.chunks > 1:
        raise ScheduleError(f"repair re-routes one stage per worker, not chunks={topo.chunks}: compile the plan "
                            "for the new failure set instead")
    if plan.cut:
        raise ScheduleError("repair moves whole micro-batches, and this plan has re-cut ones (--recut): compile "
                            "the plan for the new failure set instead")
    if plan.partitions is not None:
        raise ScheduleError("repair re-routes over one partition, and this plan has re-formed pipelines (their own "
                            "partitions): compile the plan for the new failure set instead")
    after = Topology(topo.pp, topo.dp, topo.failed | {worker}, topo.chunks, topo.placement)
    peers = after.stage_group(worker.stage)
    if not peers:
        raise RecoveryError(f"{worker} was the last live worker of stage {worker.stage}, so its micro-batches cannot "
                            "be re-routed: recovery needs a checkpoint (restart from the last one)")
    times = op_times(plan)
    if times is None:
        raise ScheduleError("repair edits plans as `lower` makes them (compute, transfers, then all-reduce and "
                            "step): compile the plan for the new failure set instead")
    costs = _repair_costs(plan, after, memory_limit)  # its memory limit binds the re-route
    if not is_fault_free(memory_limit) and costs.memory_limit is not None:
        # (A re-route keeps every other worker as it is: a limit below what they hold now cannot be met.)
        peaks = stage_peak_memory(peak_memory(plan), topo.pp)
        over = next((s for s in range(topo.pp) if peaks[s] > limit_top(costs.limit_at(s))), None)  # (check's test)
        if over is not None:
            raise RecoveryError(f"the plan in use already holds {peaks[over]:g} at stage {over}, above the memory "
                                f"limit {costs.limit_at(over):g} asked for: give at least the plan's own peaks, or "
                                "compile the plan for the new failure set instead")
    slots = slots_of(plan.streams[worker], times)
    taken, moved, late = place(worker, slots, plan.streams, peers, costs, times, topo.pp)
    # Its timeline, kept with it so a further repair needs no timing: where forwards waited, timing the cone
    # of the edit is the deadlock check (before lowering anything).
    timed = retimed(times, after, costs, taken) if late else times.moved(after, taken, moved)
    if timed is None:  # a forward waiting inside a peer's order closed a wait cycle: the pipeline goes last
        taken = pipelines_last(worker, slots, plan.streams, peers, costs, times, after)
        timed = retimed(times, after, costs, taken)
    if timed is None:  # (not expected: see `pipelines_last`)
        raise RecoveryError(f"the local re-route around {worker} deadlocks even with its pipelines last: compile "
                            "the plan for the new failure set instead")
    repaired = Plan(after, costs, plan.microbatches, _relower(plan, worker, after, taken), plan.family, "repair",
                    None, _kept_meta(plan.meta), partition=plan.partition)
    remember(repaired, timed)
    if validate:
        try:
            check(repaired)
        except ValidationError as exc:  # not expected (see the module docstring): a bug, so never run it
            raise RecoveryError(f"the local re-route around {worker} does not validate ({exc}): compile the plan "
                                "for the new failure set instead") from None
    return repaired


def lookup_or_repair(plans: Any, failed: Iterable[Worker | tuple[int, int]] | Topology, *,
                     validate: bool = True, memory_limit: MemoryLimit = FAULT_FREE) -> Plan:
    """`plans.lookup(failed)` (a `PlanCache`), or on a miss the cached plan of the largest set of the
    failed workers in rank order that it holds, repaired around the rest one at a time: a cache of every
    k-failure set then serves more failures at once, with no compile. Deterministic, so every rank of a
    job that calls it gets the same plan (`ResilientTrainer(lambda t: lookup_or_repair(cache, t), ...)`).
    `repair` moves whole micro-batches over one partition, so a cached plan that re-cuts them (`precompile
    --recut`) or re-forms pipelines is passed over for a smaller set's (the fault-free plan does neither)."""
    try:
        return plans.lookup(failed)  # type: ignore[no-any-return]
    except RecoveryError as miss:
        workers = sorted(failed.failed if isinstance(failed, Topology) else as_workers(failed))
        for n in range(len(workers) - 1, -1, -1):
            try:
                plan: Plan = plans.lookup(workers[:n])
            except RecoveryError:
                continue
            if plan.cut or plan.partitions is not None:  # (a re-formed plan: its own partitions, none to re-route)
                continue
            for w in workers[n:]:
                plan = repair(plan, w, validate=validate, memory_limit=memory_limit)
            return plan
        raise miss from None


def _repair_costs(plan: Plan, after: Topology, memory_limit: MemoryLimit) -> CostModel:
    """The plan's costs with the limit a repair keeps to (see `repair`)."""
    if not is_fault_free(memory_limit):
        return resolve_limit(memory_limit, after, plan.microbatches, plan.costs)
    if plan.costs.memory_limit is not None or plan.topology.failed:
        return plan.costs
    return plan.costs.with_memory_limit(stage_peak_memory(peak_memory(plan), plan.topology.pp))


def _worker(topo: Topology, failed: object) -> Worker:
    (worker,) = as_workers([failed])
    if not (0 <= worker.pipeline < topo.dp and 0 <= worker.stage < topo.pp):
        raise TopologyError(f"worker {worker} is not in the job: pipelines are 0..{topo.dp - 1}, "
                            f"stages 0..{topo.pp - 1}")
    if worker in topo.failed:
        raise TopologyError(f"worker {worker} has failed already: this plan re-routes around it; name a live worker")
    return worker


_ACT, _GRAD = 0, 1
_SENDS = {InstrKind.SEND_ACT: (1, _ACT), InstrKind.SEND_GRAD: (-1, _GRAD)}  # -> (peer's stage offset, channel)
_RECVS = {InstrKind.RECV_ACT: -1, InstrKind.RECV_GRAD: 1}


def _relower(plan: Plan, worker: Worker, after: Topology, orders: dict[Worker, list[Op]]) -> EditedStreams:
    """Every live worker's stream: lowered again for the workers whose compute order changed (`orders`) and
    the failed worker's neighbours, the same tuple for everyone else."""
    pp, mbs = after.stages, plan.microbatches
    old = plan.streams
    neighbours = {ins.peer for ins in old[worker] if ins.peer is not None}
    redo = {w: orders.get(w) or compute_ops(old[w]) for w in sorted({*orders, *neighbours})}

    def slot(op: Op) -> int:
        return (op.pipeline * mbs + op.microbatch) * pp + op.stage

    # Who runs each slot the re-lowered streams touch, read off their own transfers (and the failed
    # worker's, whose slots then move to their new runners).
    runner: dict[int, Worker] = {}
    offset = {**{kind: step for kind, (step, _) in _SENDS.items()}, **_RECVS}  # the peer's slot, from ours
    computes = COMPUTE_KINDS
    for w in (*redo, worker):
        for ins in old[w]:  # (the slot inlined: a few hundred thousand instructions at pp = 32, dp = 256)
            op, peer = ins.op, ins.peer
            if op is None:
                continue
            if peer is not None:
                step = offset.get(ins.kind)
                if step is not None:
                    runner[(op.pipeline * mbs + op.microbatch) * pp + op.stage + step] = peer
            elif w != worker and ins.kind in computes:
                runner[(op.pipeline * mbs + op.microbatch) * pp + op.stage] = w
    for w, ops in redo.items():
        for op in ops:
            runner[slot(op)] = w
    numbers: dict[Worker, int] = {}
    for w in (*redo, *runner.values()):
        numbers.setdefault(w, len(numbers))
    workers = list(numbers)
    runner_no = {t: numbers[w] for t, w in runner.items()}

    def sends_of(ops: list[Op]) -> list[tuple[int, int] | None]:
        out: list[tuple[int, int] | None] = []
        for op in ops:
            t = slot(op)
            if op.kind is OpKind.F and op.stage < pp - 1:
                out.append((t * 2, runner_no[t + 1]))
            elif op.kind in (OpKind.B, OpKind.BW) and op.stage > 0:
                out.append((t * 2 + 1, runner_no[t - 1]))
            else:
                out.append(None)
        return out

    sends = {w: sends_of(ops) for w, ops in redo.items()}
    inbound: dict[Worker, dict[int, list[int]]] = {w: {} for w in redo}
    for w, out in sends.items():  # channels from a re-lowered sender: its new order
        for sent in out:
            if sent is not None and workers[sent[1]] in inbound:
                inbound[workers[sent[1]]].setdefault(numbers[w], []).append(sent[0])
    kept: dict[Worker, dict[Worker, list[int]]] = {}  # sender kept as it was -> receiver -> its channels
    for w, ops in redo.items():  # channels from a sender kept as it was: its stream's order
        senders = {runner[t] for t in (_source(op, slot(op), pp) for op in ops) if t is not None}
        for x in senders - redo.keys():
            if x not in kept:
                kept[x] = _channels(old[x], mbs, pp)
            inbound[w][numbers[x]] = kept[x].get(w, [])
    changed = {w: _stream(numbers[w], tuple(ops), pp, mbs, runner_no, workers, sends[w], inbound[w])
               for w, ops in redo.items() if w != worker}
    return EditedStreams(old, changed, worker)  # (the others' streams are read from the plan's when read)


def _channels(stream: Sequence[Instruction], mbs: int, pp: int) -> dict[Worker, list[int]]:
    """The tensors (slot * 2 + channel) a stream sends, per receiver, in its order."""
    out: dict[Worker, list[int]] = {}
    for ins in stream:
        sent = _SENDS.get(ins.kind)
        op = ins.op
        if sent is not None and op is not None and ins.peer is not None:
            out.setdefault(ins.peer, []).append(((op.pipeline * mbs + op.microbatch) * pp + op.stage) * 2 + sent[1])
    return out


def _source(op: Op, slot: int, pp: int) -> int | None:
    """The slot whose tensor `op` reads from another stage: an F the previous stage's, a B (or BW) the next's."""
    if op.kind is OpKind.F:
        return slot - 1 if op.stage > 0 else None
    if op.kind is OpKind.W:
        return None
    return slot + 1 if op.stage < pp - 1 else None


def _kept_meta(meta: dict) -> dict:
    """What a repaired plan keeps of its source's `meta`: not the compiler's choice between candidates, which
    names the source's periods (`choice`)."""
    return {k: v for k, v in meta.items() if k != "choice"}
