"""ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, Section 6): two chunks per worker
in a V (virtual stage r and 2pp-1-r on worker r, so the last worker turns the forward around
locally), backward split into B and W.

Worker r runs 2(pp-r)-1 forwards of chunk 0, then r pairs of chunk-1 and chunk-0 forwards, then
pp-r rounds of chunk-1 F B W; the steady state alternates chunk 0 (F B W) and chunk 1 (F B W); the
cooldown runs the remaining B passes (r pairs over both chunks, then pp-r of chunk 0 with its W)
and ends with the deferred W passes. This is PyTorch's `ScheduleZBVZeroBubble` order, so the two
agree action for action. With each chunk costing half a stage and T_F = T_B = T_W the paper's
steady state has no bubble at the activation memory of 1F1B (pp micro-batches of a whole stage):
tests/compiler/test_virtual_stages.py pins both.
"""

from __future__ import annotations

from schedcomp.errors import ScheduleError
from schedcomp.ir import Op, OpKind
from schedcomp.schedules.family import StageOrders, op
from schedcomp.topology import V

NAME = "zb-v"
DESCRIPTION = "two chunks per worker in a V, split B and W: no steady-state bubble at 1F1B's memory"
PLACEMENT = V
DEFAULT_CHUNKS = 2


def worker_order(pp: int, microbatches: int, r: int) -> tuple[Op, ...]:
    F, B, W = OpKind.F, OpKind.B, OpKind.W
    # The shape needs 2pp-1 micro-batches; with fewer, the ops of those beyond M are dropped (as PyTorch does).
    n = max(2 * pp - 1, microbatches)
    first, second = r, 2 * pp - 1 - r  # the worker's chunks: stage r on the way down, 2pp-1-r on the way back
    ops: list[Op] = []
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (pp - r) - 1):
        ops.append(op(F, f0, first))
        f0 += 1
    for _ in range(r):
        ops += [op(F, f1, second), op(F, f0, first)]
        f1 += 1
        f0 += 1
    for _ in range(pp - r):
        ops += [op(F, f1, second), op(B, b1, second), op(W, b1, second)]
        f1 += 1
        b1 += 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            ops.append(op(F, f0, first))
            f0 += 1
        ops += [op(B, b0, first), op(W, b0, first), op(F, f1, second), op(B, b1, second), op(W, b1, second)]
        b0 += 1
        f1 += 1
        b1 += 1
    w0, w1 = b0, b1
    for _ in range(r):
        ops += [op(B, b0, first), op(B, b1, second)]
        b0 += 1
        b1 += 1
    for _ in range(pp - r):
        ops += [op(B, b0, first), op(W, w0, first)]
        b0 += 1
        w0 += 1
    ops += [op(W, m, second) for m in range(w1, b1)]
    ops += [op(W, m, first) for m in range(w0, b0)]
    return tuple(o for o in ops if o.microbatch < microbatches)


def build(pp: int, microbatches: int, chunks: int) -> StageOrders:
    if chunks != 2:
        raise ScheduleError(f"{NAME} holds exactly 2 chunks per worker (a V), got chunks={chunks}")
    return tuple(worker_order(pp, microbatches, r) for r in range(pp))


def min_microbatches(pp: int) -> int:
    return 1
