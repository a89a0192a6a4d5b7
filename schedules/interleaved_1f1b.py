"""Interleaved 1F1B (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", SC 2021): each worker holds `chunks` (v) model chunks, virtual stage c * pp + r on
worker r (the loop placement), and runs 1F1B over them.

The order is Megatron-LM's (`forward_backward_pipelining_with_interleaving`) and PyTorch's
`ScheduleInterleaved1F1B` (which, unlike Megatron-LM, does not make every op a warm-up one when
M = pp; neither do we): the M micro-batches run in R = max(1, M // pp) equal rounds of n = M / R
(n = pp when M is a multiple of pp); forwards go through the chunks round by round (chunk 0 of the
round's n micro-batches, chunk 1 of the same, ...), backwards the same with the chunks reversed;
worker r runs 2(pp-1-r) + (v-1)n warm-up forwards (at most all of them), then one forward one fused backward,
then the remaining backwards (with v = 1: 1F1B's pp-1-r, and the order is 1F1B's). With each chunk
costing 1/v of a stage the bubble is Megatron's
(pp-1)(T_F + T_B + T_W)/v, 1/v of 1F1B's, when M is a multiple of pp (tests/compiler/test_virtual_stages.py
pins it). M must be at least pp and split into equal rounds (PyTorch's rule).
"""

from __future__ import annotations

from schedcomp.errors import ScheduleError
from schedcomp.ir import Op, OpKind
from schedcomp.schedules.family import StageOrders, op
from schedcomp.topology import LOOP

NAME = "interleaved-1f1b"
DESCRIPTION = "v chunks per worker (looped), 1F1B over them with fused backwards; bubble 1/v of 1F1B's"
PLACEMENT = LOOP
DEFAULT_CHUNKS = 2


def worker_order(pp: int, microbatches: int, chunks: int, r: int) -> tuple[Op, ...]:
    total = microbatches * chunks
    per_round = microbatches // max(1, microbatches // pp)  # micro-batches per round: pp when M is a multiple
    group = per_round * chunks

    def nth(k: int, kind: OpKind) -> Op:
        rounds, at = divmod(k, group)
        chunk = at // per_round if kind is OpKind.F else chunks - 1 - at // per_round
        return op(kind, rounds * per_round + at % per_round, chunk * pp + r)

    # With one chunk, plain 1F1B's warm-up: the interleaved one assumes v > 1 and would hold twice as much.
    warmup = pp - 1 - r if chunks == 1 else min(2 * (pp - 1 - r) + (chunks - 1) * per_round, total)
    ops = [nth(k, OpKind.F) for k in range(warmup)]
    for k in range(total - warmup):
        ops += [nth(warmup + k, OpKind.F), nth(k, OpKind.BW)]
    ops += [nth(k, OpKind.BW) for k in range(total - warmup, total)]
    return tuple(ops)


def build(pp: int, microbatches: int, chunks: int) -> StageOrders:
    rounds = max(1, microbatches // pp)
    if microbatches % rounds:  # PyTorch's rule: equal rounds of at least pp micro-batches
        raise ScheduleError(f"{NAME} runs micro-batches in equal rounds of at least pp={pp}, but {microbatches} is not "
                            f"a multiple of {rounds} rounds: use a multiple of {pp} or of {rounds}")
    return tuple(worker_order(pp, microbatches, chunks, r) for r in range(pp))


def min_microbatches(pp: int) -> int:
    return pp
