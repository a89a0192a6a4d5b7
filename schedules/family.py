"""What a schedule family is: a named builder of per-stage compute orders for one pipeline."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from schedcomp.ir import Op, OpKind

StageOrders = tuple[tuple[Op, ...], ...]
"""The compute order of each stage of pipeline 0: `orders[s]` is what stage `s` runs, in order."""


@dataclass(frozen=True)
class Family:
    """A fault-free schedule family.

    `build(pp, microbatches)` returns the compute order of each stage of pipeline 0 (only
    compute ops; lowering adds the communication). `min_microbatches(pp)` is the fewest
    micro-batches the family's shape is defined for.
    """

    name: str
    build: Callable[[int, int], StageOrders]
    min_microbatches: Callable[[int], int]
    description: str


def op(kind: OpKind, microbatch: int, stage: int) -> Op:
    """An op of pipeline 0 (fault_free_order renames it for the other pipelines)."""
    return Op(kind, 0, microbatch, stage)
