"""A lowered plan's streams together with the columns `lower` built them from.

`lower` places every instruction of every stream as numpy columns (`schedcomp.lower_columns`) and then
makes an `Instruction` object of each row; at pp = 32, dp = 256 that is 3.6 million objects, and the
validator's scan read them back one by one (most of `check`'s time). `LoweredStreams` is the streams
mapping a lowered plan holds (a `dict`, as any plan's), which also keeps those columns, so `check` reads
the same facts as arrays (`schedcomp.check_columns`). The two cannot disagree: instructions and ops are
immutable, and any change to the mapping itself drops the columns (a plan is immutable by contract, but a
caller who edits `plan.streams` in place only loses the fast path). A copy or a pickle is a plain dict.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from schedcomp.ir import InstrKind, Instruction, Op, OpKind, instruction_text, stream_texts
from schedcomp.semantics import semantics_of
from schedcomp.topology import Worker

if TYPE_CHECKING:
    from numpy.typing import NDArray

OP_CODES = (OpKind.F, OpKind.B, OpKind.W, OpKind.BW)
"""An op's kind by code (0..3), as the validator numbers op ids (`slot * 4 + code`)."""
ROW_KINDS = np.array([InstrKind.F, InstrKind.B, InstrKind.W, InstrKind.BW, InstrKind.LOAD, InstrKind.SEND_ACT,
                      InstrKind.SEND_GRAD, InstrKind.RECV_ACT, InstrKind.RECV_GRAD], dtype=object)
"""An instruction's kind by code: 0..3 the compute ops (as `OP_CODES`), then LOAD, the sends and the receives
(activation, gradient: a tensor's low bit)."""
LOAD, SEND, RECV = 4, 5, 7


@dataclass(frozen=True, eq=False)
class StreamColumns:
    """Every live worker's stream but its tail, rows of all workers in a row (`workers` order), as columns.

    Per row: `kinds` (a code of `ROW_KINDS`), `op_of` (which op: a row of the op columns) and `peer` (a
    number in `workers`, -1 for none); `ends[x]` is where worker x's rows end. Per op: `op_code` (of
    `OP_CODES`), `op_pipeline`, `op_microbatch`, `op_stage`. Each stream then ends with `tail`."""

    workers: tuple[Worker, ...]
    ends: NDArray[np.int64]
    kinds: NDArray[np.int8]
    op_of: NDArray[np.integer[Any]]
    peer: NDArray[np.int32]
    op_code: NDArray[np.int8]
    op_pipeline: NDArray[np.int32]
    op_microbatch: NDArray[np.int32]
    op_stage: NDArray[np.int32]
    tail: tuple[Instruction, ...]


class LoweredStreams(dict):  # type: ignore[type-arg]
    """`{worker: stream}` as `lower` made it, with `columns` (see the module docstring) until it is changed."""

    columns: StreamColumns | None

    def __init__(self, items: Any, columns: StreamColumns) -> None:
        super().__init__(items)
        self.columns = columns

    def __reduce__(self) -> tuple[Any, ...]:
        return (dict, (dict(self),))

    def copy(self) -> dict[Worker, tuple[Instruction, ...]]:  # type: ignore[override]
        return dict(self)

    def __setitem__(self, key: Any, value: Any) -> None:
        self.columns = None
        super().__setitem__(key, value)

    def __delitem__(self, key: Any) -> None:
        self.columns = None
        super().__delitem__(key)

    def __ior__(self, other: Any) -> LoweredStreams:  # type: ignore[override,misc]
        self.columns = None
        return super().__ior__(other)  # type: ignore[no-any-return]

    def update(self, *args: Any, **kwargs: Any) -> None:
        self.columns = None
        super().update(*args, **kwargs)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        self.columns = None
        return super().setdefault(key, default)

    def pop(self, *args: Any) -> Any:
        self.columns = None
        return super().pop(*args)

    def popitem(self) -> Any:
        self.columns = None
        return super().popitem()

    def clear(self) -> None:
        self.columns = None
        super().clear()


def texts_by_worker(columns: StreamColumns, batch: int = 256) -> Iterator[tuple[Worker, list[str]]]:
    """Each worker's stream as texts (`str` of each instruction, the tail included), workers in order: what
    `ir.stream_texts` gives, made per batch of `batch` workers with array operations. The op texts are made
    once per distinct op name and every other text from the one format (`ir.instruction_text`) of each kind
    with each peer, so the two cannot differ (`tests/compiler/test_fast_paths.py` holds them to it)."""
    workers, ends = columns.workers, columns.ends
    if not workers:
        return
    starts = ends - np.diff(ends, prepend=0)
    # Op texts (`F3.1`: kind, micro-batch, pipeline), one per distinct name, shared by every row naming it.
    d, m, code = (c.astype(np.int64) for c in (columns.op_pipeline, columns.op_microbatch, columns.op_code))
    dp, width = int(d.max(initial=0)) + 1, int(m.max(initial=0)) + 1
    names, which = np.unique((code * width + m) * dp + d, return_inverse=True)
    op_text = np.array([str(Op(OP_CODES[n // (width * dp)], n % dp, n // dp % width, 0)) for n in names.tolist()],
                       object)[which]
    # Per row kind, the text before its op's and after it; transfers: after it, per peer.
    before = np.empty(len(ROW_KINDS), object)
    after = np.empty((len(ROW_KINDS), len(workers) + 1), object)
    for k, kind in enumerate(ROW_KINDS):
        transfer = semantics_of(kind).is_transfer
        before[k] = instruction_text(kind, "\0", workers[0] if transfer else None).split("\0")[0]
        after[k] = [instruction_text(kind, "\0", w if transfer else None).split("\0")[1] for w in (*workers, None)] \
            if transfer else instruction_text(kind, "\0", None).split("\0")[1]
    tail = stream_texts(columns.tail)
    order = sorted(range(len(workers)), key=workers.__getitem__)
    for b in range(0, len(order), batch):
        xs = np.array(order[b:b + batch], np.int64)
        lengths = ends[xs] - starts[xs]
        rows = np.repeat(starts[xs] - np.cumsum(lengths) + lengths, lengths) + np.arange(int(lengths.sum()))
        kinds = columns.kinds[rows].astype(np.int64)
        texts = op_text[columns.op_of[rows]]
        wrapped = kinds >= len(OP_CODES)  # (compute rows are their op's text alone)
        k = kinds[wrapped]
        texts[wrapped] = before[k] + texts[wrapped] + after[k, columns.peer[rows[wrapped]]]
        out = texts.tolist()
        at = 0
        for x, n in zip(xs.tolist(), lengths.tolist(), strict=True):
            yield workers[x], [*out[at:at + n], *tail]
            at += n


def columns_of(streams: object) -> StreamColumns | None:
    """The columns of a plan's streams, when `lower` built them and nobody changed them since."""
    return streams.columns if type(streams) is LoweredStreams else None
