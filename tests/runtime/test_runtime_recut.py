"""Re-cut micro-batches run exactly: unequal pieces, each loss weighted by its samples, equal the
single-process model on the same global batch (CPU, gloo, float64, 1e-10).

The model, optimizer and single-process reference are `test_runtime_equivalence`'s; the batch has more rows per
micro-batch so that every piece holds whole samples, and some pieces round to unequal row counts. Also a plan
that re-cuts and moves a layer boundary at once (`compile(..., layers=, recut=True)`), on an `nn.Sequential`.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from saved_layers import compare_saved
from test_runtime_equivalence import ITERATIONS, SEQ, H, build_block, make_optimizer, reference
from torch import Tensor, nn

from schedcomp import CostModel, Plan, Topology
from schedcomp.adaptive import solve
from schedcomp.check import check
from schedcomp.compiler import compile
from schedcomp.cut import Cut
from schedcomp.lower import lower
from schedcomp.runtime.launch import spawn
from schedcomp.solvers.problem import Problem

ROWS = 7  # samples per regular micro-batch: pieces of 4/7, 8/7 or 3/7 of one hold whole samples
TOL = 1e-10
DTYPE = torch.float64


def make_batch(chunks: int) -> tuple[tuple[Tensor, Tensor], Tensor]:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(chunks * ROWS, SEQ, H, generator=g, dtype=DTYPE)
    positions = torch.randint(0, SEQ, (chunks * ROWS, SEQ), generator=g)
    y = torch.randn(chunks * ROWS, SEQ, H, generator=g, dtype=DTYPE)
    return (x, positions), y


def run_plan(rank: int, plan: Plan, outdir: str) -> None:
    """In each process: train on `plan`, save this worker's stage parameters and losses."""
    from schedcomp.runtime import PipelineTrainer

    pp, dp = plan.topology.pp, plan.topology.dp
    trainer = PipelineTrainer(plan, functools.partial(build_block, pp=pp, dtype=DTYPE), F.mse_loss, make_optimizer)
    batch = make_batch(dp * plan.microbatches)
    losses = [float(trainer.step(batch)) for _ in range(ITERATIONS)]
    result = {"worker": str(trainer.worker), "losses": losses, "state": trainer.stage.module.state_dict()}
    torch.save(result, Path(outdir) / f"{rank}.pt")


def run_and_compare(plan: Plan, tmp_path: Path) -> None:
    spawn(run_plan, len(plan.workers), (plan, str(tmp_path)), timeout=150.0)
    chunks = plan.topology.dp * plan.microbatches
    want_losses, want_states = reference(plan.topology.pp, chunks, DTYPE, make_batch(chunks))
    results = [torch.load(f) for f in sorted(tmp_path.glob("*.pt"))]
    assert sorted(r["worker"] for r in results) == sorted(map(str, plan.workers))
    for result in results:
        assert result["losses"] == pytest.approx(want_losses, abs=TOL, rel=0), result["worker"]
        stage = int(result["worker"].split(":")[1])
        for name, want in want_states[stage].items():
            err = (result["state"][name] - want).abs().max().item()
            assert err <= TOL, f"{result['worker']} {name} is off by {err:.3g}"


def recut_plan() -> Plan:
    """pp 2, dp 3, M 3, worker 1:1 failed: 3 micro-batches over 2 peers, re-cut to 1.5 each."""
    plan = compile(2, 3, 3, failed=["1:1"], recut=True, memory_limit=None)
    assert plan.cut, "the compiler kept whole micro-batches: this test needs a re-cut plan"
    return plan


def test_recut_plan_has_unequal_pieces() -> None:
    """The plan the runtime test runs re-cuts the failed pipeline into pieces of unequal rows (cheap: no processes)."""
    plan = recut_plan()
    sizes = plan.cut.sizes(1, plan.microbatches)
    rows = [plan.cut.rows(1, m, ROWS) for m in range(len(sizes))]
    assert sum(stop - start for start, stop in rows) == plan.microbatches * ROWS
    assert len(set(sizes)) > 1 or sizes[0] != 1.0  # not whole micro-batches
    assert all(stop > start for start, stop in rows)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_recut_plan_matches_reference(tmp_path: Path) -> None:
    """The compiler's re-cut plan (5 processes, one per live worker)."""
    run_and_compare(recut_plan(), tmp_path)


def hand_cut_plan() -> Plan:
    """Fault-free pp 2, dp 2, M 3 with pipeline 1 cut into 5 pieces whose boundaries fall between samples."""
    topology = Topology.of(2, 2)
    costs = CostModel.uniform(2)
    cut = Cut.of({1: (0.0, 0.3, 0.9, 1.7, 2.1, 3.0)})
    plan = lower(solve(Problem(topology, 3, costs, cut=cut), solver="greedy").order(), costs)
    check(plan)
    return plan


def test_hand_cut_rows_are_rounded_and_cover_the_share_once() -> None:
    plan = hand_cut_plan()
    rows = [plan.cut.rows(1, m, ROWS) for m in range(5)]
    assert rows == [(0, 2), (2, 6), (6, 12), (12, 15), (15, 21)]  # 2.1, 6.3, 11.9, 14.7 rounded


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_hand_cut_plan_with_rounded_rows_matches_reference(tmp_path: Path) -> None:
    """Each piece's loss weighted by its own row count, every sample once (4 processes)."""
    run_and_compare(hand_cut_plan(), tmp_path)


# ---- re-cut pieces on a re-partitioned model ---------------------------------------------------------------

LAYERS = 6  # blocks of the nn.Sequential below: 3 per stage in the job's own cut


def sequential() -> nn.Sequential:
    torch.manual_seed(5)
    return nn.Sequential(*(nn.Sequential(nn.Linear(H, H), nn.Tanh()) for _ in range(LAYERS))).to(DTYPE)


def adam(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


def sequential_batch(chunks: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(12)
    return (torch.randn(chunks * ROWS, H, generator=g, dtype=DTYPE),
            torch.randn(chunks * ROWS, H, generator=g, dtype=DTYPE))


def moved_and_cut_plan() -> Plan:
    """pp 2, dp 3, M 3, worker 1:1 failed, 3 layers per stage: the plan moves a layer off the stage that lost
    a worker and re-cuts the failed pipeline's micro-batches for the peers that take them."""
    plan = compile(2, 3, 3, failed=["1:1"], recut=True, layers=3, solver="greedy",  # (CP-SAT: 20 s more)
                   reform="never")  # (re-forming pipeline 1 is faster: this test is of moves and cuts)
    assert plan.cut and plan.partition == (4, 2), (plan.cut, plan.partition)
    return plan


def run_sequential(rank: int, plan: Plan, outdir: str) -> None:
    """In each process: train `sequential()` cut by the plan's partition; save each layer it holds."""
    from schedcomp.runtime import PipelineTrainer

    trainer = PipelineTrainer(plan, sequential(), F.mse_loss, adam)
    batch = sequential_batch(plan.topology.dp * plan.microbatches)
    losses = [float(trainer.step(batch)) for _ in range(ITERATIONS)]
    first = sum(trainer.partition[:trainer.worker.stage])
    held = {first + k: layer.state_dict() for k, layer in enumerate(trainer.stage.module)}
    torch.save({"worker": str(trainer.worker), "losses": losses, "held": held}, Path(outdir) / f"{rank}.pt")
    trainer.close()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_re_cut_pieces_on_a_moved_cut_match_one_process(tmp_path: Path) -> None:
    """Unequal pieces and a moved layer boundary at once (5 processes): every layer each worker holds and
    every loss equal one process training the whole model on the whole batch."""
    plan = moved_and_cut_plan()
    spawn(run_sequential, len(plan.workers), (plan, str(tmp_path)), timeout=150.0)
    model = sequential()
    optimizer = adam(model.parameters())
    x, y = sequential_batch(plan.topology.dp * plan.microbatches)
    want_losses = []
    for _ in range(ITERATIONS):
        loss = F.mse_loss(model(x), y)
        want_losses.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    seen = compare_saved(tmp_path, plan, model, want_losses)
    # stage 0 holds layers 0-3 in all three pipelines, stage 1 layers 4-5 in its two live ones
    assert seen == sorted([*range(4)] * 3 + [4, 5] * 2)
