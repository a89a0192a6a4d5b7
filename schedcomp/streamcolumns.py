"""A lowered plan's streams as the columns `lower` placed them in, instruction objects made when read.

`lower` places every instruction of every stream as numpy columns (`schedcomp.lower_columns`). At pp = 32,
dp = 256 that is 3.6 million instructions; making an `Instruction` object of each, and then reading them
back one by one in `check` and in the JSON writer, was most of their time. `LoweredStreams` is the
streams mapping of a lowered plan: its keys are the live workers, `columns` the placed instructions, and
a worker's stream is made (once) when it is read, all streams at once when all are (`items`, `values`).
`check` reads the columns (`schedcomp.check_columns`) and the JSON writer makes the texts from them
(`json_lists`). It is read-only, as a plan is by contract (copy it to `dict` to edit a plan); a
copy or a pickle is a dict.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import chain, repeat
from typing import TYPE_CHECKING, Any

import numpy as np

from schedcomp.gcpause import paused_gc
from schedcomp.ir import INSTRUCTION_SETTERS, InstrKind, Instruction, Op, instruction_text, stream_texts
from schedcomp.opcolumns import OP_CODES, ColumnOps, LazyMapping, OpColumns, span
from schedcomp.semantics import semantics_of
from schedcomp.topology import Worker

if TYPE_CHECKING:
    from numpy.typing import NDArray

ROW_KINDS = np.array([InstrKind.F, InstrKind.B, InstrKind.W, InstrKind.BW, InstrKind.LOAD, InstrKind.SEND_ACT,
                      InstrKind.SEND_GRAD, InstrKind.RECV_ACT, InstrKind.RECV_GRAD], dtype=object)
"""An instruction's kind by code: 0..3 the compute ops (as `OP_CODES`), then LOAD, the sends and the receives
(activation, gradient: a tensor's low bit)."""
LOAD, SEND, RECV = 4, 5, 7


@dataclass(frozen=True, eq=False)
class StreamColumns:
    """Every live worker's stream but its tail, rows of all workers in a row (`workers` order, the order's
    workers), as columns. Per row: `kinds` (a code of `ROW_KINDS`), `op_of` (which op of `ops`: always one
    of the row's worker's) and `peer` (a number in `workers`, -1 for none); `ends[x]` is where worker x's
    rows end. Each stream then ends with `tail`."""

    workers: tuple[Worker, ...]
    ends: NDArray[np.int64]
    kinds: NDArray[np.int8]
    op_of: NDArray[np.integer[Any]]
    peer: NDArray[np.int32]
    ops: OpColumns
    tail: tuple[Instruction, ...]

    @cached_property
    def peer_workers(self) -> NDArray[np.object_]:
        """Each peer number's worker, and None at index -1 (no peer): `peer_workers[peer]` per row."""
        who = np.empty(len(self.workers) + 1, object)
        who[:-1] = self.workers
        return who


class LoweredStreams(LazyMapping[tuple[Instruction, ...]]):
    """`{worker: stream}` over `StreamColumns`, each stream made when first read (see the module docstring).
    `ops` gives the `Op` objects the instructions name: the order's `ColumnOps` (read-only, so shared), or
    the order's ops in a row (a snapshot: the order's own mapping may be a dict its maker changes later)."""

    def __init__(self, columns: StreamColumns, ops: ColumnOps | NDArray[np.object_]) -> None:
        super().__init__(columns.workers)
        self.columns = columns
        self._ops = ops

    def _ops_of(self, x: int) -> NDArray[np.object_]:
        """Worker x's ops, in a row (the rows' `op_of` minus its first op's number indexes them)."""
        if isinstance(self._ops, np.ndarray):
            start, end = span(self.columns.ops.ends, x)
            return self._ops[start:end]
        ops = self._ops[self.columns.workers[x]]
        own = np.empty(len(ops), object)
        own[:] = ops
        return own

    def _make(self, worker: Worker) -> tuple[Instruction, ...]:
        c, x = self.columns, self._number[worker]
        start, end = span(c.ends, x)
        first_op = span(c.ops.ends, x)[0]  # (a row names an op of its own worker: `lower_columns`)
        return (*_instructions([(ROW_KINDS, c.kinds[start:end]), (self._ops_of(x), c.op_of[start:end] - first_op),
                                (c.peer_workers, c.peer[start:end])]), *c.tail)

    def _make_all(self) -> dict[Worker, tuple[Instruction, ...]]:
        """Every stream at once: each field of all rows set in one C loop (`_make` does one worker's; one call
        for all saves a Python step per worker, 8,000 of them at pp = 32, dp = 256)."""
        c = self.columns
        if isinstance(self._ops, np.ndarray):
            ops = self._ops
        else:
            count = int(c.ops.ends[-1]) if c.workers else 0
            ops = np.fromiter(chain.from_iterable(self._ops[w] for w in c.workers), object, count)
        made = _instructions([(ROW_KINDS, c.kinds), (ops, c.op_of), (c.peer_workers, c.peer)])
        tail = c.tail
        return {w: (*made[a:b], *tail) for w, a, b in zip(c.workers, [0, *c.ends[:-1].tolist()], c.ends.tolist(),
                                                            strict=True)}


def _instructions(fields: list[tuple[NDArray[np.object_], NDArray[np.integer[Any]]]]) -> list[Instruction]:
    """Instructions whose kind, op and peer are given as (values, which value each takes): set in C (`map`)
    as `Instruction.trusted` would one by one (the fields are right by construction), with the collector
    paused (millions of small acyclic objects: `schedcomp.gcpause`)."""
    with paused_gc():
        made = list(map(object.__new__, repeat(Instruction, len(fields[0][1]))))
        for setter, (values, which) in zip(INSTRUCTION_SETTERS, fields, strict=True):
            deque(map(setter, made, values[which].tolist()), maxlen=0)
    return made


class EditedStreams(LazyMapping[tuple[Instruction, ...]]):
    """The streams of a plan edited from another (`repair`): `base`'s, less the `dropped` worker's, with
    `changed` ones in their place. The others are read from `base` when read, so an edit of a few streams of
    a lowered plan makes no others. (Each repair of a repaired plan adds a level, which keeps its base.)"""

    def __init__(self, base: Mapping[Worker, tuple[Instruction, ...]],
                 changed: Mapping[Worker, tuple[Instruction, ...]], dropped: Worker) -> None:
        super().__init__(w for w in base if w != dropped)
        self._base, self._changed = base, changed

    def _make(self, worker: Worker) -> tuple[Instruction, ...]:
        stream = self._changed.get(worker)
        return self._base[worker] if stream is None else stream

    def _make_all(self) -> dict[Worker, tuple[Instruction, ...]]:
        base, changed = dict(self._base.items()), self._changed  # (all of the base's at once)
        return {w: changed[w] if w in changed else base[w] for w in self._number}


JSON_PLAIN = re.compile(r"[A-Za-z0-9_.:<>\[\]-]*")
"""Texts that are valid inside JSON quotes as they are (instruction and worker texts: see `ir`)."""


def json_lists(columns: StreamColumns, sep: str, batch: int = 256) -> Iterator[tuple[Worker, str]] | None:
    """Each worker's stream as the JSON list of its instructions' texts (`json.dumps(ir.stream_texts(stream),
    separators=(sep, ":"))`, the tail included), workers in order; None if some text would need escaping
    (none does: see `JSON_PLAIN`). Each row's text is two shared pieces, its kind's prefix with its op's name
    (`LOAD[F3.1`, one per kind and distinct op name) and its kind's suffix with its peer and the separator
    (`>0:1]", "`), and a worker's list is one join of those, so no text is made per instruction (3.6 million at
    pp = 32, dp = 256). Every piece is cut from the one format of each kind (`ir.instruction_text`), so the two
    cannot differ (`tests/compiler/test_fast_paths.py` holds them to it)."""
    workers = columns.workers
    # Op names (`F3.1`: kind, micro-batch, pipeline) by number, made for the numbers in use only.
    d, m, code = columns.ops.pipeline, columns.ops.microbatch, columns.ops.code
    dp, width = int(d.max(initial=0)) + 1, int(m.max(initial=0)) + 1
    name_of = (code * width + m) * dp + d
    used = np.zeros(len(OP_CODES) * width * dp, bool)
    used[name_of] = True
    numbers = np.flatnonzero(used).tolist()
    names = [str(Op.trusted(OP_CODES[n // (width * dp)], n % dp, n // dp % width, 0)) for n in numbers]
    quote = f'"{sep}"'  # between two texts of a list
    # Per row kind, the text before its op's name and after it (per peer for transfers, -1: none).
    heads = np.empty((len(ROW_KINDS), len(used)), object)
    tails = np.empty((len(ROW_KINDS), len(workers) + 1), object)
    for k, kind in enumerate(ROW_KINDS):
        transfer = semantics_of(kind).is_transfer
        head = instruction_text(kind, "\0", workers[0] if transfer and workers else None).split("\0")[0]
        heads[k, numbers] = [head + name for name in names] if head else names
        tails[k] = [instruction_text(kind, "\0", w).split("\0")[1] + quote for w in (*workers, None)] \
            if transfer else instruction_text(kind, "\0", None).split("\0")[1] + quote
    tail = stream_texts(columns.tail)
    pieces = (*heads[:, numbers[0]], *names, *tails[:, 0], *tails[:, -1], *tail, *map(str, workers)) \
        if numbers else (*tail, *map(str, workers))
    if not all(JSON_PLAIN.fullmatch(text.replace(quote, "")) for text in pieces):
        return None
    return _json_lists(columns, heads.reshape(-1), tails, name_of, tail, quote, batch)


def _json_lists(columns: StreamColumns, heads: NDArray[np.object_], tails: NDArray[np.object_],
                name_of: NDArray[np.int64], tail: list[str], quote: str, batch: int) -> Iterator[tuple[Worker, str]]:
    workers, ends = columns.workers, columns.ends
    starts = ends - np.diff(ends, prepend=0)
    n_names = len(heads) // len(ROW_KINDS)  # (numbers of op names)
    close = quote.join(tail) + '"]' if tail else ""
    order = sorted(range(len(workers)), key=workers.__getitem__)
    for b in range(0, len(order), batch):
        xs = np.array(order[b:b + batch], np.int64)
        lengths = ends[xs] - starts[xs]
        rows = np.repeat(starts[xs] - np.cumsum(lengths) + lengths, lengths) + np.arange(int(lengths.sum()))
        kinds = columns.kinds[rows].astype(np.int64)
        pieces = np.empty((len(rows), 2), object)
        pieces[:, 0] = heads[kinds * n_names + name_of[columns.op_of[rows]]]
        pieces[:, 1] = tails[kinds, columns.peer[rows]]
        out = pieces.reshape(-1).tolist()
        at = 0
        for x, n in zip(xs.tolist(), lengths.tolist(), strict=True):
            body = "".join(out[at:at + 2 * n])
            at += 2 * n
            if close:
                yield workers[x], f'["{body}{close}'
            else:  # (no tail: the last text ends the list, not a separator)
                yield workers[x], f'["{body[:-len(quote)]}"]' if n else "[]"


def instruction_count(streams: Mapping[Worker, Sequence[Instruction]]) -> int:
    """How many instructions the streams hold (of a lowered plan's: without making them)."""
    columns = columns_of(streams)
    if columns is None:
        return sum(map(len, streams.values()))
    return len(columns.kinds) + len(columns.tail) * len(columns.workers)


def columns_of(streams: object) -> StreamColumns | None:
    """The columns of a plan's streams, when `lower` placed them as columns."""
    return streams.columns if type(streams) is LoweredStreams else None
