"""The cost of a global gradient check (clipping by the norm over every stage, the non-finite skip).

The runtime (`schedcomp.runtime.training`) reduces each stage's squared gradient norm and a
non-finite flag over every worker at STEP, in one small all-reduce. `simulate(plan,
grad_check=GradCheckCost(...))` times it two ways:

- "barrier": every worker's STEP waits until all workers have reached theirs, plus `reduce`
  (the all-reduce), then steps. The staggered optimizer is gone for that instant.
- "post" (Zero Bubble's post-validation): STEP is not delayed; a worker's next iteration starts
  only once every worker has launched its share of this one, plus `reduce`; a worker that must
  undo and redo its step then pays `redo` x (`undo` + its STEP time), `redo` being the fraction
  of iterations in which that happens (how often clipping is due while its own stage's norm is
  under the limit). `undo` (restoring the pre-step snapshot) defaults to the STEP time.

Pure data, no torch: the compiler side stays importable without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from schedcomp.errors import ValidationError

POST, BARRIER = "post", "barrier"


@dataclass(frozen=True)
class GradCheckCost:
    """How the simulator times the global gradient check (see the module docstring)."""

    mode: str = POST
    reduce: float = 0.0  # the all-reduce of [squared norm, non-finite] over every worker
    redo: float = 0.0  # post: fraction of iterations a worker undoes and redoes its step
    undo: float | None = None  # post: restoring the snapshot (default: the worker's STEP time)

    def __post_init__(self) -> None:
        if self.mode not in (POST, BARRIER):
            raise ValidationError(f"grad_check mode must be {POST!r} or {BARRIER!r}, got {self.mode!r}")
        for name in ("reduce", "redo", "undo"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0):
                raise ValidationError(f"grad_check {name} must be a finite number >= 0, got {value!r}")
        if self.redo > 1:
            raise ValidationError(f"grad_check redo is a fraction of iterations, at most 1, got {self.redo!r}")

    def redo_time(self, step: float) -> float:
        """A worker's expected undo + redo time per iteration, for its STEP time `step`."""
        return self.redo * ((self.undo if self.undo is not None else step) + step)
