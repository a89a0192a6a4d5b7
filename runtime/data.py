"""Micro-batches, addressed by (home pipeline, index), and the tensor-or-tuple values stages pass.

Micro-batch m of home pipeline p is chunk `p * microbatches + m` of the global batch, cut along
dimension 0 into `dp * microbatches` equal chunks. Whoever runs the first or last stage of that
micro-batch (its home pipeline or a peer it was re-routed to) loads the same samples and targets.

A plan with re-cut micro-batches (`schedcomp.cut`) cuts a re-cut pipeline's share (its M chunks together;
with shares, re-formed pipelines', another number of them) into pieces of unequal sizes instead: piece m
holds the rows `piece_rows` gives, rounded to whole samples, and its loss is weighted by its rows over
the global batch's (`Iteration.scale_of`).
The ledger of resilient jobs counts, per regular micro-batch of the global batch, the rows of it each piece
holds (`held_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from schedcomp.cut import Cut
from schedcomp.errors import RuntimeSetupError

Tensors = Tensor | tuple[Tensor, ...]


def as_tuple(value: Tensors) -> tuple[Tensor, ...]:
    """A stage's inputs or outputs as a tuple (a single tensor becomes a 1-tuple)."""
    if isinstance(value, Tensor):
        return (value,)
    if isinstance(value, (tuple, list)) and all(isinstance(t, Tensor) for t in value):
        return tuple(value)
    raise RuntimeSetupError(
        f"stage values must be a tensor or a tuple of tensors, got {type(value).__name__}: return tensors from forward"
    )


def to_device(value: Tensors, device: torch.device) -> Tensors:
    """`value` (a tensor or a tuple of them) on `device`."""
    if isinstance(value, Tensor):
        return value.to(device)
    return tuple(v.to(device) for v in as_tuple(value))


def chunk_index(pipeline: int, microbatch: int, microbatches: int) -> int:
    """Position of micro-batch (home `pipeline`, `microbatch`) among the global batch's chunks."""
    return pipeline * microbatches + microbatch


def rows_per_chunk(rows: int, chunks: int) -> int:
    """Rows per regular micro-batch of a batch of `rows` cut into `chunks` (dp x microbatches); one line refuses a
    batch that does not cut evenly."""
    if rows == 0 or rows % chunks:
        raise RuntimeSetupError(
            f"a batch of {rows} rows cannot be cut into {chunks} equal micro-batches (dp x microbatches): "
            f"use a batch size that is a multiple of {chunks}"
        )
    return rows // chunks


def micro_batch(value: Tensors, index: int, count: int) -> Tensors:
    """Chunk `index` of `count` equal chunks of `value` (a tensor or a tuple of them) along dim 0."""
    if isinstance(value, Tensor):
        rows = rows_per_chunk(value.shape[0] if value.dim() else 0, count)
        return value[index * rows : (index + 1) * rows]
    return tuple(micro_batch(v, index, count) for v in as_tuple(value))


def batch_rows(value: Tensors) -> int:
    """Rows (samples) of a global batch: the leading dimension of its first tensor."""
    first = as_tuple(value)[0]
    return int(first.shape[0]) if first.dim() else 0


def piece_rows(cut: Cut, pipeline: int, microbatch: int, microbatches: int, chunks: int, rows: int) -> tuple[int, int]:
    """The rows [start, stop) of the global batch (`rows` of them, cut into `chunks` = dp x `microbatches`
    regular micro-batches) that micro-batch `microbatch` of `pipeline` covers, under `cut` (re-cut pieces, or
    whole micro-batches; with shares, pipelines of re-formed plans run other shares than `microbatches`):
    `Cut.global_rows`, of which every share `microbatches` is the special case."""
    per = rows_per_chunk(rows, chunks)
    start, stop = cut.global_rows(pipeline, microbatch, chunks // microbatches, microbatches, per)
    if stop <= start:
        what = _no_sample(cut, pipeline, microbatch, per)
        raise RuntimeSetupError(f"micro-batch {microbatch} of pipeline {pipeline} {what}: use a larger batch with this "
                                "re-cut plan")
    return start, stop


def _no_sample(cut: Cut, pipeline: int, microbatch: int, per: int) -> str:
    return (f"is a piece of {cut.size(pipeline, microbatch):.3g} micro-batches, no whole sample of the {per} per "
            "micro-batch")


@dataclass
class PieceRows:
    """The re-cut plans a job may switch to (their cuts: `runtime.fault.policies.recuts_of`), checked against
    each size of global batch the first time it comes: every piece must hold a whole sample (`piece_rows`),
    refused at the job's first iteration rather than when a failure switches to the plan."""

    cuts: list[Cut]
    checked: set[int] = field(default_factory=set)
    per: int | None = None  # rows per regular micro-batch of the last batch checked

    def add(self, cut: Cut) -> None:
        """A re-cut plan the job now runs (a better plan it switched to): every size is checked again with it."""
        self.cuts.append(cut)
        self.checked.clear()

    def check(self, batch: tuple[Tensors, Tensors], dp: int, microbatches: int) -> None:
        """Refuse (one line) a batch too small for a piece of one of the cuts (of a job of `dp` pipelines of
        `microbatches` regular micro-batches)."""
        chunks = dp * microbatches
        rows = batch_rows(batch[0]) if isinstance(batch, (tuple, list)) and batch else 0
        if rows == 0 or rows % chunks:  # refused by the iteration itself, as always
            return
        self.per = rows // chunks
        if rows not in self.checked:
            for cut in self.cuts:
                problem = self.piece_problem(cut, dp, microbatches)
                if problem:  # (shares: only re-formed plans have them)
                    kind, without = ("re-formed", "reform") if cut.shares else ("re-cut", "--recut")
                    raise RuntimeSetupError(f"a {kind} plan this job may switch to has a piece that {problem} (a "
                                            f"batch of {rows} rows): use a larger batch, or plans without {without}")
            self.checked.add(rows)

    def piece_problem(self, cut: Cut, dp: int, microbatches: int) -> str | None:
        """What piece of `cut` holds no whole sample at the job's batch size (the last one checked), or None
        (also before any batch: nothing to check against yet). The one test, at the first iteration and when a
        plan comes later (a plan function's, a better plan)."""
        return empty_piece(cut, self.per, dp, microbatches) if self.per is not None else None


def empty_piece(cut: Cut, per: int, dp: int, microbatches: int) -> str | None:
    """What piece of `cut` (of a job of `dp` pipelines of `microbatches` each) holds no whole sample of `per` rows
    per regular micro-batch, or None. The rows are the ones LOAD takes (`Cut.global_rows`): with shares each
    boundary is rounded at its place in the global batch, not within its pipeline's share."""
    for p, b in cut.bounds:
        for m in range(len(b) - 1):
            start, stop = cut.global_rows(p, m, dp, microbatches, per)
            if stop <= start:
                return _no_sample(cut, p, m, per)
    return None


def held_rows(cut: Cut, pipeline: int, microbatch: int, dp: int, microbatches: int, per: int
              ) -> list[tuple[int, int]]:
    """What micro-batch `microbatch` of `pipeline` holds of each regular micro-batch of the global batch (`dp` x
    `microbatches` of `per` rows each), under `cut`: (its chunk index, rows), for every one it overlaps. The
    pieces of all pipelines cover the global batch once (`Cut.global_rows`; with shares a piece may overlap
    another pipeline's regular micro-batches), so each regular micro-batch's rows over them sum to exactly
    `per`."""
    return overlaps(*cut.global_rows(pipeline, microbatch, dp, microbatches, per), per)


def overlaps(start: int, stop: int, per: int) -> list[tuple[int, int]]:
    """What rows [start, stop) of the global batch hold of each regular micro-batch of `per` rows: (its chunk
    index, rows), for every one they overlap."""
    return [(c, min(stop, (c + 1) * per) - max(start, c * per)) for c in range(start // per, (stop + per - 1) // per)]


def take_rows(value: Tensors, start: int, stop: int) -> Tensors:
    """Rows [start, stop) of `value` (a tensor or a tuple of them) along dim 0."""
    if isinstance(value, Tensor):
        return value[start:stop]
    return tuple(v[start:stop] for v in as_tuple(value))
