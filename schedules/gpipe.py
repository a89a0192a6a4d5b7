"""GPipe (Huang et al., 2019): every forward, then every fused backward.

Each stage holds all M micro-batches' activations at its peak.
"""

from __future__ import annotations

from schedcomp.ir import OpKind
from schedcomp.schedules.family import StageOrders, op

NAME = "gpipe"
DESCRIPTION = "all forwards, then all fused backwards; holds M micro-batches"


def build(pp: int, microbatches: int) -> StageOrders:
    # Backwards run in forward order (as torch.distributed.pipelining's ScheduleGPipe does), so the
    # last stage can start BW0 as soon as its last forward is done.
    return tuple(
        tuple(op(OpKind.F, m, s) for m in range(microbatches)) + tuple(op(OpKind.BW, m, s) for m in range(microbatches))
        for s in range(pp)
    )


def min_microbatches(pp: int) -> int:
    return 1
