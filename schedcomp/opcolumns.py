"""A compute order kept as columns, its `Op` objects made only when someone reads them.

A solver's order at pp = 32, dp = 256 is 1.6 million ops. `lower` and `check` work on their fields as
numpy columns, and the CLI's compile writes the plan from those too, so making an `Op` object per op
(and reading its fields back) was seconds spent for nobody. `ColumnOps` is the `Order.ops` mapping such
a solver returns: its keys are the workers, `columns` the ops' fields, and a worker's tuple of ops is
made (once) when it is read. It is read-only, as an order is by contract; a copy or a pickle is a dict.
`LazyMapping` is what it shares with the plan's lazy streams (`schedcomp.streamcolumns`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import ItemsView, Iterable, Iterator, Mapping, ValuesView
from dataclasses import dataclass
from itertools import repeat
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from schedcomp.gcpause import paused_gc
from schedcomp.ir import OP_SETTERS, Op, OpKind
from schedcomp.topology import Worker

if TYPE_CHECKING:
    from numpy.typing import NDArray

OP_CODES = (OpKind.F, OpKind.B, OpKind.W, OpKind.BW)
"""An op's kind by code (0..3): the validator's op ids (`slot * 4 + code`) and every column of kinds."""
_KIND_OBJECTS = np.array(OP_CODES, dtype=object)

V = TypeVar("V")


class LazyMapping(Mapping[Worker, V]):
    """A read-only `{worker: value}` whose values are made when read (`_make`, once each) or all at once
    (`_make_all`, for `items` and `values`, whose views are then a dict's); a copy or a pickle is a dict."""

    def __init__(self, workers: Iterable[Worker]) -> None:
        self._number = {w: x for x, w in enumerate(workers)}  # each key's place, in the keys' order
        self._made: dict[Worker, V] = {}
        self._complete = False  # `_made` holds every value, in the keys' order

    def _make(self, worker: Worker) -> V:
        raise NotImplementedError

    def _make_all(self) -> dict[Worker, V]:
        """Every value, in the keys' order (what one call can do faster than a call per key)."""
        return {w: self[w] for w in self._number}

    def __getitem__(self, worker: Worker) -> V:
        value = self._made.get(worker)
        if value is None:
            if worker not in self._number:
                raise KeyError(worker)
            value = self._made[worker] = self._make(worker)
        return value

    def __iter__(self) -> Iterator[Worker]:
        return iter(self._number)

    def __len__(self) -> int:
        return len(self._number)

    def __contains__(self, worker: object) -> bool:
        return worker in self._number

    def items(self) -> ItemsView[Worker, V]:
        return self._all().items()

    def values(self) -> ValuesView[V]:
        return self._all().values()

    def __repr__(self) -> str:
        return repr(self._all())

    def __reduce__(self) -> tuple[Any, ...]:
        return (dict, (dict(self._all()),))

    def _all(self) -> dict[Worker, V]:
        if not self._complete:  # (also where every value was read, in another order)
            self._made = {w: self[w] for w in self._number} if self._made else self._make_all()
            self._complete = True
        return self._made


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

    def make(self, start: int, end: int) -> list[Op]:
        """The `Op` objects of ops `start`..`end` (their fields right by construction: set in C, `map`)."""
        with paused_gc():  # (many small acyclic objects: see `schedcomp.gcpause`)
            made = list(map(object.__new__, repeat(Op, end - start)))
            fields = (_KIND_OBJECTS[self.code[start:end]], self.pipeline[start:end], self.microbatch[start:end],
                      self.stage[start:end])
            for setter, values in zip(OP_SETTERS, fields, strict=True):
                deque(map(setter, made, values.tolist()), maxlen=0)
        return made


def span(ends: NDArray[np.int64], x: int) -> tuple[int, int]:
    """Where worker x's rows start and end, of rows laid worker after worker that end where `ends` says."""
    return (int(ends[x - 1]) if x else 0), int(ends[x])


class ColumnOps(LazyMapping[tuple[Op, ...]]):
    """`{worker: ops}` over `OpColumns`, each worker's tuple made when first read (see the module docstring)."""

    def __init__(self, columns: OpColumns) -> None:
        super().__init__(columns.workers)
        self.columns = columns

    def _make(self, worker: Worker) -> tuple[Op, ...]:
        return tuple(self.columns.make(*span(self.columns.ends, self._number[worker])))


def op_columns_of(ops: object) -> OpColumns | None:
    """The columns of an order's ops, when a solver made them as columns."""
    return ops.columns if type(ops) is ColumnOps else None
