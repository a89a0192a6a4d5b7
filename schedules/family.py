"""What a schedule family is: a named builder of per-worker compute orders for one pipeline."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from schedcomp.errors import ScheduleError
from schedcomp.ir import Op, OpKind

StageOrders = tuple[tuple[Op, ...], ...]
"""The compute order of each worker of pipeline 0: `orders[s]` is what the worker at place `s` runs, in
order (one stage per worker: stage `s`; with virtual stages: its chunks, each op naming its own)."""


@dataclass(frozen=True)
class Family:
    """A fault-free schedule family.

    `build(pp, microbatches)` returns the compute order of each stage of pipeline 0 (only
    compute ops; lowering adds the communication). `min_microbatches(pp)` is the fewest
    micro-batches the family's shape is defined for. A family with virtual stages names its
    `placement` (`schedcomp.topology.LOOP` or `V`) and its `build` takes the chunks per worker as a
    third argument; `default_chunks` is what it runs when none are asked for.
    """

    name: str
    build: Callable[..., StageOrders]
    min_microbatches: Callable[[int], int]
    description: str
    placement: str = ""  # "": one stage per worker
    default_chunks: int = 1

    def orders(self, pp: int, microbatches: int, chunks: int) -> StageOrders:
        """The per-worker orders with `chunks` stages per worker (`ScheduleError` if the family has no such shape)."""
        if not self.placement:
            if chunks != 1:
                raise ScheduleError(f"{self.name} runs one stage per worker, not chunks={chunks}: use "
                                    "interleaved-1f1b or zb-v for virtual stages")
            return self.build(pp, microbatches)
        return self.build(pp, microbatches, chunks)


def op(kind: OpKind, microbatch: int, stage: int) -> Op:
    """An op of pipeline 0 (fault_free_order renames it for the other pipelines)."""
    return Op(kind, 0, microbatch, stage)
