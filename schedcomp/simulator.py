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

The rules are the timing core's (`schedcomp.timecore`): each stream's blocking instructions are a
lane of its graph, a compute op waits for the producers of the receives it consumes (the pairs the
plan's `PlanIndex` proved), and the ALLREDUCEs of a stage group meet. When the core finds the lanes
deadlocked we say where. Non-blocking instructions are timed afterwards: each starts when the
stream reaches it, at the end of the blocking instruction before it; a send when its producer ends.
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
from schedcomp.gcpause import paused_gc
from schedcomp.gradcheck import BARRIER, GradCheckCost
from schedcomp.ir import Instruction, Plan
from schedcomp.memory import memory_levels, peak_of, stream_deltas
from schedcomp.simfast import time_lowered
from schedcomp.simstreams import ALLREDUCE, COMPUTE, LOAD, RECV, SEND, STEP, Lanes, Stream, compile_streams
from schedcomp.streamcolumns import instruction_count
from schedcomp.timecore import Gate, Graph, LaneRun, Stuck, run_lanes
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
    total = iterations * instruction_count(plan.streams)
    limits.SIM_INSTRUCTIONS.check(total, f"simulating {iterations} iterations of this plan")
    if validate and not is_checked(plan):
        check(plan)
    if grad_check is None and is_checked(plan):
        with paused_gc():  # many small acyclic objects: see `schedcomp.gcpause`
            fast = time_lowered(plan, iterations, synchronous_optimizer)
        if fast is not None:
            return Simulation(workers=tuple(sorted(fast.busy)), makespan=fast.makespan, period=fast.period,
                              bubble_ratio=fast.bubble_ratio, memory=fast.memory,
                              peak_memory=max(fast.memory.values(), default=0.0), iteration_ends=fast.iteration_ends,
                              busy=fast.busy, iterations=iterations, synchronous_optimizer=synchronous_optimizer,
                              build_spans=partial(_spans_of, plan, iterations, synchronous_optimizer))
    lanes = compile_streams(plan)
    streams = lanes.streams
    if not any(st.instrs for st in streams):
        raise ValidationError("the plan has no instructions: compile it from a schedule first")
    K = iterations
    gate = None
    if grad_check is not None:
        lanes, gate = _with_grad_check(lanes, grad_check)
    run = run_lanes(lanes.graph, lanes.seqs, lanes.durations, K, synchronous_optimizer, keep=range(K), gate=gate)
    if run.stuck is not None:
        if grad_check is not None:
            raise ValidationError("the global gradient check's barrier deadlocks this plan: a worker's STEP "
                                  "waits for work that comes after another worker's STEP")
        _raise_deadlock(lanes, run.stuck)
    p2p = plan.costs.p2p
    workers = tuple(st.worker for st in streams)
    timing = _timing(streams, run, p2p, K)
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
        build_spans=partial(_spans, streams, run, p2p),
    )


def _spans_of(plan: Plan, iterations: int, synchronous: bool, wanted: Sequence[int]) -> tuple[Span, ...]:
    """The spans of a plan the fast path timed: the general engine, run only when they are drawn."""
    lanes = compile_streams(plan)
    run = run_lanes(lanes.graph, lanes.seqs, lanes.durations, iterations, synchronous, keep=range(iterations))
    return _spans(lanes.streams, run, plan.costs.p2p, wanted)


def _with_grad_check(lanes: Lanes, cost: GradCheckCost) -> tuple[Lanes, Gate | None]:
    """`lanes` with the global gradient check's nodes (`schedcomp.gradcheck`), one before each STEP.

    Barrier: a collective over every worker that steps, lasting `cost.reduce`, so each STEP starts
    at the last worker's arrival plus the reduction. Post-validation: a node of no duration (its
    end is the STEP's start, when the worker's share is sent) and a `Gate`: each worker's next
    iteration waits for every share plus the reduction, then pays its expected undo and redo.
    """
    streams, graph = lanes.streams, lanes.graph
    base = len(graph.preds)
    steps = [[st.first + k for k, j in enumerate(st.at) if st.codes[j] == STEP] for st in streams]
    added = [base + i for i in range(sum(len(s) for s in steps))]
    barrier = cost.mode == BARRIER
    seqs, new = [], iter(added)
    for seq, lane_steps in zip(lanes.seqs, steps, strict=True):
        before = {node: next(new) for node in lane_steps}
        seqs.append([v for node in seq for v in ((before[node], node) if node in before else (node,))])
    durations = [*lanes.durations[0], *([cost.reduce if barrier else 0.0] * len(added))]
    members = [*graph.members, *([tuple(added)] * len(added) if barrier else [()] * len(added))]
    checked = Lanes(streams, Graph([*graph.preds, *([()] * len(added))], members), seqs,
                    [durations] * len(seqs), lanes.groups)
    if barrier:
        return checked, None
    step_time = [sum(lanes.durations[0][node] for node in lane_steps) for lane_steps in steps]
    return checked, Gate(tuple(added), cost.reduce, tuple(cost.redo_time(t) for t in step_time))


def _timing(streams: list[Stream], run: LaneRun, p2p: float, K: int) -> Timing:
    """`timeline_metrics` of the spans, read straight off the core's node times.

    A send ends, and its data arrives, `p2p` after its producer; a receive ends at max(post, arrival)
    and is posted at the end of a blocking instruction or of the previous iteration, so the arrivals
    and the blocking ends bound every span's end.
    """
    senders = sorted({node for st in streams for node in st.source.values()})
    ends = [-math.inf] * K
    for it in range(K):
        node_ends = run.ends[it]
        last = max(node_ends, default=-math.inf)
        if senders:
            last = max(last, max(node_ends[v] for v in senders) + p2p)
        ends[it] = last if it == 0 else max(last, ends[it - 1])
    # Loads and receives are not nodes: a stream that opens with one begins at 0.
    opens = [0.0 for st in streams if st.instrs and st.codes[0] in (LOAD, RECV)]
    first_start = min((*opens, *run.starts[0]), default=math.inf)
    makespan = ends[0] - first_start
    period = period_from_ends(ends, makespan)
    busy = {st.worker: sum(d for k, d in enumerate(st.dur) if st.codes[st.at[k]] == COMPUTE) for st in streams}
    capacity = period * len(streams)
    bubble = 1.0 - sum(busy.values()) / capacity if capacity > 0 else 0.0
    return Timing(makespan, period, bubble, tuple(ends), busy)


def _spans(streams: list[Stream], run: LaneRun, p2p: float, iterations: Sequence[int]) -> tuple[Span, ...]:
    """Build the spans, timing each non-blocking instruction at the end of the blocking one before it."""
    out = []
    for wi, st in enumerate(streams):
        w, instrs, codes, source = st.worker, st.instrs, st.codes, st.source
        for it in iterations:
            starts, ends = run.starts[it], run.ends[it]
            t = run.releases[it][wi]
            node, at = st.first, st.at
            for j, c in enumerate(codes):
                if c == RECV:
                    a = ends[source[j]] + p2p
                    out.append(Span(w, it, j, instrs[j], t, a if a > t else t))
                elif c == LOAD:
                    out.append(Span(w, it, j, instrs[j], t, t))
                elif c == SEND:  # posted when its producer ends, whatever its place in the stream
                    e = ends[source[j]]
                    out.append(Span(w, it, j, instrs[j], e, e + p2p))
                else:  # its node (a re-formed pipeline's ALLREDUCE: one per segment, spanned whole)
                    last = node
                    while last + 1 - st.first < len(at) and at[last + 1 - st.first] == j:
                        last += 1
                    out.append(Span(w, it, j, instrs[j], starts[node], ends[last]))
                    t = ends[last]
                    node = last + 1
    return tuple(out)


def _peak_memory(plan: Plan, st: Stream, iterations: int) -> float:
    """Most activation memory the worker holds. Its instructions run one at a time in stream order,
    so the levels are prefix sums, and iteration k shifts them by k x the net change."""
    levels = memory_levels(stream_deltas(plan.costs_of(st.worker.pipeline), st.instrs, st.worker.stage, plan.cut))
    level, peak = (levels[-1] if levels else 0.0), peak_of(levels)
    return peak + (iterations - 1) * level if level > 1e-9 else peak


def _raise_deadlock(lanes: Lanes, stuck: Stuck) -> None:
    streams, groups, it = lanes.streams, lanes.groups, stuck.iteration
    waiting = [wi for wi, st in enumerate(streams) if stuck.positions[wi] < len(st.at)]

    def where(wi: int) -> tuple[int, Instruction]:
        st = streams[wi]
        j = st.at[stuck.positions[wi]]
        return j, st.instrs[j]

    def reason(wi: int) -> str:
        st = streams[wi]
        k = stuck.positions[wi]
        if st.codes[st.at[k]] == ALLREDUCE:
            others = [str(streams[v].worker) for v in groups[wi] if v != wi and v in waiting]
            return f"waits in ALLREDUCE for {', '.join(others) or 'its stage group'}"
        missing = [r for r in st.inputs[k] if stuck.done[st.source[r]] != it]
        if missing:
            return f"waits for {st.instrs[missing[0]]} (instruction {missing[0]}), whose data is never sent"
        return "cannot proceed"

    lines = []
    for wi in waiting:
        j, ins = where(wi)
        lines.append(f"{streams[wi].worker} iteration {it} instruction {j} ({ins}): {reason(wi)}")
    wi = waiting[0]
    j, ins = where(wi)
    worker = streams[wi].worker
    # Say where the missing input's sender is stuck: that is the cycle a human must break.
    detail = ""
    if streams[wi].codes[j] == COMPUTE:
        peers = {streams[wi].instrs[r].peer for r in streams[wi].inputs[stuck.positions[wi]]}
        for v in waiting:
            if streams[v].worker in peers:
                pj, pins = where(v)
                detail = f"; {streams[v].worker} is itself stuck at iteration {it} instruction {pj} ({pins})"
                break
    raise ValidationError(
        f"deadlock: worker {worker} is stuck at iteration {it} instruction {j} ({ins}): {reason(wi)}{detail} "
        f"({len(waiting)} worker(s) stuck; reorder the streams so every input is produced before it is awaited)",
        worker=worker, index=j, grid="\n".join(lines))
