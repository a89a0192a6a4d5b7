"""1F1B (PipeDream-Flush / Megatron-LM): warm-up forwards, then one forward one fused backward.

Stage s runs pp-1-s warm-up forwards, then alternates F and BW, then drains the remaining BWs,
so stage s holds at most pp-s micro-batches (pp at stage 0).
"""

from __future__ import annotations

from schedcomp.ir import Op, OpKind
from schedcomp.schedules.family import StageOrders, op

NAME = "1f1b"
DESCRIPTION = "warm-up forwards, then one forward one fused backward; holds pp micro-batches"


def stage_order(pp: int, microbatches: int, s: int) -> tuple[Op, ...]:
    warmup = min(pp - 1 - s, microbatches)
    ops = [op(OpKind.F, m, s) for m in range(warmup)]
    for k in range(microbatches - warmup):
        ops += [op(OpKind.F, warmup + k, s), op(OpKind.BW, k, s)]
    ops += [op(OpKind.BW, m, s) for m in range(microbatches - warmup, microbatches)]
    return tuple(ops)


def build(pp: int, microbatches: int) -> StageOrders:
    return tuple(stage_order(pp, microbatches, s) for s in range(pp))


def min_microbatches(pp: int) -> int:
    # With fewer than pp micro-batches there is no one-forward-one-backward phase at all.
    return pp
