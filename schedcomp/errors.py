"""Errors raised by schedcomp. Each message says what is wrong and how to fix it.

The CLI turns any `SchedcompError` into one line on stderr and exit status 2.
"""

from __future__ import annotations


class SchedcompError(Exception):
    """Base class: a problem with the user's input or a plan, reported in one line."""


class TopologyError(SchedcompError):
    """The pipeline configuration or failure set is impossible."""


class CostModelError(SchedcompError):
    """A cost model is malformed."""


class ScheduleError(SchedcompError):
    """A schedule family cannot build the requested schedule."""


class PlanFormatError(SchedcompError):
    """A serialised plan (JSON, text, CSV) cannot be read."""


class ValidationError(SchedcompError):
    """A plan breaks the semantics the runtime relies on.

    `worker` and `index` locate the bad instruction when there is one; `grid` is a
    step x worker picture of the streams with the bad cell marked, for humans.
    """

    def __init__(self, message: str, worker: object = None, index: int | None = None, grid: str = "") -> None:
        super().__init__(message)
        self.worker = worker
        self.index = index
        self.grid = grid


class MemoryLimitError(SchedcompError):
    """No schedule can keep activation memory within the limit."""


class RecoveryError(SchedcompError):
    """Training cannot continue by re-routing (e.g. every replica of a stage is gone)."""


class RuntimeSetupError(SchedcompError):
    """The runtime cannot run a plan with the given model, data or processes."""
