"""An `Iteration` that only counts into the ledger (no stage, no communication), for the ledger's unit tests."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from schedcomp.runtime.iteration import Iteration
from schedcomp.topology import Worker


def ledger_of(plan: object, dp: int, microbatches: int, per: int) -> Iteration:
    """An iteration that only counts, on a batch of `per` rows per regular micro-batch."""
    return Iteration(plan=plan, worker=Worker(0, 0), stage=SimpleNamespace(index=0), comm=None,
                     inputs=torch.zeros(dp * microbatches * per, 1), targets=None, boundaries=(),
                     ledger=torch.zeros(dp * microbatches, dtype=torch.float64))
