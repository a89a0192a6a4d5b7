"""Simulate a plan over its cost model: when each instruction runs, the period, bubbles and memory.

The semantics are those of docs/design.md, the contract the runtime follows:

- Every worker runs its stream in order, once per iteration, `iterations` times.
  Compute (F/B/W/BW), ALLREDUCE and STEP block the stream; LOAD takes no time.
- A send is posted when the op that produced its tensor completes, wherever the SEND sits
  in the stream, and arrives `costs.p2p` later. It never blocks the sender.
- A receive is posted when the stream reaches it and never blocks the stream; it completes
  when its data has arrived (the receiver buffers early arrivals). A compute op waits only
  for the receives of its own inputs, which must be posted earlier in the stream.
- ALLREDUCE is a collective over the stage's live workers: it starts when all of them reach
  it and takes `costs.allreduce[stage]` (nothing for a group of one: there is nobody to
  reduce with). STEP takes `costs.optimizer[stage]`. Compute and STEP are divided by the
  worker's speed factor (`costs.compute_time`).
- Staggered optimizer (default): a worker starts its next iteration right after its own
  STEP. `synchronous_optimizer=True` puts a global barrier after every iteration instead.

There is no contention for links or devices beyond the stream itself, so every time is a
max-plus function of earlier times and the order in which workers are advanced does not
matter: the engine advances each worker through its blocking instructions as far as it can,
parks it on the first input that is not there yet, and wakes it when that input is produced.
A worklist is all it needs (no clock, no heap); when it empties with a worker unfinished, the
plan deadlocks and we say where. Non-blocking instructions are timed afterwards: each starts
when the stream reaches it, at the end of the blocking instruction before it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import Any

from schedcomp import limits
from schedcomp.check import check, is_checked
from schedcomp.errors import SchedcompTypeError, ValidationError
from schedcomp.gradcheck import BARRIER, POST, GradCheckCost
from schedcomp.ir import Instruction, Plan
from schedcomp.memory import memory_levels, peak_of, stream_deltas
from schedcomp.simstreams import ALLREDUCE, COMPUTE, LOAD, RECV, SEND, STEP, Stream, compile_streams
from schedcomp.timeline import Span, Timing, period_from_ends, timeline_metrics
from schedcomp.topology import Worker

log = logging.getLogger(__name__)

__all__ = ["Simulation", "Span", "Timing", "simulate", "timeline_metrics"]


@dataclass(frozen=True)
class Simulation:
    """The simulated timeline of a plan and the metrics read off it.

    - `spans`: every instruction of every iteration, ordered by worker, iteration, index
      (built on first use: the metrics do not need them).
    - `makespan`: one iteration alone, from the first start to the last end of iteration 0.
    - `period`: steady-state time per iteration (see `timeline_metrics`).
    - `bubble_ratio`: 1 - compute time per iteration of all live workers / (period x live workers).
    - `memory`: each worker's peak activation memory (cost-model units); `peak_memory` the largest.
    - `iteration_ends`: when the last instruction of each iteration ended, on any worker.
    - `busy`: compute time per iteration of each worker.
    The metrics equal `timeline_metrics(spans)`; they are computed without building the spans.
    """

    workers: tuple[Worker, ...]
    makespan: float
    period: float
    bubble_ratio: float
    memory: Mapping[Worker, float]
    peak_memory: float
    iteration_ends: tuple[float, ...]
    busy: Mapping[Worker, float] = field(default_factory=dict)
    iterations: int = 1
    synchronous_optimizer: bool = False
    build_spans: Callable[[Sequence[int]], tuple[Span, ...]] = field(
        default=lambda iterations: (), repr=False, compare=False
    )

    @cached_property
    def spans(self) -> tuple[Span, ...]:
        return self.build_spans(range(self.iterations))

    def spans_in(self, iterations: Iterable[int]) -> tuple[Span, ...]:
        """The spans of some iterations only (cheaper than `spans` when drawing the first one)."""
        wanted = sorted({k for k in iterations if 0 <= k < self.iterations})
        if "spans" in self.__dict__:
            return tuple(s for s in self.spans if s.iteration in wanted)
        return self.build_spans(wanted)

    def spans_of(self, worker: Worker, iteration: int | None = None) -> tuple[Span, ...]:
        return tuple(s for s in self.spans if s.worker == worker and (iteration is None or s.iteration == iteration))

    def summary(self) -> dict[str, Any]:
        """The metrics as plain JSON values."""
        return {
            "makespan": self.makespan,
            "period": self.period,
            "bubble_ratio": self.bubble_ratio,
            "peak_memory": self.peak_memory,
            "memory": {str(w): m for w, m in sorted(self.memory.items())},
            "iterations": self.iterations,
            "synchronous_optimizer": self.synchronous_optimizer,
            "iteration_ends": list(self.iteration_ends),
        }


# ---- the engine --------------------------------------------------------------------------------


def simulate(plan: Plan, iterations: int = 4, synchronous_optimizer: bool = False, *,
             validate: bool = True, grad_check: GradCheckCost | None = None) -> Simulation:
    """Run `plan` for `iterations` iterations over its cost model (see the module docstring).

    The plan is validated first (`schedcomp.check.check`) unless it already passed it: the engine
    times what the plan says, and a plan that breaks the runtime's rules (a send after the op that
    needs it) would get a period it can never run at. Raises ValidationError naming the broken rule.
    `validate=False` times a plan as written (to study the engine on hand-made, partial plans); the
    engine still reports deadlocks and unmatched transfers it runs into, but not every broken rule.
    `grad_check`: time a global gradient check (clipping, non-finite skip) as `schedcomp.gradcheck` says.
    """
    if not isinstance(plan, Plan):
        raise SchedcompTypeError(f"simulate needs a Plan, got {type(plan).__name__}: compile one with "
                                 "schedcomp.compile(...) or read one with Plan.from_json(text)")
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ValidationError(f"iterations must be a positive integer, got {iterations!r}")
    limits.ITERATIONS.check(iterations, f"iterations={iterations}")
    total = iterations * sum(len(s) for s in plan.streams.values())
    limits.SIM_INSTRUCTIONS.check(total, f"simulating {iterations} iterations of this plan")
    if validate and not is_checked(plan):
        check(plan)
    streams = compile_streams(plan)
    if not any(st.instrs for st in streams):
        raise ValidationError("the plan has no instructions: compile it from a schedule first")
    K = iterations
    nw = len(streams)
    p2p = plan.costs.p2p
    sizes = [len(st.instrs) for st in streams]
    nbs = [len(st.at) for st in streams]
    by_stage: dict[int, list[int]] = {}
    for wi, st in enumerate(streams):
        by_stage.setdefault(st.worker.stage, []).append(wi)
    groups = [tuple(by_stage[st.worker.stage]) for st in streams]
    # Times per stream position it*n + j; nan = not yet known.
    start = [[math.nan] * (n * K) for n in sizes]
    end = [[math.nan] * (n * K) for n in sizes]
    arrival = [[math.nan] * (n * K) for n in sizes]
    iter_start = [[0.0] * K for _ in streams]
    pos = [0] * nw  # next blocking instruction, counted over all iterations: it * nb + k
    clock = [0.0] * nw  # when the stream is free
    waiting = [False] * nw
    rendezvous: dict[tuple[Any, ...], dict[int, tuple[float, int]]] = {}  # all-reduce: who reached it, when
    participants = sum(1 for nb in nbs if nb)  # streams that take part in the synchronous barrier
    barrier: dict[int, list[float]] = {}  # synchronous optimizer: iteration -> end times reported
    released = [0] * nw  # synchronous optimizer: the last iteration this stream may start
    queue = list(range(nw))
    queued = [True] * nw
    # the global gradient check (`gradcheck`): who launched its share of iteration it, when
    check_barrier = grad_check is not None and grad_check.mode == BARRIER
    check_post = grad_check is not None and grad_check.mode == POST
    stepping = sum(1 for st in streams if STEP in st.codes)
    launched: dict[int, dict[int, float]] = {}
    validated = [0] * nw  # post: the last iteration whose start waited for the previous one's check
    redo = [grad_check.redo_time(sum(st.dur[k] for k in range(len(st.at)) if st.codes[st.at[k]] == STEP))
            if grad_check is not None else 0.0 for st in streams]

    def wake(v: int) -> None:
        if waiting[v] and not queued[v]:
            waiting[v] = False
            queued[v] = True
            queue.append(v)

    while queue:
        wi = queue.pop()
        queued[wi] = False
        st = streams[wi]
        n, nb = sizes[wi], nbs[wi]
        at, dur, inputs, sends = st.at, st.dur, st.inputs, st.sends
        s_start, s_end, s_arr = start[wi], end[wi], arrival[wi]
        p, t, total = pos[wi], clock[wi], nb * K
        blocked = False
        while p < total:
            it, k = divmod(p, nb)
            if k == 0 and it > 0:
                if synchronous_optimizer and released[wi] < it:
                    reached = barrier.setdefault(it, [])
                    if len(reached) < participants and wi not in reached:
                        reached.append(wi)
                        clock[wi] = t
                    if len(reached) < participants:
                        blocked = True
                        break
                    t = max(clock[v] for v in reached)
                    for v in reached:
                        released[v] = it
                        clock[v] = t
                        if v != wi:
                            wake(v)
                if check_post and validated[wi] < it:
                    assert grad_check is not None
                    shares = launched.get(it - 1, {})
                    if len(shares) < stepping:
                        clock[wi] = t
                        blocked = True
                        break
                    t = max(t, max(shares.values()) + grad_check.reduce) + redo[wi]
                    validated[wi] = it
                iter_start[wi][it] = t
            j = at[k]
            base = it * n
            code = st.codes[j]
            if code == COMPUTE:
                ready = t
                for r in inputs[k]:
                    a = s_arr[base + r]
                    if a != a:  # nan: the data has not been sent yet
                        blocked = True
                        break
                    if a > ready:
                        ready = a
                if blocked:
                    break
                t = ready + dur[k]
                s_start[base + j], s_end[base + j] = ready, t
                for js, pwi, pj in sends[k]:
                    s_start[base + js], s_end[base + js] = t, t + p2p
                    arrival[pwi][it * sizes[pwi] + pj] = t + p2p
                    wake(pwi)
            elif code == STEP and check_barrier:  # every STEP waits for every worker's share
                assert grad_check is not None
                reached_check = rendezvous.setdefault(("check", it), {})
                reached_check[wi] = (t, p)
                if len(reached_check) < stepping:
                    blocked = True
                    break
                begin = max(r[0] for r in reached_check.values()) + grad_check.reduce
                del rendezvous[("check", it)]
                for v, (_, vp) in reached_check.items():
                    vit, vk = divmod(vp, nbs[v])
                    vj = vit * sizes[v] + streams[v].at[vk]
                    start[v][vj], end[v][vj] = begin, begin + streams[v].dur[vk]
                    if v != wi:
                        pos[v], clock[v] = vp + 1, end[v][vj]
                        wake(v)
                t = begin + dur[k]
            elif code == STEP:
                s_start[base + j], s_end[base + j] = t, t + dur[k]
                if check_post:  # its share is sent as STEP starts; workers waiting on it may go on
                    launched.setdefault(it, {})[wi] = t
                    for v in range(nw):
                        wake(v)
                t += dur[k]
            elif code == ALLREDUCE:  # a collective over the stage's live workers
                group = groups[wi]
                key = (group, it, st.ordinal[k])
                reached_ar = rendezvous.setdefault(key, {})
                reached_ar[wi] = (t, p)
                if len(reached_ar) < len(group):
                    blocked = True
                    break
                begin = max(r[0] for r in reached_ar.values())
                finish = begin + (dur[k] if len(group) > 1 else 0.0)
                del rendezvous[key]
                for v, (_, vp) in reached_ar.items():
                    vit, vk = divmod(vp, nbs[v])
                    vj = vit * sizes[v] + streams[v].at[vk]
                    start[v][vj], end[v][vj] = begin, finish
                    if v != wi:  # parked at this ALLREDUCE: move it past
                        pos[v], clock[v] = vp + 1, finish
                        wake(v)
                t = finish
            else:  # `compile_streams` numbers only these three as blocking
                raise AssertionError(f"blocking code {code} has no timing rule")
            p += 1
        pos[wi], clock[wi] = p, t
        waiting[wi] = blocked
    stuck = [wi for wi in range(nw) if pos[wi] < nbs[wi] * K]
    if stuck:
        _raise_deadlock(streams, stuck, pos, arrival, groups, synchronous_optimizer)
    workers = tuple(st.worker for st in streams)
    timing = _timing(streams, start, end, arrival, K)
    memory = {st.worker: _peak_memory(plan, st, K) for st in streams}
    log.debug("simulated %s x%d: makespan %.3f period %.3f", plan.family or "plan", K, timing.makespan, timing.period)
    return Simulation(
        workers=workers,
        makespan=timing.makespan,
        period=timing.period,
        bubble_ratio=timing.bubble_ratio,
        memory=memory,
        peak_memory=max(memory.values(), default=0.0),
        iteration_ends=timing.iteration_ends,
        busy=timing.busy,
        iterations=K,
        synchronous_optimizer=synchronous_optimizer,
        build_spans=partial(_spans, streams, start, end, arrival, iter_start),
    )


def _timing(
    streams: list[Stream], start: list[list[float]], end: list[list[float]], arrival: list[list[float]], K: int
) -> Timing:
    """`timeline_metrics` of the spans, read straight off the time arrays.

    A receive ends at max(post, arrival) and is posted at the end of a blocking instruction or
    of the previous iteration, so the arrivals and the other ends bound every span's end.
    """
    ends = [-math.inf] * K
    first_start = math.inf
    for wi, st in enumerate(streams):
        n = len(st.instrs)
        for it in range(K):
            lo, hi = it * n, (it + 1) * n
            last = max((x for x in end[wi][lo:hi] if x == x), default=-math.inf)
            last = max(last, max((x for x in arrival[wi][lo:hi] if x == x), default=-math.inf))
            ends[it] = max(ends[it], last)
        if n:  # loads and receives are not in `start`: they begin with the iteration, at 0
            first = 0.0 if st.codes[0] in (LOAD, RECV) else math.inf
            first_start = min(first_start, first, min((x for x in start[wi][:n] if x == x), default=math.inf))
    for k in range(1, K):
        ends[k] = max(ends[k], ends[k - 1])
    makespan = ends[0] - first_start
    period = period_from_ends(ends, makespan)
    busy = {st.worker: sum(d for k, d in enumerate(st.dur) if st.codes[st.at[k]] == COMPUTE) for st in streams}
    capacity = period * len(streams)
    bubble = 1.0 - sum(busy.values()) / capacity if capacity > 0 else 0.0
    return Timing(makespan, period, bubble, tuple(ends), busy)


def _spans(
    streams: list[Stream],
    start: list[list[float]],
    end: list[list[float]],
    arrival: list[list[float]],
    iter_start: list[list[float]],
    iterations: Sequence[int],
) -> tuple[Span, ...]:
    """Build the spans, timing each non-blocking instruction at the end of the blocking one before it."""
    out = []
    for wi, st in enumerate(streams):
        w, instrs, codes = st.worker, st.instrs, st.codes
        s_start, s_end, s_arr = start[wi], end[wi], arrival[wi]
        n = len(instrs)
        for it in iterations:
            t = iter_start[wi][it]
            base = it * n
            for j in range(n):
                p = base + j
                c = codes[j]
                if c == RECV:
                    a = s_arr[p]
                    out.append(Span(w, it, j, instrs[j], t, a if a > t else t))
                elif c == LOAD:
                    out.append(Span(w, it, j, instrs[j], t, t))
                else:  # blocking, or a send timed by its producer
                    out.append(Span(w, it, j, instrs[j], s_start[p], s_end[p]))
                    if c != SEND:
                        t = s_end[p]
    return tuple(out)


def _peak_memory(plan: Plan, st: Stream, iterations: int) -> float:
    """Most activation memory the worker holds. Its instructions run one at a time in stream order,
    so the levels are prefix sums, and iteration k shifts them by k x the net change."""
    levels = memory_levels(stream_deltas(plan.costs, st.instrs, st.worker.stage))
    level, peak = (levels[-1] if levels else 0.0), peak_of(levels)
    return peak + (iterations - 1) * level if level > 1e-9 else peak


def _raise_deadlock(
    streams: list[Stream],
    stuck: list[int],
    pos: list[int],
    arrival: list[list[float]],
    groups: list[tuple[int, ...]],
    synchronous_optimizer: bool,
) -> None:
    def where(wi: int) -> tuple[int, int, Instruction]:
        st = streams[wi]
        it, k = divmod(pos[wi], len(st.at))
        return it, st.at[k], st.instrs[st.at[k]]

    def reason(wi: int) -> str:
        st = streams[wi]
        it, k = divmod(pos[wi], len(st.at))
        j = st.at[k]
        if synchronous_optimizer and k == 0 and it > 0:
            return "waits at the synchronous optimizer barrier"
        if st.codes[j] == ALLREDUCE:
            others = [str(streams[v].worker) for v in groups[wi] if v != wi and v in stuck]
            return f"waits in ALLREDUCE for {', '.join(others) or 'its stage group'}"
        base = it * len(st.instrs)
        missing = [r for r in st.inputs[k] if math.isnan(arrival[wi][base + r])]
        if missing:
            return f"waits for {st.instrs[missing[0]]} (instruction {missing[0]}), whose data is never sent"
        return "cannot proceed"

    lines = []
    for wi in stuck:
        it, j, ins = where(wi)
        lines.append(f"{streams[wi].worker} iteration {it} instruction {j} ({ins}): {reason(wi)}")
    wi = stuck[0]
    it, j, ins = where(wi)
    worker = streams[wi].worker
    # Say where the missing input's sender is stuck: that is the cycle a human must break.
    detail = ""
    if streams[wi].codes[j] == COMPUTE:
        peers = {streams[wi].instrs[r].peer for r in streams[wi].inputs[divmod(pos[wi], len(streams[wi].at))[1]]}
        for v in stuck:
            if streams[v].worker in peers:
                pit, pj, pins = where(v)
                detail = f"; {streams[v].worker} is itself stuck at iteration {pit} instruction {pj} ({pins})"
                break
    raise ValidationError(
        f"deadlock: worker {worker} is stuck at iteration {it} instruction {j} ({ins}): {reason(wi)}{detail} "
        f"({len(stuck)} worker(s) stuck; reorder the streams so every input is produced before it is awaited)",
        worker=worker, index=j, grid="\n".join(lines))
