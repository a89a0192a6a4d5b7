"""Running sums per owner (a worker) over values laid owner after owner: each owner's from 0.0, added left to
right, so every sum is the float a loop over that owner's values gives (`np.add.accumulate` adds in order,
never pairwise). The validator's memory test (`schedcomp.check_columns`) and the solvers' memory peaks
(`solvers.timing.worker_peaks`) read them for all workers at once."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from numpy.typing import NDArray


def running_sums(values: NDArray[np.float64], owner: NDArray[np.int64], n_owners: int) -> NDArray[np.float64]:
    """Per value, the sum of its owner's values up to it. `owner`: each value's owner (non-decreasing, below
    `n_owners`: each owner's values side by side, in order)."""
    counts = np.bincount(owner, minlength=n_owners)
    position = np.arange(len(owner)) - (np.cumsum(counts) - counts)[owner]  # (where it sits in its owner's row)
    # All owners at once as the rows of a zero-padded table (padding adds nothing) where that table is not much
    # larger than the values; else owner by owner.
    width = int(position.max()) + 1 if len(position) else 1
    if n_owners * width <= 4 * len(position) + 1024:
        table = np.zeros((n_owners, width))
        table[owner, position] = values
        return np.add.accumulate(table, axis=1)[owner, position]  # type: ignore[no-any-return]
    starts = np.flatnonzero(np.diff(owner, prepend=-1))
    return np.concatenate([np.add.accumulate(part) for part in np.split(values, starts[1:])]) if len(values) \
        else values
