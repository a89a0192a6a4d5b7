"""The ledger of resilient jobs under re-cut plans counts samples (`Iteration.count`, `data.held_rows`): every
regular micro-batch sums to exactly one count over the pieces that cover it, whatever the cut. Also the
policies that work with whole micro-batches refuse re-cut plans in one line, at construction (a cache's
index says so) or as a plan function serves one."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from ledgers import ledger_of, rows_over_pieces
from recut_cache import DP, PP, M, as_whole, copy_cache, precompile_recut

from schedcomp.cache import PlanCache
from schedcomp.compiler import compile
from schedcomp.cut import Cut
from schedcomp.errors import PlanFormatError, RuntimeSetupError
from schedcomp.ir import InstrKind, Op, OpKind
from schedcomp.runtime.data import held_rows
from schedcomp.runtime.executor import HANDLERS
from schedcomp.runtime.fault.recovery import RollbackPolicy
from schedcomp.runtime.layout import Layout
from schedcomp.runtime.lossy import LossyPolicy
from schedcomp.topology import Topology, Worker


@st.composite
def cuts(draw: st.DrawFn) -> tuple[Cut, int, int, int]:
    """A random cut of some pipelines of a job (pieces of any sizes, crossing micro-batch boundaries or not),
    with a row count per micro-batch that gives every piece at least one row."""
    dp, microbatches = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    per = draw(st.integers(1, 40))
    bounds = {}
    for p in draw(st.sets(st.integers(0, dp - 1), min_size=1)):
        inner = draw(st.lists(st.integers(1, microbatches * per - 1), unique=True, max_size=12)) \
            if microbatches * per > 1 else []
        # boundaries anywhere in a row (rounded by `Cut.rows`), never two in one row: no empty piece
        bounds[p] = [0.0, *(r / per + draw(st.floats(-0.49, 0.49)) / per for r in sorted(inner)),
                     float(microbatches)]
    cut = Cut.of(bounds)
    for p, b in cut.bounds:
        assume(all(stop > start for start, stop in (cut.rows(p, m, per) for m in range(len(b) - 1))))
    return cut, dp, microbatches, per


@settings(max_examples=300, deadline=None)
@given(cuts())
def test_every_regular_microbatch_counts_exactly_once_over_the_pieces(case: tuple[Cut, int, int, int]) -> None:
    cut, dp, microbatches, per = case
    assert rows_over_pieces(cut, dp, microbatches, per) == [per] * (dp * microbatches)
    it = ledger_of(SimpleNamespace(cut=cut, microbatches=microbatches, topology=SimpleNamespace(dp=dp)), dp,
                   microbatches, per)
    for p in range(dp):
        for m in range(cut.count(p, microbatches)):
            it.count((p, m))
    assert it.ledger_unit == per
    assert it.counted().tolist() == [1.0] * (dp * microbatches)  # exactly: integers divided once
    # Where the worker took a piece's rows already (LOAD, its receives), the ledger counts those: the same rows.
    taken = ledger_of(it.plan, dp, microbatches, per)
    for p in range(dp):
        for m in range(cut.count(p, microbatches)):
            assert taken.rows_of(Op(OpKind.F, p, m, 0)) == cut.global_rows(p, m, dp, microbatches, per)
            taken.count((p, m))
    assert len(taken.rows_by_key) == cut.total(dp, microbatches) and torch.equal(taken.ledger, it.ledger)


def test_held_rows_of_a_piece_across_a_microbatch_boundary() -> None:
    cut = Cut.of({1: (0.0, 0.3, 0.9, 1.7, 2.1, 3.0)})  # rows 0-2, 2-6, 6-12, 12-15, 15-21 of 7 per micro-batch
    assert held_rows(cut, 1, 2, 2, 3, 7) == [(3, 1), (4, 5)]  # rows 6 of micro-batch 0, 7-11 of micro-batch 1
    assert held_rows(cut, 0, 2, 2, 3, 7) == [(2, 7)]  # a pipeline not re-cut: its micro-batch whole


def test_a_re_cut_plans_streams_count_every_microbatch_once_per_stage() -> None:
    # What the all-reduce sums: every live worker of a stage counts its W (or fused B) ops.
    plan = compile(2, 3, 3, failed=["1:1"], recut=True, memory_limit=None)
    assert plan.cut
    per = 4
    for stage in range(plan.topology.pp):
        it = ledger_of(plan, 3, 3, per)
        for worker in plan.topology.stage_group(stage):
            for ins in plan.streams[worker]:
                if ins.kind in (InstrKind.W, InstrKind.BW):
                    it.count((ins.op.pipeline, ins.op.microbatch))
        assert it.counted().tolist() == [1.0] * 9, stage


def test_a_plan_without_a_cut_counts_whole_microbatches_as_before() -> None:
    plan = compile(2, 2, 2)
    it = ledger_of(plan, 2, 2, 3)
    it.count((1, 0))
    assert it.ledger_unit == 1 and it.ledger.tolist() == [0.0, 0.0, 1.0, 0.0] and it.counted() is it.ledger


# ---- refusals -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def recut_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return precompile_recut(tmp_path_factory.mktemp("plans"))


def trainer(plans: object, tmp_path: Path, policy: str):
    from torch import nn

    from schedcomp.runtime.fault.boundary_log import LoggingPolicy
    from schedcomp.runtime.fault.restart import CheckpointPolicy
    from schedcomp.runtime.resilient import ResilientTrainer

    options = ({"policy": policy} if policy != "logging" else
               {"logging": LoggingPolicy(), "checkpoint": CheckpointPolicy(tmp_path / "ck", 1)})
    return ResilientTrainer(plans, lambda s, n: nn.Linear(2, 2), lambda y, t: y, lambda p: None, lambda i: None,
                            session=object(), **options)


@pytest.mark.parametrize("policy", ["lossy", "logging"])
def test_whole_microbatch_policies_refuse_a_re_cut_cache_from_its_index(recut_cache: Path, tmp_path: Path,
                                                                        policy: str) -> None:
    cache = PlanCache.load(recut_cache)
    name = "lossy" if policy == "lossy" else "swift"
    with pytest.raises(RuntimeSetupError, match=f"^the {name} policy works with whole micro-batches, but this plan "
                                                "source re-cuts them"):
        trainer(cache, tmp_path, policy)
    assert not cache.plans  # refused from the index: no plan was read


def test_whole_microbatch_policies_refuse_improving_plans_over_a_re_cut_cache(recut_cache: Path,
                                                                             tmp_path: Path) -> None:
    from schedcomp.improving import ImprovingPlans

    with pytest.raises(RuntimeSetupError, match="re-cuts them"):
        trainer(ImprovingPlans(PlanCache.load(recut_cache)), tmp_path, "lossy")


def test_rollback_and_restart_take_a_re_cut_cache(recut_cache: Path, tmp_path: Path) -> None:
    from torch import nn

    from schedcomp.runtime.fault.restart import CheckpointPolicy
    from schedcomp.runtime.resilient import ResilientTrainer

    for policy in ("rollback", "restart"):
        options = {"checkpoint": CheckpointPolicy(tmp_path / policy, 1)} if policy == "restart" else {}
        rt = ResilientTrainer(PlanCache.load(recut_cache), lambda s, n: nn.Linear(2, 2), lambda y, t: y,
                              lambda p: None, lambda i: None, session=object(), policy=policy, **options)
        assert rt.plan_for(Topology.of(PP, DP, [Worker(1, 1)])).cut  # served, not refused


def test_a_plan_function_serving_a_re_cut_plan_is_refused_as_it_serves_it(tmp_path: Path) -> None:
    whole, recut = compile(PP, DP, M), compile(PP, DP, M, failed=["1:1"], recut=True, solver="greedy")
    lossy = trainer(lambda t: recut if t.failed else whole, tmp_path, "lossy")  # not known in advance
    assert lossy.plan_for(whole.topology) is whole
    with pytest.raises(RuntimeSetupError, match="the lossy policy works with whole micro-batches"):
        lossy.plan_for(recut.topology)


def test_a_cache_whose_index_says_whole_cannot_slip_a_re_cut_plan_past_the_refusal(recut_cache: Path,
                                                                                 tmp_path: Path) -> None:
    # The index says whole micro-batches; the lossy policy reads every plan at construction (to refuse plans
    # that move layers), and reading checks each against the index: refused there too, not at a failure.
    with pytest.raises(PlanFormatError, match="differs from the one the index gives"):
        trainer(PlanCache.load(copy_cache(recut_cache, tmp_path, as_whole)), tmp_path, "lossy")


# ---- batches too small for a re-cut plan: refused at the first iteration, not at the failure -------------------


def test_a_batch_too_small_for_a_piece_of_a_cached_plan_is_refused_before_any_plan_is_read(recut_cache: Path,
                                                                                         tmp_path: Path) -> None:
    cache = PlanCache.load(recut_cache)
    pieces = trainer(cache, tmp_path, "rollback").plans.pieces
    assert pieces.cuts == list(cache.cuts.values()) and not cache.plans  # the index's cuts (pieces of 1/2)
    chunks = DP * M
    pieces.check((torch.zeros(2 * chunks, 1), None), DP, M)  # 2 rows per micro-batch: 1 per piece
    assert pieces.per == 2
    with pytest.raises(RuntimeSetupError, match=r"^a re-cut plan this job may switch to has a piece that is a piece "
                                                r"of 0.5 micro-batches, no whole sample of the 1 per micro-batch \(a "
                                                r"batch of 9 rows\): use a larger batch"):
        pieces.check((torch.zeros(chunks, 1), None), DP, M)
    pieces.check((torch.zeros(chunks + 1, 1), None), DP, M)  # does not divide: the iteration refuses it
    assert pieces.checked == {2 * chunks}


def test_a_better_plan_whose_pieces_do_not_fit_the_batches_is_not_switched_to(monkeypatch) -> None:
    from schedcomp.runtime.data import PieceRows
    from schedcomp.runtime.fault import switches

    monkeypatch.setattr(switches, "follow", lambda rt: None)  # the switch's collective part: no job here
    plan = compile(PP, DP, M, failed=["1:1"], recut=True, solver="greedy")
    for per, policy, switched in ((1, RollbackPolicy(), False), (2, RollbackPolicy(), True), (2, LossyPolicy(), False)):
        # pieces of half a micro-batch: 2 rows per micro-batch hold them; the lossy policy runs whole ones only
        used: list = []
        pieces = PieceRows([], {2 * DP * M}, per=per)
        rt = SimpleNamespace(better=SimpleNamespace(due=lambda view, completed: plan), session=SimpleNamespace(),
                             plans=SimpleNamespace(pieces=pieces, refuse_cut=lambda p: None), policy=policy,
                             trainer=SimpleNamespace(use_plan=used.append), report=SimpleNamespace(improved=[]))
        rt.session.view = None
        switches.improve(rt, 3)
        assert used == ([plan] if switched else []) and rt.report.improved == ([4] if switched else []), per
        # a plan switched to joins the cuts every batch size is checked against, sizes seen before included
        assert pieces.cuts == ([plan.cut] if switched else [])
        assert pieces.checked == (set() if switched else {2 * DP * M})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_ledger_stays_exact_in_the_all_reduce_whatever_the_gradients_dtype(dtype: torch.dtype) -> None:
    # A re-cut plan's ledger counts rows (257 here); bf16 holds integers exactly only up to 256, so a ledger
    # riding in bf16 gradients would read 256. The all-reduce runs in a real gloo world of one.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        grads = torch.arange(4, dtype=dtype)
        got: list[torch.Tensor] = []
        stage = SimpleNamespace(params=[object()], numel=4, flat_grads=lambda: grads.clone(), set_flat_grads=got.append)
        comm = SimpleNamespace(stage_group=lambda workers: dist.group.WORLD, wait=lambda work: work.wait())
        plan = SimpleNamespace(topology=Topology.of(1, 2), partitions=None)
        ledger = torch.tensor([257.0, 1.0, 4099.0], dtype=torch.float64)
        it = SimpleNamespace(comm=comm, plan=plan, worker=Worker(0, 0), stages={0: stage}, ledger=ledger,
                             units=Layout.of(plan))  # type: ignore[arg-type]
        HANDLERS[InstrKind.ALLREDUCE](it, None)  # type: ignore[arg-type]
    finally:
        dist.destroy_process_group()
    assert ledger.tolist() == [257.0, 1.0, 4099.0]
    assert len(got) == 1 and got[0].dtype == dtype and got[0].tolist() == grads.tolist()


def test_a_plan_functions_re_cut_plan_is_checked_against_the_batches_as_it_is_served(tmp_path: Path) -> None:
    # A plain function (e.g. `lambda t: lookup_or_repair(cache, t)`) says nothing in advance: its re-cut plan is
    # checked against the batch size when served, on every worker alike, in one line (not a ValueError in the
    # middle of the recovery's iteration), and joins the cuts later batch sizes are checked against.
    whole, recut = compile(PP, DP, M), compile(PP, DP, M, failed=["1:1"], recut=True, solver="greedy")
    rt = trainer(lambda t: recut if t.failed else whole, tmp_path, "rollback")
    rt.plans.pieces.check((torch.zeros(DP * M, 1), None), DP, M)  # one row per micro-batch: half-pieces hold none
    with pytest.raises(RuntimeSetupError, match=r"the plan for failed workers 1:1 has a piece that is a piece of 0.5 "
                                                r"micro-batches, no whole sample of the 1 per micro-batch"):
        rt.plan_for(recut.topology)
    assert rt.plans.pieces.cuts == [recut.cut]
    rt.plans.pieces.per = 2
    assert rt.plan_for(recut.topology) is recut  # two rows per micro-batch hold half-pieces
