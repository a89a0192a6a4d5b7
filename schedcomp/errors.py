"""Errors raised by schedcomp. Each message says what is wrong and how to fix it.

The CLI turns any `SchedcompError` into one line on stderr and exit status 2.
`SchedcompError` is a `ValueError` (bad input is a bad value), so `except ValueError` written for
plain Python also catches ours; an argument of the wrong type raises `SchedcompTypeError`, which is
both a `SchedcompError` and a `TypeError`.
"""

from __future__ import annotations


class SchedcompError(ValueError):
    """Base class: a problem with the user's input or a plan, reported in one line."""

    def __init__(self, *args: object) -> None:
        # One line whatever the input quoted in it holds (a key with a newline, a U+2028).
        if len(args) == 1 and isinstance(args[0], str) and len(args[0].splitlines()) > 1:
            args = (" ".join(args[0].splitlines()),)
        super().__init__(*args)


class SchedcompTypeError(SchedcompError, TypeError):
    """An argument of the wrong type (e.g. `failed="1:1"` where a list of workers is due)."""


class LimitError(SchedcompError):
    """A job or file beyond a safety limit (workers, micro-batches, iterations, file size).

    The message names the limit and the environment variable that raises it."""


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
