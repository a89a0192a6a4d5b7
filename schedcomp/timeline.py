"""Timelines: when each instruction ran on each worker, and the metrics read off them.

A timeline is a sequence of `Span`s. The simulator predicts one from a plan; the runtime
measures one; `timeline_metrics` reads makespan, period and bubbles off either, so the
two can be compared like for like.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from schedcomp.errors import ValidationError
from schedcomp.ir import Instruction
from schedcomp.topology import Worker

__all__ = ["Span", "Timing", "timeline_metrics"]


@dataclass(frozen=True, slots=True)
class Span:
    """When one instruction of one iteration ran on one worker (simulated or measured).

    `index` is the instruction's position in the worker's stream. For a send the span runs
    from posting to arrival; for a receive, from posting to completion. Measured compute spans
    (`profile=True`) also carry `memory`, the activation bytes the worker holds after the op, and
    `memory_peak`, the most it held while the op ran (see `schedcomp.runtime.memory`).
    """

    worker: Worker
    iteration: int
    index: int
    instruction: Instruction
    start: float
    end: float
    memory: float | None = None
    memory_peak: float | None = None

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Timing:
    """Time metrics of a timeline; see `timeline_metrics`.

    `busy` is each worker's compute time per iteration over the steady-state window.
    """

    makespan: float
    period: float
    bubble_ratio: float
    iteration_ends: tuple[float, ...]
    busy: Mapping[Worker, float]


def steady_window(iterations: int) -> range:
    """The iterations the period is measured over: the second half of the run (all of it for one)."""
    return range((iterations - 1) // 2 + 1, iterations) if iterations > 1 else range(1)


def period_from_ends(ends: Sequence[float], makespan: float | None = None) -> float:
    """The one period formula (see `timeline_metrics`): the mean time between iteration ends over
    `steady_window`; with one iteration, `makespan` (the end of the only one when not given)."""
    k = len(ends)
    if k <= 1:
        return ends[0] if makespan is None else makespan
    h = steady_window(k).start - 1
    return (ends[-1] - ends[h]) / (k - 1 - h)


def timeline_metrics(spans: Iterable[Span], workers: Sequence[Worker] | None = None) -> Timing:
    """Makespan, period and bubble ratio of any timeline, simulated or measured.

    - makespan: from the first start to the last end of iteration 0.
    - period: with K iterations ending at e[0..K-1] (the last end of each iteration on any
      worker) and h = (K-1)//2, period = (e[K-1] - e[h]) / (K-1-h): the mean time between
      iteration ends over the second half of the run. Skipping the first half drops the
      warm-up (iteration 0 starts on an empty pipeline; with staggered steps later ones
      overlap their neighbours), and averaging copes with a steady state that repeats over
      several iterations. With one iteration the period is the makespan.
    - bubble_ratio: 1 - compute time per iteration of all workers / (period x workers), the
      compute time averaged over the same window, so a measured timeline works too.
    `workers` defaults to those that appear in `spans`.
    """
    spans = spans if isinstance(spans, (list, tuple)) else list(spans)
    if not spans:
        raise ValidationError("the timeline is empty: a plan needs at least one instruction to time")
    if workers is None:
        workers = sorted({s.worker for s in spans})
    iterations = max(s.iteration for s in spans) + 1
    window = steady_window(iterations)
    ends = [-math.inf] * iterations
    first_start = math.inf
    busy = dict.fromkeys(workers, 0.0)
    for s in spans:
        it = s.iteration
        if s.end > ends[it]:
            ends[it] = s.end
        if it == 0 and s.start < first_start:
            first_start = s.start
        if it in window and s.instruction.is_compute and s.worker in busy:
            busy[s.worker] += s.end - s.start
    for k in range(1, iterations):  # an iteration without spans (a partial trace) ends with the one before
        ends[k] = max(ends[k], ends[k - 1])
    makespan = ends[0] - first_start
    period = period_from_ends(ends, makespan)
    busy = {w: b / len(window) for w, b in busy.items()}
    capacity = period * len(workers)
    bubble = 1.0 - sum(busy.values()) / capacity if capacity > 0 else 0.0
    return Timing(makespan, period, bubble, tuple(ends), busy)
