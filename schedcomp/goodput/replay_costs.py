"""Logging-based recovery's cost terms (SWIFT, `runtime.fault.swift`): what logging adds to each iteration,
and how long replaying one iteration of a lost stage takes.

Step-time overhead, in the order given precedence:

1. measured: `LoggingCosts(overhead=f)`, e.g. from `python bench/bench_logging.py --overhead`
   (milliseconds per iteration divided by the step time) on the job's own hardware;
2. modelled: `LoggingCosts(boundary_bytes=b, copy_bytes_per_s=w)`. Each worker logs what it sends
   across its stage boundaries: a middle stage sends one activation forward and one gradient back
   per micro-batch of its pipeline, each `b` bytes, and the runtime copies them to host memory
   after the iteration, not overlapped with compute (`BoundaryLog.add`), so the busiest worker
   spends 2 m b / w seconds more per iteration of T seconds: overhead 2 m b / (w T);
3. neither: `ASSUMED_OVERHEAD`, 2 %.

Replay: one iteration of a stage replayed alone takes its compute share (every micro-batch's F, B
and W, and its optimizer step, from the cost model) divided by `replay_speed`; the slowest stage
is taken, as the lost stage is not known in advance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from schedcomp.costs import CostModel
from schedcomp.errors import SchedcompError

ASSUMED_OVERHEAD = 0.02
"""The overhead when neither a measurement nor boundary sizes are given: conservative for small
boundaries (`bench_logging.py --overhead` measures tens of microseconds per CPU iteration in host
memory), about right for a GPU job whose boundaries take 1 % of the step each way to copy."""

PAGEABLE_COPY_BYTES_PER_S = 10e9
"""Device-to-host copy into pageable host memory (what `tensor.to("cpu")` does) over PCIe 4 x16,
about 10 GB/s; pinned memory reaches about twice that."""


@dataclass(frozen=True)
class LoggingCosts:
    """Logging-based recovery's terms (module docstring): a measured overhead (a fraction), or one
    micro-batch's boundary tensor in bytes and the copy bandwidth; and replay's speed."""

    overhead: float | None = None
    replay_speed: float = 1.0
    boundary_bytes: float | None = None
    copy_bytes_per_s: float = PAGEABLE_COPY_BYTES_PER_S

    def __post_init__(self) -> None:
        if self.overhead is not None and self.boundary_bytes is not None:
            raise SchedcompError("give the logging overhead (measured) or the boundary bytes (modelled), not both")
        for name, value, positive in (("overhead", self.overhead, False), ("replay speed", self.replay_speed, True),
                                      ("boundary bytes", self.boundary_bytes, False),
                                      ("copy bandwidth", self.copy_bytes_per_s, True)):
            if value is None:
                continue
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and \
                (value > 0 if positive else value >= 0)
            if not ok:
                raise SchedcompError(f"logging {name} must be a finite number {'> 0' if positive else '>= 0'}, "
                                     f"got {value!r}")

    def step_overhead(self, microbatches: int, iteration_s: float) -> float:
        """The fraction logging adds to each iteration of `iteration_s` seconds (module docstring)."""
        if self.overhead is not None:
            return float(self.overhead)
        if self.boundary_bytes is not None:
            return 2.0 * microbatches * self.boundary_bytes / self.copy_bytes_per_s / iteration_s
        return ASSUMED_OVERHEAD


LOGGING = LoggingCosts()
"""Defaults: the assumed 2 % overhead; replay as fast as the original compute of the stage."""


def replay_seconds(costs: CostModel, dp: int, microbatches: int, period: float, iteration_s: float,
                   speed: float = 1.0) -> float:
    """Seconds to replay one iteration of the slowest stage alone: all `dp x microbatches` micro-batches."""
    def stage(s: int) -> float:
        step = costs.optimizer[s] if costs.optimizer else 0.0
        return dp * microbatches * (costs.forward[s] + costs.backward_input[s] + costs.backward_weight[s]) + step

    return max(stage(s) for s in range(costs.pp)) * iteration_s / period / speed
