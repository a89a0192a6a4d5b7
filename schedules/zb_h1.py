"""ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, Figure 3 top).

1F1B with the backward split into B (input gradient) and W (weight gradient): the same
warm-up of pp-1-s forwards, then F B pairs; stage s holds back its first s W passes and
runs them at the very end, where 1F1B leaves the cooldown bubble. Every stage keeps at most
pp micro-batches in flight (F done, W not yet), the memory of 1F1B.

The bubble is (pp-1)(T_F + T_B - T_W), a third of 1F1B's when T_F = T_B = T_W. With the same
costs at every stage and no communication, the simulated period equals that exactly whenever
T_W <= T_F and M >= pp (tests/compiler/test_closed_forms.py). This is the order of PyTorch's ZB1P
(`_get_1f1b_rank_ops` with `enable_zero_bubble`, one stage per rank).
"""

from __future__ import annotations

from schedcomp.ir import Op, OpKind
from schedcomp.schedules.family import StageOrders, op

NAME = "zb-h1"
DESCRIPTION = "1F1B with split B and W, W deferred into the cooldown bubble; holds pp micro-batches"


def stage_order(pp: int, microbatches: int, s: int) -> tuple[Op, ...]:
    warmup = min(pp - 1 - s, microbatches)
    ops = [op(OpKind.F, m, s) for m in range(warmup)]
    b = w = 0
    for k in range(microbatches - warmup):
        ops += [op(OpKind.F, warmup + k, s), op(OpKind.B, b, s)]
        b += 1
        if k >= s:  # the first s steady steps leave their W for the tail
            ops.append(op(OpKind.W, w, s))
            w += 1
    while b < microbatches:  # cooldown: B W pairs
        ops += [op(OpKind.B, b, s), op(OpKind.W, w, s)]
        b += 1
        w += 1
    ops += [op(OpKind.W, m, s) for m in range(w, microbatches)]
    return tuple(ops)


def build(pp: int, microbatches: int) -> StageOrders:
    return tuple(stage_order(pp, microbatches, s) for s in range(pp))


def min_microbatches(pp: int) -> int:
    return pp
