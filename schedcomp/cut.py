"""Re-cut micro-batches: how a pipeline's share of the global batch is cut into micro-batches.

By default pipeline p's share is cut into the plan's M equal micro-batches (`runtime.data.micro_batch`).
A re-cut pipeline (`schedcomp compile --recut`) is cut instead into U pieces of unequal sizes (any U),
so that a failed worker's work is split to match what each live peer has room for (samples are
interchangeable within a global batch). A `Cut` gives, per re-cut pipeline, the U + 1 boundaries of its
pieces in regular micro-batches: `0 = b_0 < b_1 < ... < b_U = M`. Piece i is that pipeline's
"micro-batch" i in every op (`F3.1` is piece 3 of pipeline 1), holds the fraction `b_{i+1} - b_i` of a
regular micro-batch, and covers the samples from `b_i` to `b_{i+1}` of the pipeline's share (rows
rounded to whole samples at run time: `rows`). Strictly increasing boundaries from 0 to M are exactly
"the pieces cover the pipeline's share once, none empty" (`check` proves it).

What a size means elsewhere: an op of a piece costs its stage's time times the size (compute is linear
in samples) and holds its activation times the size; a transfer keeps the p2p latency; the loss of a
piece is weighted by its samples over the global batch's, so gradients are exact. Instructions keep
their one meaning (`schedcomp.semantics`): F of a piece is a forward over its samples. Dense numberings
(slot ids, transfer ids) count `width` micro-batches per pipeline, the most any pipeline has; a slot
past its pipeline's count is absent (no op runs it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from schedcomp.errors import PlanFormatError
from schedcomp.topology import by_pipeline

_TOL = 1e-9


@dataclass(frozen=True)
class Cut:
    """Per re-cut pipeline, its micro-batches' boundaries (see the module docstring); empty = every
    micro-batch whole, the default."""

    bounds: tuple[tuple[int, tuple[float, ...]], ...] = ()
    shares: bool = False
    """Whether a pipeline's last boundary is its share of the global batch (any positive number, the shares
    of all pipelines totalling dp x M: re-formed pipelines, `schedcomp.partitions`) rather than M. False
    without bounds: every share is then M either way, and the JSON (which writes no empty cut) reads it so."""

    _by_pipeline: dict[int, tuple[float, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.bounds and self.shares:  # one form for "no pipeline cut", so round trips are exact
            object.__setattr__(self, "shares", False)
        seen: set[int] = set()
        for entry in self.bounds:
            if not (isinstance(entry, tuple) and len(entry) == 2):
                raise PlanFormatError(f"a cut entry is (pipeline, boundaries), got {entry!r}")
            p, b = entry
            if isinstance(p, bool) or not isinstance(p, int) or p < 0 or p in seen:
                raise PlanFormatError(f"a cut names each pipeline once by a non-negative integer, got {p!r}")
            seen.add(p)
            problem = _bounds_problem(b, self.shares)
            if problem:
                raise PlanFormatError(f"the cut of pipeline {p} {problem}")
        # (read per op by `size`, `rows` and `count`: built once, not per call, as every pipeline may be cut)
        object.__setattr__(self, "_by_pipeline", dict(self.bounds))

    @property
    def summary(self) -> str:
        """The cut in a few words, for messages (a hostile one may have millions of pieces)."""
        if not self.bounds:
            return "none"
        pipelines = ", ".join(str(p) for p, _ in self.bounds)
        return f"{sum(len(b) - 1 for _, b in self.bounds)} pieces over pipelines {pipelines}"

    @classmethod
    def of(cls, bounds: dict[int, Iterable[float]], shares: bool = False) -> Cut:
        return cls(tuple(sorted((p, tuple(float(x) for x in b)) for p, b in bounds.items())), shares)

    def __bool__(self) -> bool:
        return bool(self.bounds)

    @property
    def pipelines(self) -> Mapping[int, tuple[float, ...]]:
        return MappingProxyType(self._by_pipeline)

    def count(self, pipeline: int, microbatches: int) -> int:
        """How many micro-batches (pieces) `pipeline` runs: `microbatches` when it is not re-cut."""
        b = self._by_pipeline.get(pipeline)  # (not `pipelines`: a new proxy per call)
        return microbatches if b is None else len(b) - 1

    def width(self, microbatches: int) -> int:
        """The most micro-batches any pipeline runs: the stride of dense numberings (slot ids)."""
        return max([microbatches, *(len(b) - 1 for _, b in self.bounds)])

    def total(self, dp: int, microbatches: int) -> int:
        """Micro-batches (pieces) all `dp` pipelines run together."""
        return dp * microbatches + sum(len(b) - 1 - microbatches for p, b in self.bounds if p < dp)

    def sizes(self, pipeline: int, microbatches: int) -> tuple[float, ...]:
        """The size of each of `pipeline`'s micro-batches, in regular micro-batches (1.0 when not re-cut)."""
        b = self._by_pipeline.get(pipeline)
        if b is None:
            return (1.0,) * microbatches
        return tuple(b[m + 1] - b[m] for m in range(len(b) - 1))

    def size(self, pipeline: int, microbatch: int) -> float:
        b = self._by_pipeline.get(pipeline)
        return 1.0 if b is None else b[microbatch + 1] - b[microbatch]

    def rows(self, pipeline: int, microbatch: int, rows_per_microbatch: int) -> tuple[int, int]:
        """The rows [start, stop) of micro-batch `microbatch` within its pipeline's share, whose regular
        micro-batches hold `rows_per_microbatch` rows each. Adjacent pieces round the boundary they share
        the same way, so the rows are covered exactly once."""
        b = self._by_pipeline.get(pipeline)
        if b is None:
            return microbatch * rows_per_microbatch, (microbatch + 1) * rows_per_microbatch
        return round(b[microbatch] * rows_per_microbatch), round(b[microbatch + 1] * rows_per_microbatch)

    def problem(self, dp: int, microbatches: int) -> str | None:
        """Why this cut does not fit a job of `dp` pipelines of `microbatches` each, or None. With `shares`
        a cut pipeline's last boundary is its share of the global batch, and the shares (`microbatches` for
        a pipeline not cut) must total `dp * microbatches` instead."""
        shares = self.shares
        for p, b in self.bounds:
            if not 0 <= p < dp:
                return f"the cut names pipeline {p}, outside pipelines 0..{dp - 1}"
            if not shares and b[-1] != microbatches:
                return (f"the cut of pipeline {p} covers {b[-1]:g} micro-batches but the plan has {microbatches}: "
                        "its pieces must cover the pipeline's share exactly once")
        if shares:
            total = math.fsum(self.share(p, microbatches) for p in range(dp))
            if abs(total - dp * microbatches) > _TOL * dp * microbatches:
                return (f"the pipelines' shares total {total:g} micro-batches but the global batch has "
                        f"{dp * microbatches} ({dp} x {microbatches}): the shares must cover it exactly once")
        return None

    def share(self, pipeline: int, microbatches: int) -> float:
        """How much of the global batch `pipeline` runs, in regular micro-batches: its last boundary, or
        `microbatches` when it is not cut."""
        b = self._by_pipeline.get(pipeline)
        return float(microbatches) if b is None else b[-1]

    def global_rows(self, pipeline: int, microbatch: int, dp: int, microbatches: int,
                    rows_per_microbatch: int) -> tuple[int, int]:
        """The rows [start, stop) of the global batch (`dp * microbatches` regular micro-batches of
        `rows_per_microbatch` rows) that micro-batch `microbatch` of `pipeline` covers.

        Without shares this is `pipeline * microbatches * r + rows(...)`, the mapping of whole shares. With
        them every boundary is rounded once, at its place in the global batch: piece i of pipeline p covers
        `round((C_p + b_i) r)` up to `round((C_p + b_{i+1}) r)`, C_p the sum of the shares before p (added in
        pipeline order, so p's last boundary is the same float as p+1's first), the last piece of the last
        pipeline up to the batch's end. The boundaries never decrease, so every row is covered once; a piece
        may still get none when it is smaller than a row (`data.empty_piece` refuses such a batch)."""
        r = rows_per_microbatch
        if not self.shares:
            start, stop = self.rows(pipeline, microbatch, r)
            return pipeline * microbatches * r + start, pipeline * microbatches * r + stop
        before = 0.0
        for p in range(pipeline):
            before += self.share(p, microbatches)
        b = self._by_pipeline.get(pipeline)
        lo, hi = (float(microbatch), float(microbatch + 1)) if b is None else (b[microbatch], b[microbatch + 1])
        last = pipeline == dp - 1 and microbatch == self.count(pipeline, microbatches) - 1
        return round((before + lo) * r), dp * microbatches * r if last else round((before + hi) * r)

    def to_json(self) -> dict[str, list[float]]:
        return {str(p): list(b) for p, b in self.bounds}

    @classmethod
    def from_json(cls, data: object, shares: bool = False) -> Cut:
        if not isinstance(data, dict):
            raise PlanFormatError("'cut' must map pipelines (\"3\") to lists of micro-batch boundaries")
        out: dict[int, tuple[float, ...]] = {}
        for p, b in by_pipeline(data, "'cut'").items():
            if not isinstance(b, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in b):
                raise PlanFormatError(f"the cut of pipeline {p} must be a list of numbers")
            out[p] = tuple(float(x) for x in b)
        return cls.of(out, shares)


NO_CUT = Cut()


def _bounds_problem(b: object, shares: bool) -> str | None:
    if not isinstance(b, tuple) or len(b) < 2 or not all(isinstance(x, float) for x in b):
        return "must be a tuple of at least two floats"
    if not all(math.isfinite(x) for x in b):
        return "has a boundary that is not finite"
    if b[0] != 0.0 or not (b[-1] > 0 if shares else b[-1] >= 1 and b[-1] == int(b[-1])):
        return (f"must run from 0 to the plan's micro-batch count (or, with re-formed pipelines, the pipeline's "
                f"share; it runs from {b[0]:g} to {b[-1]:g}): the pieces must cover the share exactly once")
    for m in range(len(b) - 1):
        if not b[m + 1] > b[m] + _TOL:
            return (f"has piece {m} of size {b[m + 1] - b[m]:g}: boundaries must increase, so each "
                    "piece holds samples and none overlaps another")
    return None
