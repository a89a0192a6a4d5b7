"""Re-formed pipelines (per-pipeline partitions, `runtime.layout`) run exactly.

A plan compiled with `reform=` gives the pipeline that lost a worker its own, shallower partition, its own share
of the global batch (rows by `Cut.global_rows`) and per-segment all-reduces over overlapping groups. Processes
(CPU, gloo, float64) train an `nn.Sequential` of Linear + Tanh blocks with Adam on it: every layer each worker
holds, and every loss, equal one process training the whole model on the whole batch (1e-10).
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from saved_layers import compare_saved
from torch import Tensor, nn

from schedcomp.compiler import compile
from schedcomp.errors import RuntimeSetupError
from schedcomp.ir import Plan
from schedcomp.runtime.launch import spawn
from schedcomp.runtime.layout import Layout, Reduction
from schedcomp.topology import Topology, Worker

H, ROWS, ITERATIONS = 4, 10, 3  # ROWS per regular micro-batch: every piece (0.8 or 0.9 of one) holds whole samples
TOL = 1e-10


def reformed_plan(failed: str = "1:1") -> Plan:
    """pp 3, dp 2, M 3, 2 layers per place, worker `failed` of pipeline 1 failed: that pipeline re-formed over
    its two other places (1:1: a gap its activations cross; 1:2: its loss on place 1), both pipelines' shares
    by throughput."""
    return compile(3, 2, 3, failed=[failed], layers=2, reform=(1,), memory_limit=None)


def model(layers: int) -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(*(nn.Sequential(nn.Linear(H, H), nn.Tanh()) for _ in range(layers))).double()


def adam(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


def batch(i: int, rows: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(20 + i)
    return (torch.randn(rows, H, generator=g, dtype=torch.float64),
            torch.randn(rows, H, generator=g, dtype=torch.float64))


def test_the_plan_is_re_formed_with_shares_other_than_m() -> None:
    plan = reformed_plan()
    assert plan.partitions == ((2, 2, 2), (3, 0, 3))
    shares = [plan.cut.share(d, plan.microbatches) for d in range(2)]
    assert all(abs(share - plan.microbatches) > 0.1 for share in shares), shares
    assert sum(shares) == pytest.approx(2 * plan.microbatches)
    rows = [plan.cut.global_rows(d, m, 2, plan.microbatches, ROWS)
            for d in range(2) for m in range(plan.cut.count(d, plan.microbatches))]
    assert rows[0][0] == 0 and rows[-1][1] == 2 * plan.microbatches * ROWS
    assert all(a[1] == b[0] and b[1] > b[0] for a, b in itertools.pairwise(rows))  # every row once


def test_segments_reduce_over_overlapping_groups_and_one_partition_over_stage_groups() -> None:
    layout = Layout.of(reformed_plan())
    w = Worker
    assert layout.reductions == (Reduction((w(0, 0), w(1, 0)), range(0, 2)), Reduction((w(0, 1), w(1, 0)), range(2, 3)),
                                 Reduction((w(0, 1), w(1, 2)), range(3, 4)), Reduction((w(0, 2), w(1, 2)), range(4, 6)))
    assert layout.ends(1, 0) == (True, False) and layout.ends(1, 2) == (False, True) and layout.span(1, 1) == range(0)
    shared = Layout.of(compile(3, 2, 3, failed=["1:1"], memory_limit=None))  # re-routed: one cut for all
    assert shared.reductions == tuple(Reduction(g, None) for g in ((w(0, 0), w(1, 0)), (w(0, 1),), (w(0, 2), w(1, 2))))


def train(rank: int, plan: Plan, outdir: str, max_grad_norm: float | None = None) -> None:
    """In each process: train on `plan`; save each layer this worker holds and the losses."""
    from schedcomp.runtime import PipelineTrainer

    layers = sum(plan.partitions[0])
    trainer = PipelineTrainer(plan, model(layers), F.mse_loss, adam, max_grad_norm=max_grad_norm)
    rows = plan.topology.dp * plan.microbatches * ROWS
    losses = [float(trainer.step(batch(i, rows))) for i in range(ITERATIONS)]
    trainer.settle()  # a step the global check holds is applied now
    first = trainer.held_layers.start
    held = {first + k: layer.state_dict() for k, layer in enumerate(trainer.stage.module)}
    torch.save({"worker": str(trainer.worker), "losses": losses, "held": held}, Path(outdir) / f"{rank}.pt")
    trainer.close()


def reference(layers: int, rows: int, steps: int, max_grad_norm: float | None = None,
              ) -> tuple[nn.Sequential, torch.optim.Optimizer, list[float]]:
    """One process training the whole model on the whole batches: the model, its optimizer, the losses
    (with `max_grad_norm`: and the gradient norms before clipping)."""
    net = model(layers)
    optimizer = adam(net.parameters())
    losses = []
    for i in range(steps):
        x, y = batch(i, rows)
        loss = F.mse_loss(net(x), y)
        losses.append(loss.item())
        loss.backward()
        if max_grad_norm is not None:
            norm = float(nn.utils.clip_grad_norm_(net.parameters(), max_grad_norm))
            assert norm > max_grad_norm, "this test needs every step clipped"
        optimizer.step()
        optimizer.zero_grad()
    return net, optimizer, losses


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_re_formed_plan_trains_as_one_process(tmp_path: Path) -> None:
    """5 processes: pipeline 1's workers hold 3 layers each, its loss on place 2, its activations crossing place 1."""
    plan = reformed_plan()
    spawn(train, len(plan.workers), (plan, str(tmp_path)), timeout=150.0)
    net, _, losses = reference(6, plan.topology.dp * plan.microbatches * ROWS, ITERATIONS)
    assert compare_saved(tmp_path, plan, net, losses) == sorted([*range(6)] * 2)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_global_norm_counts_each_segment_once(tmp_path: Path) -> None:
    """Clipping by the global norm (every step clipped): each segment's norm enters it from its lowest holder,
    so the norm is the whole model's, as `clip_grad_norm_` on one process gives."""
    plan, limit = reformed_plan(), 0.02
    spawn(train, len(plan.workers), (plan, str(tmp_path), limit), timeout=150.0)
    net, _, losses = reference(6, plan.topology.dp * plan.microbatches * ROWS, ITERATIONS, limit)
    assert compare_saved(tmp_path, plan, net, losses) == sorted([*range(6)] * 2)


# ---- a switch to a re-formed plan moves layers between pipelines of different depths --------------------


def fault_free_plan() -> Plan:
    plan = compile(3, 2, 3, layers=2, memory_limit=None)
    assert plan.partition == (2, 2, 2) and plan.partitions is None
    return plan


def train_and_switch(rank: int, plans: list[Plan], outdir: str) -> None:
    """Two fault-free iterations, then every process switches to the re-formed plan (worker 1:1's idles) and
    trains two more; save each layer held, with its Adam state, and whether kept layers stayed the same objects."""
    from schedcomp.runtime import PipelineTrainer

    before, after = plans
    whole = model(6)
    trainer = PipelineTrainer(before, whole, F.mse_loss, adam)
    rows = before.topology.dp * before.microbatches * ROWS
    for i in range(2):
        float(trainer.step(batch(i, rows)))
    old = {trainer.held_layers.start + k: layer for k, layer in enumerate(trainer.stage.module)}
    trainer.use_plan(after)
    for i in range(2, 4):
        float(trainer.step(batch(i, rows)))
    if trainer.worker in after.topology.failed:
        return  # idle since the switch: its layers are stale by design
    first = trainer.held_layers.start
    optimizer = trainer.stage.optimizer
    index = {id(p): n for n, p in enumerate(optimizer.param_groups[0]["params"])}
    state = optimizer.state_dict()["state"]
    held = {first + k: {"module": layer.state_dict(), "optimizer": [state[index[id(p)]] for p in layer.parameters()]}
            for k, layer in enumerate(trainer.stage.module)}
    kept = all(trainer.stage.module[layer - first] is module for layer, module in old.items() if layer in held)
    torch.save({"worker": str(trainer.worker), "held": held, "kept": kept}, Path(outdir) / f"{rank}.pt")
    trainer.close()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_switch_to_a_re_formed_plan_moves_layers_with_their_adam_state(tmp_path: Path) -> None:
    """6 processes, then 5 (worker 1:2 fails): pipeline 1 re-forms to (3, 3, 0), 1:0 taking layer 2 from its
    own pipeline's 1:1 and 1:1 taking layers 4 and 5 (the failed worker's) from pipeline 0's 0:2, with their
    Adam state, and 1:1 computing the loss from then on; every layer after four steps equals one process's."""
    plans = [fault_free_plan(), reformed_plan("1:2")]
    assert plans[1].partitions == ((2, 2, 2), (3, 3, 0))
    spawn(train_and_switch, 6, (plans, str(tmp_path)), timeout=150.0)
    net, optimizer, _ = reference(6, 2 * 3 * ROWS, 4)
    state = optimizer.state_dict()["state"]
    index = {id(p): n for n, p in enumerate(net.parameters())}
    results = [torch.load(f) for f in sorted(tmp_path.glob("*.pt"))]
    assert sorted(r["worker"] for r in results) == sorted(map(str, plans[1].workers))
    holders: dict[str, list[int]] = {}
    for got in results:
        assert got["kept"], got["worker"]
        holders[got["worker"]] = sorted(got["held"])
        for layer, mine in got["held"].items():
            for name, value in net[layer].state_dict().items():
                assert (mine["module"][name] - value).abs().max().item() <= TOL, (got["worker"], layer, name)
            for p, moved in zip(net[layer].parameters(), mine["optimizer"], strict=True):
                expected = state[index[id(p)]]
                assert float(moved["step"]) == float(expected["step"]) == 4
                for key in ("exp_avg", "exp_avg_sq"):
                    assert (moved[key] - expected[key]).abs().max().item() <= TOL, (got["worker"], layer, key)
    assert holders["1:0"] == [0, 1, 2] and holders["1:1"] == [3, 4, 5] and holders["0:2"] == [4, 5]


def test_layers_of_a_failed_worker_come_from_a_live_holder_in_another_pipeline() -> None:
    from schedcomp.runtime.moves import Move, plan_moves

    live = (Worker(0, 0), Worker(0, 1), Worker(0, 2), Worker(1, 0), Worker(1, 2))
    moves = plan_moves((2, 2, 2), ((2, 2, 2), (3, 0, 3)), live)
    assert moves == (Move(Worker(0, 1), Worker(1, 0), (2,)), Move(Worker(0, 1), Worker(1, 2), (3,)))
    assert plan_moves(((2, 2, 2), (3, 0, 3)), (2, 2, 2), live[:3]) == ()


# ---- resilient jobs: rollback runs them, the policies that keep stages in place refuse them ----------------


def test_a_resilient_job_takes_re_formed_plans_with_rollback_and_refuses_them_with_lossy_in_one_line() -> None:
    """From a function as it serves one (before any collective), and from a cache it reads at construction.
    (`tests/fault/test_fault_reformed.py` runs one: a cache's index says so before any plan is read.)"""
    from schedcomp.runtime.resilient import ResilientTrainer

    whole, reformed = fault_free_plan(), reformed_plan()

    def resilient(plans, policy: str = "rollback"):
        return ResilientTrainer(plans, model(6), F.mse_loss, adam, lambda i: None, session=object(), policy=policy)

    assert resilient(lambda t: reformed if t.failed else whole).plan_for(reformed.topology) is reformed
    served = resilient(lambda t: reformed if t.failed else whole, "lossy")
    assert served.plan_for(whole.topology) is whole
    with pytest.raises(RuntimeSetupError, match="re-formed pipelines") as exc:
        served.plan_for(reformed.topology)
    assert "\n" not in str(exc.value)

    class Held:  # a cache holding its plans in memory (as `PlanCache` after `preload`)
        def __init__(self) -> None:
            self.plans = {(): whole, (Worker(1, 1),): reformed}

        def lookup(self, topology):
            return self.plans[tuple(sorted(topology.failed))]

    resilient(Held())
    with pytest.raises(RuntimeSetupError, match="re-formed pipelines"):
        resilient(Held(), "lossy")


def test_a_resilient_job_refuses_a_plan_that_re_routes_beside_a_re_formed_pipeline_in_one_line() -> None:
    """A plan function or an edited cache may serve one (`check` allows it, `compile` does not make it): its
    places' checkpoint writers (each the lowest live pipeline) would leave layers unwritten."""
    from schedcomp.runtime.fault.policies import cut_of

    reformed = reformed_plan()
    assert cut_of(reformed, model(6)) == reformed.partitions
    # worker 0:0 failed too, but pipeline 0 keeps its layers at place 0 (its failure re-routed): a hybrid
    hybrid = dataclasses.replace(reformed, topology=Topology.of(3, 2, ["0:0", "1:1"]))
    with pytest.raises(RuntimeSetupError, match="re-routes around the failures of pipeline 0") as exc:
        cut_of(hybrid, model(6))
    assert "\n" not in str(exc.value)
