"""What `PipelineTrainer.step` returns: the iteration's loss, reduced in the background, and its update's outcome."""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
from torch import Tensor

from schedcomp.runtime.training import StepOutcome


class Loss:
    """The mean loss of one iteration over the whole global batch, reduced in the background.

    `step` starts an asynchronous all-reduce of the last stages' (already scaled) losses and
    returns at once, so no rank waits for the others and the optimizer stays staggered. Reading
    the value (`float(loss)`, `loss.item()`) waits until every rank has finished that iteration:
    read it a step or more later (or at the end) to keep the pipeline full.
    """

    def __init__(self, value: Tensor, work: dist.Work | None,
                 outcome: Callable[[], StepOutcome | None] | None = None) -> None:
        self._value, self._work, self._outcome = value, work, outcome

    @property
    def outcome(self) -> StepOutcome | None:
        """What the global check decided for this iteration's update (None without max_grad_norm and
        skip_nonfinite); reading it validates the update if it is still pending (`training`)."""
        return self._outcome() if self._outcome is not None else None

    @property
    def skipped(self) -> bool:
        """The update was skipped on every stage (skip_nonfinite and a gradient somewhere not finite)."""
        return self.outcome is not None and self.outcome.skipped

    @property
    def grad_norm(self) -> float | None:
        """The gradient norm over every stage (None without max_grad_norm and skip_nonfinite)."""
        return self.outcome.grad_norm if self.outcome is not None else None

    def item(self) -> float:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return float(self._value.item())

    def __float__(self) -> float:
        return self.item()

    def __repr__(self) -> str:
        return f"Loss({self.item():.6g})" if self._work is None else "Loss(<pending>)"
