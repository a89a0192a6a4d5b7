"""`lower` over columns: where each instruction of every stream goes, computed for all ops at once (numpy).

`lower` places receives, loads, compute ops and sends by the rules in `schedcomp.lower`'s docstring, which a
loop follows op by op; at pp = 32, dp = 256 that is 3.6 million instructions, and the loop's bookkeeping (dicts
of tensors, per-channel lists) cost more than building the instructions. Here every rule is an array
expression over the order's ops, and no instruction is built: the streams are the placed columns, made into
`Instruction` objects only when read (`schedcomp.streamcolumns.LoweredStreams`):

- a slot's runner, each op's send (tensor, receiver) and need (tensor, sender), by slot arithmetic;
- FIFO per channel: a receive is posted before the first op (in stream order) that needs it or any tensor
  sent after it on its channel, so its post time is a suffix minimum over the channel of its tensors' needs;
- each stream is a run of blocks (the receives posted before an op, its LOAD, the op, its SEND): each
  instruction's place is its block's start plus its place in the block.

Only the plain case is handled: ops with whole-number fields of this job, one F per slot, every tensor sent
once and needed where it is sent. Anything else returns None and `lower` takes its op-by-op path, which
names the first problem (`tests/compiler/test_fast_paths.py` holds both to the same answers).
"""

from __future__ import annotations

from itertools import chain, repeat
from operator import attrgetter
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from schedcomp.ir import Instruction, Op, OpKind, Order
from schedcomp.opcolumns import OP_CODES, ColumnOps, OpColumns, op_columns_of
from schedcomp.streamcolumns import LOAD, RECV, SEND, LoweredStreams, StreamColumns

if TYPE_CHECKING:
    from numpy.typing import NDArray

_CODE = {kind: code for code, kind in enumerate(OP_CODES)}
# Looked up by identity: `OpKind` is a str enum, so a plain "F" would equal OpKind.F where the op-by-op
# path (`op.kind is F`) refuses it.
_CODE_BY_ID = {id(kind): code for kind, code in _CODE.items()}
_F, _B, _BW = _CODE[OpKind.F], _CODE[OpKind.B], _CODE[OpKind.BW]


def _ints(values: list[object]) -> NDArray[np.int64] | None:
    """`values` as an int64 column, or None unless every one is an `int` (not a bool, which an op's text
    would print as `False`, nor an int subclass with a text of its own)."""
    if not set(map(type, values)) <= {int}:
        return None
    column = np.array(values)
    return column if column.dtype.kind == "i" and column.ndim == 1 else None


class _Placed(NamedTuple):
    """Per instruction of all streams in a row, its kind (a row of `ROW_KINDS`), its op (a number in the order's
    ops in a row) and its peer (a worker number, -1 for none); and where each worker's stream ends."""

    kinds: NDArray[np.int8]
    op_of: NDArray[np.integer[Any]]
    peer: NDArray[np.int32]
    ends: list[int]
    ops: OpColumns
    """The order's ops."""
    op_objects: ColumnOps | NDArray[np.object_]
    """Where their `Op` objects come from (see `LoweredStreams`)."""


def lower_streams(order: Order, tail: tuple[Instruction, ...]) -> LoweredStreams | None:
    """Every live worker's stream as `lower` places it, ending with `tail` (ALLREDUCE, STEP), or None for an
    order this plain path does not handle (see the module docstring). The streams are the placed columns,
    whose instruction objects are made when read (`schedcomp.streamcolumns`)."""
    placed = _placement(order)
    if placed is None:
        return None
    columns = StreamColumns(placed.ops.workers, np.array(placed.ends, np.int64), placed.kinds,
                            placed.op_of, placed.peer, placed.ops, tail)
    return LoweredStreams(columns, placed.op_objects)


def _op_columns(order: Order) -> tuple[OpColumns, ColumnOps | NDArray[np.object_]] | None:
    """The order's ops as columns and where their objects come from: a solver's own columns, else the fields
    read off its `Op` objects, which are kept in a row (the order's mapping may change once lowered). None
    where an op is not exactly an `Op`, a field not an int or a kind not an `OpKind` (the op-by-op path
    names the problem, or keeps what such ops print)."""
    given = op_columns_of(order.ops)
    if given is not None:
        return given, order.ops  # type: ignore[return-value]
    workers = tuple(order.ops)
    lengths = np.fromiter(map(len, order.ops.values()), np.int64, len(workers))
    items: list[Op] = list(chain.from_iterable(order.ops.values()))
    if not set(map(type, items)) <= {Op}:
        return None
    n = len(items)
    flat = np.empty(n, object)
    flat[:] = items
    code = np.fromiter(map(_CODE_BY_ID.get, map(id, map(attrgetter("kind"), items)), repeat(-1)), np.int64, n)
    d, m, s = (_ints(list(map(attrgetter(f), items))) for f in ("pipeline", "microbatch", "stage"))
    if d is None or m is None or s is None or (code < 0).any():
        return None
    return OpColumns(workers, np.cumsum(lengths), code, d, m, s), flat


def _placement(order: Order) -> _Placed | None:
    """Where every instruction of `order`'s streams goes (`_Placed`), or None for an order the op-by-op path
    must lower (it names the problem)."""
    topology = order.topology
    pp, dp = topology.stages, topology.dp
    mbs = order.cut.width(order.microbatches)
    if order.partitions is not None:  # re-formed pipelines: the op-by-op path knows their gaps
        return None
    given = _op_columns(order)
    if given is None or not len(given[0].code):
        return None
    ops, op_objects = given
    workers, code, d, m, s = ops.workers, ops.code, ops.pipeline, ops.microbatch, ops.stage
    n = len(code)
    lengths = np.diff(ops.ends, prepend=0)
    if order.cut:
        counts = np.array([order.cut.count(p, order.microbatches) for p in range(dp)], np.int64)
    else:
        counts = np.full(dp, mbs, np.int64)
    if not ((d >= 0) & (d < dp) & (m >= 0) & (s >= 0) & (s < pp)).all() or not (m < counts[d]).all():
        return None
    x = np.repeat(np.arange(len(workers)), lengths)  # each op's worker number
    j = np.arange(n) - np.repeat(np.cumsum(lengths) - lengths, lengths)  # its index in its worker's order
    slot = (d * mbs + m) * pp + s
    is_f = code == _F
    runner = np.full(dp * mbs * pp, -1, np.int64)
    runner[slot[is_f]] = x[is_f]
    if np.count_nonzero(runner >= 0) != np.count_nonzero(is_f):
        return None  # two Fs of one slot
    backward = (code == _B) | (code == _BW)
    # Sends: an F's activation to the next stage, a B's (or BW's) input gradient to the previous one.
    sends = (is_f & (s < pp - 1)) | (backward & (s > 0))
    send_to = np.where(is_f, slot + 1, slot - 1)
    # Needs: an F's input from the previous stage, a B's (BW's) output gradient from the next one.
    needs = (is_f & (s > 0)) | (backward & (s < pp - 1))
    need_from = np.where(is_f, slot - 1, slot + 1)
    receiver = np.where(sends, runner[np.where(sends, send_to, 0)], -1)
    sender = np.where(needs, runner[np.where(needs, need_from, 0)], -1)
    if ((sends & (receiver < 0)) | (needs & (sender < 0))).any():
        return None  # a neighbour's slot has no F
    sends &= receiver != x  # the next chunk runs here too: a local hand-off
    needs &= sender != x
    out_tensor = slot * 2 + (~is_f)  # what an op sends: its slot's activation (F) or input gradient
    in_tensor = need_from * 2 + (~is_f)  # what it needs: its neighbour slot's
    send_ops, need_ops = np.flatnonzero(sends), np.flatnonzero(needs)
    # Every tensor sent once, needed once, where it is sent, from whom it is needed: per tensor id, one column.
    sent_by, needed_by = np.full(runner.size * 2, -1, np.int64), np.full(runner.size * 2, -1, np.int64)
    sent_by[out_tensor[send_ops]], needed_by[in_tensor[need_ops]] = send_ops, need_ops
    by_sent, by_needed = sent_by[sent_by >= 0], needed_by[needed_by >= 0]  # (by tensor id)
    if not (len(by_sent) == len(send_ops) and len(by_needed) == len(need_ops)
            and np.array_equal(sent_by >= 0, needed_by >= 0) and np.array_equal(x[by_sent], sender[by_needed])
            and np.array_equal(receiver[by_sent], x[by_needed])):
        return None
    # Channels, FIFO: the receives of a channel (sender -> receiver) in the order the sender sends, i.e. by
    # (channel, the sender's op order); a receive is posted at the first need (its consumer's index - 1, the
    # op before) among it and the tensors sent after it on its channel: a suffix minimum per channel.
    consumer = np.empty(n, np.int64)
    consumer[by_sent] = by_needed  # per sending op, the op that needs its tensor
    channel = receiver[send_ops] * len(workers) + x[send_ops]
    along = send_ops[np.lexsort((send_ops, channel))]  # sends by channel, in send order (flat order is so)
    chan = receiver[along] * len(workers) + x[along]
    post = _suffix_min_by_group(j[consumer[along]] - 1, chan)
    # Each stream is blocks: the receives posted before op 0, then per op k those posted before it (at most
    # one channel's: only op k + 1's input can be due), its LOAD, the op, its SEND. Block ids run over all
    # workers: op f of worker x ends block f + x + 1.
    loads = is_f & ((s == 0) | (s == pp - 1))
    recv_block = consumer[along] - j[consumer[along]] + receiver[along] + post + 1  # (its op 0's block, + 1 + post)
    op_block = np.arange(n) + x + 1
    received = np.bincount(recv_block, minlength=n + len(workers))
    size = received.copy()
    size[op_block] += 1 + loads + sends
    start = np.cumsum(size) - size  # (blocks of one worker in a row, workers in order: their streams in a row)
    first = np.r_[True, (chan[1:] != chan[:-1]) | (post[1:] != post[:-1])]  # each block's receives are one run
    run_start = np.maximum.accumulate(np.where(first, np.arange(len(along)), 0))
    at_op = start[op_block] + received[op_block] + loads  # where each op goes; its LOAD before, its SEND after
    where = np.concatenate([start[recv_block] + np.arange(len(along)) - run_start, at_op[loads] - 1, at_op,
                            at_op[sends] + 1])
    total = int(size.sum())
    kinds = np.empty(total, np.int8)
    kinds[where] = np.concatenate([RECV + (out_tensor[along] & 1), np.full(np.count_nonzero(loads), LOAD), code,
                                   SEND + (out_tensor[sends] & 1)])
    op_of = np.empty(total, np.int32 if n < 2**31 else np.int64)
    op_of[where] = np.concatenate([consumer[along], np.flatnonzero(loads), np.arange(n), np.flatnonzero(sends)])
    peer = np.full(total, -1, np.int32)  # (index -1 of `who`: None)
    peer[where[: len(along)]] = x[along]
    peer[at_op[sends] + 1] = receiver[sends]
    ends = np.cumsum(size)[np.cumsum(lengths) + np.arange(len(workers))].tolist()  # each worker's last block
    return _Placed(kinds, op_of, peer, ends, ops, op_objects)


def _suffix_min_by_group(values: NDArray[np.int64], groups: NDArray[np.int64]) -> NDArray[np.int64]:
    """Per item, the least value among it and the items after it in its group (groups contiguous)."""
    if not len(values):
        return values
    # Group k lifted by k spans of the values: every later group's values exceed every earlier group's, so a
    # running minimum from the end over all items is, within each group, that group's suffix minimum.
    group_no = np.cumsum(np.r_[False, groups[1:] != groups[:-1]])
    span = int(values.max() - values.min()) + 1
    lifted = values + group_no * span
    out = np.minimum.accumulate(lifted[::-1])[::-1]
    return out - group_no * span
