"""For the ledger's unit tests: an `Iteration` that only counts into the ledger (no stage, no communication), and
the rows each regular micro-batch gets over the pieces of a cut."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from schedcomp.cut import Cut
from schedcomp.runtime.data import held_rows
from schedcomp.runtime.iteration import Iteration
from schedcomp.topology import Worker


def ledger_of(plan: object, dp: int, microbatches: int, per: int) -> Iteration:
    """An iteration that only counts, on a batch of `per` rows per regular micro-batch."""
    return Iteration(plan=plan, worker=Worker(0, 0), stage=SimpleNamespace(index=0), comm=None,
                     inputs=torch.zeros(dp * microbatches * per, 1), targets=None, boundaries=(),
                     ledger=torch.zeros(dp * microbatches, dtype=torch.float64))


def rows_over_pieces(cut: Cut, dp: int, microbatches: int, per: int) -> list[int]:
    """Per regular micro-batch of the global batch, the rows of it the pieces of every pipeline hold together
    (`data.held_rows`: each piece holds from 1 to `per` of each it overlaps)."""
    rows = [0] * (dp * microbatches)
    for p in range(dp):
        for m in range(cut.count(p, microbatches)):
            for index, held in held_rows(cut, p, m, dp, microbatches, per):
                assert 0 < held <= per
                rows[index] += held
    return rows
