"""The ledger and the batch-size check of resilient jobs under re-formed plans (shares of the global batch,
per-segment all-reduces), without processes.

Rows are LOAD's, `Cut.global_rows`: with shares a pipeline's pieces start at the shares before it, so a piece
may overlap another pipeline's regular micro-batches, and a boundary rounds at its place in the global batch.
ALLREDUCE sums each segment's counts over its holders (`executor._allreduce`); a worker's ledger is the
segments' common count (`executor.segment_ledger`), so all ones means every segment counted every row once.
"""

from __future__ import annotations

import math

import pytest
import torch
from ledgers import ledger_of, rows_over_pieces

from schedcomp.compiler import compile
from schedcomp.cut import Cut
from schedcomp.errors import RuntimeSetupError
from schedcomp.ir import InstrKind
from schedcomp.runtime.data import PieceRows, empty_piece, held_rows
from schedcomp.runtime.executor import segment_ledger
from schedcomp.runtime.layout import Layout

DP, M = 2, 3


@pytest.fixture(scope="module")
def reformed():
    """pp 3, dp 2, M 3, worker 1:1 failed: pipeline 1 re-formed (3, 0, 3), shares 3.6 and 2.4 in pieces."""
    plan = compile(3, DP, M, failed=["1:1"], layers=2, reform=(1,), memory_limit=None)
    assert plan.partitions == ((2, 2, 2), (3, 0, 3)) and plan.cut.shares
    return plan


@pytest.mark.parametrize("per", [2, 3, 5, 7])
def test_the_pieces_of_every_pipeline_cover_each_regular_microbatch_once(reformed, per: int) -> None:
    cut = reformed.cut
    assert rows_over_pieces(cut, DP, M, per) == [per] * (DP * M)
    # pipeline 1 starts 3.6 micro-batches in: its first piece holds rows of regular micro-batches 3 and 4
    assert [index for index, _ in held_rows(cut, 1, 0, DP, M, per)] == [3, 4]


def test_every_segment_counts_every_row_once_and_the_worker_reports_their_common_count(reformed) -> None:
    per = 5
    counts = {}
    for worker, stream in reformed.streams.items():  # what each worker adds before ALLREDUCE: its W (or fused B)
        it = ledger_of(reformed, DP, M, per)
        for ins in stream:
            if ins.kind in (InstrKind.W, InstrKind.BW):
                it.count((ins.op.pipeline, ins.op.microbatch))
        counts[worker] = it.ledger.clone()
    layout = Layout.of(reformed)
    assert len(layout.reductions) == 4  # segments: layers 0-1, 2, 3, 4-5, over overlapping holders
    summed = {r: sum(counts[w] for w in r.holders) for r in layout.reductions}
    for reduction, total in summed.items():
        assert (total / per).tolist() == [1.0] * (DP * M), reduction
    for worker in reformed.streams:
        own = [summed[r] for r in layout.reductions_of(worker)]
        assert (segment_ledger(own, counts[worker]) / per).tolist() == [1.0] * (DP * M), worker


def test_a_worker_whose_segments_disagree_reports_nan_there_and_an_idle_one_its_own_counts() -> None:
    ones, other = torch.ones(4, dtype=torch.float64), torch.tensor([1.0, 2.0, 1.0, 0.0], dtype=torch.float64)
    got = segment_ledger([ones, other, ones], torch.zeros(4, dtype=torch.float64))
    assert got[0].item() == 1.0 and got[2].item() == 1.0 and math.isnan(got[1].item()) and math.isnan(got[3].item())
    assert segment_ledger([other, other], ones).tolist() == other.tolist()  # agreeing: their count, wrong or not
    assert segment_ledger([], other).tolist() == other.tolist()


def test_a_piece_empty_only_where_load_takes_its_rows_in_the_global_batch_is_refused() -> None:
    # dp 2, M 2, shares 1.5 and 2.5: within its own share pipeline 1's first piece is rows 0-1 of 1 per
    # micro-batch, but LOAD takes rows round(1.5) to round(2.1) of the global batch: none
    cut = Cut.of({0: (0.0, 0.6, 1.5), 1: (0.0, 0.6, 2.5)}, shares=True)
    assert all(stop > start for p, b in cut.bounds for m in range(len(b) - 1) for start, stop in [cut.rows(p, m, 1)])
    assert cut.global_rows(1, 0, 2, 2, 1) == (2, 2)
    assert empty_piece(cut, 1, 2, 2) == "is a piece of 0.6 micro-batches, no whole sample of the 1 per micro-batch"
    assert empty_piece(cut, 2, 2, 2) is None
    pieces = PieceRows([cut])  # what a resilient job checks each batch size against, at its first iteration
    pieces.check((torch.zeros(8, 1), None), 2, 2)
    with pytest.raises(RuntimeSetupError, match=r"^a re-formed plan this job may switch to has a piece that is a piece "
                                                r"of 0.6 micro-batches, .* \(a batch of 4 rows\): use a larger batch, "
                                                r"or plans without reform$"):
        pieces.check((torch.zeros(4, 1), None), 2, 2)


def test_a_plan_that_comes_later_is_checked_at_the_job_s_batch_size() -> None:
    # PieceRows.piece_problem: what the plan source (a plan function's plan) and a switch to a better plan ask of
    # a cut not checked at the first iteration; nothing before a batch was seen, then the last batch's size.
    cut = Cut.of({0: (0.0, 0.6, 1.5), 1: (0.0, 0.6, 2.5)}, shares=True)
    pieces = PieceRows([])
    assert pieces.piece_problem(cut, 2, 2) is None  # no batch yet
    pieces.check((torch.zeros(4, 1), None), 2, 2)  # 1 row per micro-batch: no cut to refuse it
    assert pieces.piece_problem(cut, 2, 2) == empty_piece(cut, 1, 2, 2) is not None
    pieces.check((torch.zeros(8, 1), None), 2, 2)
    assert pieces.piece_problem(cut, 2, 2) is None
