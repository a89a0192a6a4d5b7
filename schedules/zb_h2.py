"""ZB-H2 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, Figure 3 bottom).

More forwards in the warm-up fill the bubble before the first B (stage s runs 2(pp-s)-1 of
them), and W passes are moved to the tail, so each stage's work forms a parallelogram: with
T_F = T_B = T_W and the optimizer step not a global barrier, the steady state has no bubble.
Every stage keeps at most 2pp-1 micro-batches in flight (F done, W not yet). With the same
costs at every stage and no communication, the steady-state bubble is exactly
max(0, (pp-1)(T_F + T_B - 2 T_W)) whenever T_W <= T_F and M >= 2pp-1 (tests/compiler/test_closed_forms.py).

The order is the one a unit-time list schedule produces: at each tick a stage runs, in
priority, the B whose gradient has arrived, else the next F if its input has arrived and it
holds fewer than 2pp-1 micro-batches, else its oldest pending W. Those rules give exactly the
paper's shape: the long warm-up, B, W and F interleaved in the middle, and a W-heavy tail
on the later stages (the last stage defers up to 2pp-2 of them), which lets them finish while
the first stage still drains its backward passes.
"""

from __future__ import annotations

from schedcomp.ir import Op, OpKind
from schedcomp.schedules.family import StageOrders, op

NAME = "zb-h2"
DESCRIPTION = "split B and W, longer warm-up, W-heavy tail: no steady-state bubble; holds 2pp-1"


def build(pp: int, microbatches: int) -> StageOrders:
    cap = 2 * pp - 1
    f, b, w = [0] * pp, [0] * pp, [0] * pp  # ops of each kind done (they run in micro-batch order)
    f_end: dict[tuple[int, int], int] = {}  # (microbatch, stage) -> tick its F finishes
    b_end: dict[tuple[int, int], int] = {}
    orders: list[list[Op]] = [[] for _ in range(pp)]
    never = 1 << 62
    tick = 0
    # The last stage can always run B right after F, so the list schedule never stalls for good;
    # the bound only turns a bug into an error instead of a hang.
    last_tick = 4 * (3 * microbatches + 2 * pp)
    while any(n < microbatches for n in w):
        if tick > last_tick:
            raise RuntimeError(f"zb-h2 list schedule stalled at pp={pp}, microbatches={microbatches}")
        for s in range(pp):
            if b[s] < f[s]:
                ready = f_end[(b[s], s)] if s == pp - 1 else b_end.get((b[s], s + 1), never)
                if ready <= tick:
                    orders[s].append(op(OpKind.B, b[s], s))
                    b_end[(b[s], s)] = tick + 1
                    b[s] += 1
                    continue
            if f[s] < microbatches and f[s] - w[s] < cap and (s == 0 or f_end.get((f[s], s - 1), never) <= tick):
                orders[s].append(op(OpKind.F, f[s], s))
                f_end[(f[s], s)] = tick + 1
                f[s] += 1
                continue
            if w[s] < b[s]:
                orders[s].append(op(OpKind.W, w[s], s))
                w[s] += 1
        tick += 1
    return tuple(tuple(o) for o in orders)


def min_microbatches(pp: int) -> int:
    # The warm-up of stage 0 alone needs 2pp-1 forwards.
    return 2 * pp - 1
