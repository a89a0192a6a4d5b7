"""A compute order kept as columns, its `Op` objects made only when someone reads them.

A solver's order at pp = 32, dp = 256 is 1.6 million ops. `lower` and `check` work on their fields as
numpy columns, and the CLI's compile writes the plan from those too, so making an `Op` object per op
(and reading its fields back) was seconds spent for nobody. `ColumnOps` is the `Order.ops` mapping such
a solver returns: its keys are the workers, `columns` the ops' fields, and a worker's tuple of ops is
made (once) when it is read. It is read-only, as an order is by contract; a copy or a pickle is a dict.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from itertools import repeat
from typing import TYPE_CHECKING, Any

import numpy as np

from schedcomp.ir import OP_SETTERS, Op, OpKind
from schedcomp.topology import Worker

if TYPE_CHECKING:
    from numpy.typing import NDArray

OP_CODES = (OpKind.F, OpKind.B, OpKind.W, OpKind.BW)
"""An op's kind by code (0..3), as the validator numbers op ids (`slot * 4 + code`)."""
_KIND_OBJECTS = np.array(OP_CODES, dtype=object)


@dataclass(frozen=True, eq=False)
class OpColumns:
    """Every worker's ops in a row (`workers` order; worker x's end where `ends[x]` says): per op its kind's
    code (of `OP_CODES`), pipeline, micro-batch and stage."""

    workers: tuple[Worker, ...]
    ends: NDArray[np.int64]
    code: NDArray[np.int64]
    pipeline: NDArray[np.int64]
    microbatch: NDArray[np.int64]
    stage: NDArray[np.int64]

    def starts(self) -> NDArray[np.int64]:
        return self.ends - np.diff(self.ends, prepend=0)

    def make(self, start: int, end: int) -> list[Op]:
        """The `Op` objects of ops `start`..`end` (their fields right by construction: set in C, `map`)."""
        made = list(map(object.__new__, repeat(Op, end - start)))
        fields = (_KIND_OBJECTS[self.code[start:end]], self.pipeline[start:end], self.microbatch[start:end],
                  self.stage[start:end])
        for setter, values in zip(OP_SETTERS, fields, strict=True):
            deque(map(setter, made, values.tolist()), maxlen=0)
        return made


class ColumnOps(Mapping[Worker, tuple[Op, ...]]):
    """`{worker: ops}` over `OpColumns`, each worker's tuple made when first read (see the module docstring)."""

    def __init__(self, columns: OpColumns) -> None:
        self.columns = columns
        self._number = {w: x for x, w in enumerate(columns.workers)}
        self._made: dict[Worker, tuple[Op, ...]] = {}

    def __getitem__(self, worker: Worker) -> tuple[Op, ...]:
        ops = self._made.get(worker)
        if ops is None:
            x = self._number[worker]
            start = int(self.columns.ends[x - 1]) if x else 0
            ops = self._made[worker] = tuple(self.columns.make(start, int(self.columns.ends[x])))
        return ops

    def __iter__(self) -> Iterator[Worker]:
        return iter(self._number)

    def __len__(self) -> int:
        return len(self._number)

    def __contains__(self, worker: object) -> bool:
        return worker in self._number

    def __repr__(self) -> str:
        return repr(dict(self))

    def __reduce__(self) -> tuple[Any, ...]:
        return (dict, (dict(self),))


def op_columns_of(ops: object) -> OpColumns | None:
    """The columns of an order's ops, when a solver made them as columns."""
    return ops.columns if type(ops) is ColumnOps else None
