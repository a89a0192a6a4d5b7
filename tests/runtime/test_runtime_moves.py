"""Layers move between workers at a plan switch that changes the partition (`runtime.moves`), exactly.

8 processes (pp 4, dp 2, CPU, gloo) train an 8-layer `nn.Sequential` of Linear + Tanh blocks (float64)
with Adam and an LR schedule: two iterations on partition (2, 2, 2, 2), then `use_plan` to (3, 1, 2, 2),
then to (1, 3, 3, 1) (layers move both ways, some two stages), two iterations each. Every rank's layers,
their Adam state (`step`, `exp_avg`, `exp_avg_sq`) and the learning rate equal one process's model after
the same six steps (1e-10). The same with virtual stages (interleaved 1F1B, pp 2, two chunks per worker:
layers move between chunks of different places). Also: who sends what (`plan_moves`) and the one-line refusals.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from schedcomp.compiler import compile
from schedcomp.errors import RecoveryError, RuntimeSetupError
from schedcomp.ir import Plan
from schedcomp.runtime.launch import spawn
from schedcomp.runtime.moves import Move, plan_moves
from schedcomp.topology import Topology, Worker

PP, DP, M, H, ROWS, LAYERS = 4, 2, 4, 6, 2, 8
CUTS = ((2, 2, 2, 2), (3, 1, 2, 2), (1, 3, 3, 1))  # two iterations on each
TOL = 1e-10


class Shifted(nn.Module):
    """Adds a per-layer constant held in a non-persistent buffer (as a rotary embedding's `inv_freq` or a
    causal mask is): not in `state_dict`, so a layer that leaves a worker and comes back must get it too."""

    def __init__(self, shift: float) -> None:
        super().__init__()
        self.register_buffer("shift", torch.full((H,), shift, dtype=torch.float64), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.shift


def model() -> nn.Sequential:
    torch.manual_seed(7)
    return nn.Sequential(*(nn.Sequential(nn.Linear(H, H), Shifted(0.1 * (k + 1)), nn.Tanh())
                           for k in range(LAYERS))).double()


def adam(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


def schedule(optimizer: torch.optim.Optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)


def batch(i: int, chunks: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(40 + i)
    return (torch.randn(chunks * ROWS, H, generator=g, dtype=torch.float64),
            torch.randn(chunks * ROWS, H, generator=g, dtype=torch.float64))


def plan_with(cut: tuple[int, ...], schedule_name: str = "zb-h1", pp: int = PP, dp: int = DP) -> Plan:
    return dataclasses.replace(compile(pp, dp, M, schedule=schedule_name), partition=cut)


def held(trainer) -> dict[int, tuple[nn.Module, torch.optim.Optimizer]]:
    """Every layer the trainer holds (all its chunks), by model index: the layer and its stage's optimizer."""
    out = {}
    for s, stage in trainer.stages.items():
        first = sum(trainer.partition[:s])
        out.update({first + k: (layer, stage.optimizer) for k, layer in enumerate(stage.module)})
    return out


def train(rank: int, plans: list[Plan], outdir: str) -> None:
    from schedcomp.runtime import PipelineTrainer

    torch.set_num_threads(1)
    whole = model()
    trainer = PipelineTrainer(plans[0], whole, F.mse_loss, adam, lr_scheduler=schedule)
    chunks = plans[0].topology.dp * plans[0].microbatches
    i, kept = 0, True
    ever: set[int] = set()  # layers this worker held at some time
    for plan in plans:
        if plan is not plans[0]:
            before, old = {id(p) for stage in trainer.stages.values() for p in stage.params}, set(held(trainer))
            trainer.use_plan(plan)
            # the layers it keeps are the same objects: their parameters were not copied
            kept &= all(id(p) in before for layer in old & set(held(trainer)) for p in whole[layer].parameters())
        ever |= set(held(trainer))
        for _ in range(2):
            float(trainer.step(batch(i, chunks)))
            i += 1
    layers = {}
    for layer, (module, optimizer) in held(trainer).items():  # each layer's own share of its stage's Adam state
        index = {id(p): n for n, p in enumerate(optimizer.param_groups[0]["params"])}
        state = optimizer.state_dict()["state"]
        layers[layer] = {"module": module.state_dict(), "optimizer": [state[index[id(p)]] for p in module.parameters()]}
    freed = all(t.is_meta for layer in ever - set(layers) for t in whole[layer].parameters())
    torch.save({"held": layers, "lr": trainer.stage.optimizer.param_groups[0]["lr"], "kept": kept, "freed": freed,
                "partition": trainer.partition}, Path(outdir) / f"{rank}.pt")
    trainer.close()


def reference(steps: int, chunks: int) -> tuple[nn.Sequential, torch.optim.Optimizer]:
    whole = model()
    optimizer = adam(whole.parameters())
    scheduler = schedule(optimizer)
    for i in range(steps):
        x, y = batch(i, chunks)
        F.mse_loss(whole(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return whole, optimizer


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("family", "pp", "dp"), [("zb-h1", PP, DP), ("interleaved-1f1b", 2, 1)])
def test_layers_move_with_their_adam_state_both_ways(tmp_path: Path, family: str, pp: int, dp: int) -> None:
    # interleaved-1f1b: 2 chunks per worker, virtual stages 0, 2 on place 0 and 1, 3 on place 1
    plans = [plan_with(cut, family, pp, dp) for cut in CUTS]
    assert plans[0].topology.stages == len(CUTS[0])
    spawn(train, pp * dp, (plans, str(tmp_path)), timeout=240)
    want, optimizer = reference(2 * len(CUTS), dp * M)
    state = optimizer.state_dict()["state"]
    index = {id(p): n for n, p in enumerate(want.parameters())}
    results = [torch.load(tmp_path / f"{r}.pt") for r in range(pp * dp)]
    for rank, got in enumerate(results):
        assert got["partition"] == CUTS[-1] and got["kept"] and got["freed"], rank
        assert got["lr"] == pytest.approx(optimizer.param_groups[0]["lr"], abs=1e-15)
        assert got["lr"] != 0.01  # the schedule stepped: it was carried, not rebuilt
        for layer, mine in got["held"].items():
            for name, value in want[layer].state_dict().items():
                assert (mine["module"][name] - value).abs().max().item() <= TOL, (rank, layer, name)
            for p, moved in zip(want[layer].parameters(), mine["optimizer"], strict=True):
                expected = state[index[id(p)]]
                assert set(moved) == set(expected) == {"step", "exp_avg", "exp_avg_sq"}
                assert float(moved["step"]) == float(expected["step"]) == 2 * len(CUTS)
                for key in ("exp_avg", "exp_avg_sq"):
                    assert (moved[key] - expected[key]).abs().max().item() <= TOL, (rank, layer, key)
    # every layer is held by exactly the workers of its stage under the last cut
    holders = sorted(layer for got in results for layer in got["held"])
    assert holders == sorted(list(range(LAYERS)) * dp)


def idle_then_back(rank: int, plans: list[Plan], outdir: str) -> None:
    """Train on each plan in turn (an idle process steps nothing); record what each process holds after each
    switch against what its cut says it holds."""
    from schedcomp.runtime import PipelineTrainer

    torch.set_num_threads(1)
    trainer = PipelineTrainer(plans[0], model(), F.mse_loss, adam)
    chunks, records = plans[0].topology.dp * plans[0].microbatches, []
    for i, plan in enumerate(plans):
        if i:
            trainer.use_plan(plan)
        records.append((sorted(held(trainer)), list(range(sum(trainer.partition[:trainer.worker.stage]),
                                                            sum(trainer.partition[:trainer.worker.stage + 1])))))
        float(trainer.step(batch(i, chunks)))
    torch.save(records, Path(outdir) / f"{rank}.pt")
    trainer.close()


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_process_idling_on_a_plan_that_moves_layers_holds_what_its_cut_says(tmp_path: Path) -> None:
    # 0:1 idles on the middle plan, whose partition moves layer 2 off place 1: its process must give it away
    # like every other (it was current, and the records of what each process holds must stay true), else a
    # later switch labels its layers by the wrong cut and hands one layer's Adam state to another.
    plans = [plan_with((2, 2, 2, 2)), dataclasses.replace(compile(PP, DP, M, failed=["0:1"], memory_limit=None),
                                                         partition=(3, 1, 2, 2)), plan_with((2, 2, 2, 2))]
    spawn(idle_then_back, PP * DP, (plans, str(tmp_path)), timeout=180)
    for rank in range(PP * DP):
        for step, (holds, says) in enumerate(torch.load(tmp_path / f"{rank}.pt")):
            assert holds == says, (rank, step)


def test_a_worker_idle_on_the_old_plan_is_never_a_source() -> None:
    # 0:1's layers missed the old plan's steps: 0:0 takes layer 2 from the other pipeline's holder
    moves = plan_moves((2, 2, 2, 2), (3, 1, 2, 2), everyone(), stale={Worker(0, 1)})
    assert moves == (Move(Worker(1, 1), Worker(0, 0), (2,)), Move(Worker(1, 1), Worker(1, 0), (2,)))


# ---- who sends what -----------------------------------------------------------------------------------


def everyone(failed: frozenset[Worker] = frozenset()) -> tuple[Worker, ...]:
    return tuple(sorted(Worker(d, s) for d in range(DP) for s in range(PP) if Worker(d, s) not in failed))


def test_each_pipeline_moves_its_own_layers() -> None:
    moves = plan_moves((2, 2, 2, 2), (3, 1, 2, 2), everyone())
    assert moves == (Move(Worker(0, 1), Worker(0, 0), (2,)), Move(Worker(1, 1), Worker(1, 0), (2,)))


def test_a_dead_holder_is_replaced_by_the_lowest_live_replica() -> None:
    live = everyone(frozenset({Worker(0, 1)}))
    moves = plan_moves((2, 2, 2, 2), (3, 1, 2, 2), live)
    assert moves == (Move(Worker(1, 1), Worker(0, 0), (2,)), Move(Worker(1, 1), Worker(1, 0), (2,)))
    with pytest.raises(RecoveryError, match="no live worker holds layer 2"):
        plan_moves((2, 2, 2, 2), (3, 1, 2, 2), everyone(frozenset({Worker(0, 1), Worker(1, 1)})))


def test_moves_are_ordered_by_receiver_then_source_and_go_two_stages() -> None:
    moves = plan_moves((3, 1, 2, 2), (1, 3, 3, 1), everyone())
    assert [(str(m.source), str(m.receiver), m.layers) for m in moves] == [
        ("0:0", "0:1", (1, 2)), ("0:3", "0:2", (6,)), ("1:0", "1:1", (1, 2)), ("1:3", "1:2", (6,))]
    assert plan_moves((2, 2, 2, 2), (2, 2, 2, 2), everyone()) == ()


def test_virtual_stages_move_between_places() -> None:
    topology = Topology.of(2, 1, chunks=2, placement="loop")  # virtual stages 0, 2 on place 0; 1, 3 on place 1
    live = (Worker(0, 0), Worker(0, 1))
    # layers 1 and 4 leave virtual stages 0 and 2 (place 0) for 1 and 3 (place 1): one message
    moves = plan_moves((2, 1, 2, 1), (1, 2, 1, 2), live, topology.place_of)
    assert moves == (Move(Worker(0, 0), Worker(0, 1), (1, 4)),)


# ---- refusals -----------------------------------------------------------------------------------------


def construct(plan: Plan, build, **options) -> None:
    from schedcomp.runtime import PipelineTrainer

    PipelineTrainer(plan, build, F.mse_loss, adam, process=(0, PP * DP, torch.device("cpu")), **options)


def test_a_partition_needs_a_sequential_of_its_length_and_no_other_cut() -> None:
    plan = plan_with((3, 1, 2, 2), "1f1b")
    with pytest.raises(RuntimeSetupError, match=r"holds 8 layers but the model has 6"):
        construct(plan, model()[:6])
    with pytest.raises(RuntimeSetupError, match=r"has 3 entries for its 4 stages"):
        construct(dataclasses.replace(plan, partition=(4, 2, 2)), model())
    with pytest.raises(RuntimeSetupError, match=r"pass the model as an nn\.Sequential"):
        construct(plan, lambda s: model()[2 * s: 2 * s + 2])
    with pytest.raises(RuntimeSetupError, match=r"layers_per_stage \[2, 2, 2, 2\] differs from the plan's partition"):
        construct(plan, model(), layers_per_stage=(2, 2, 2, 2))


def test_optimizers_that_do_not_split_per_layer_are_refused() -> None:
    from momentum import Momentum

    from schedcomp.runtime.moves import check_movable, layer_states
    from schedcomp.runtime.stage import Stage

    stage = Stage(0, 1, model()[:2], None, Momentum)
    with pytest.raises(RuntimeSetupError, match=r"Momentum's state_dict is not torch\.optim's"):
        layer_states(stage.module, stage.optimizer, 0)

    def two_groups(params) -> torch.optim.Optimizer:
        params = list(params)
        return torch.optim.SGD([{"params": params[:1]}, {"params": params[1:], "lr": 0.0}], lr=0.1)

    stage = Stage(0, 1, model()[:2], None, two_groups)
    with pytest.raises(RuntimeSetupError, match="has 2 param groups"):
        layer_states(stage.module, stage.optimizer, 0)
    # ... and the same checks run before training wherever plans may move layers (`ResilientTrainer`), so the
    # refusal never comes in the middle of a recovery
    with pytest.raises(RuntimeSetupError, match="has 2 param groups"):
        check_movable(Stage(0, 1, model()[:2], None, two_groups))
    with pytest.raises(RuntimeSetupError, match="exactly the stage's trainable parameters"):
        check_movable(Stage(0, 1, model()[:2], None, lambda params: adam(list(params)[:2])))
    shared = model()[:2]
    shared[1][0].weight = shared[0][0].weight
    with pytest.raises(RuntimeSetupError, match="share parameters"):
        check_movable(Stage(0, 1, shared, None, adam))
    check_movable(Stage(0, 1, model()[:2], None, adam))


def mismatched_cuts(rank: int, plan: Plan, outdir: str) -> None:
    from momentum import Momentum

    from schedcomp.runtime import PipelineTrainer

    trainer = PipelineTrainer(plan, nn.Sequential(*model()[:4]), F.mse_loss, Momentum)
    if rank == 1:
        trainer.cuts = ((3, 1),)  # as if a failure had interrupted a move after this worker's part (dp 1)
    try:
        trainer.use_plan(dataclasses.replace(plan, partition=(1, 3)))
    except RecoveryError as e:
        (Path(outdir) / f"{rank}.txt").write_text(str(e))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_workers_holding_different_cuts_refuse_to_move(tmp_path: Path) -> None:
    spawn(mismatched_cuts, 2, (plan_with((2, 2), "1f1b", 2, 1), str(tmp_path)), timeout=90)
    for rank in range(2):
        assert "hold different cuts of the model" in (tmp_path / f"{rank}.txt").read_text()


def test_every_worker_judges_per_layer_checkpoints_alike_from_the_whole_model() -> None:
    # `job_splits_per_layer` decides the checkpoint format of the whole job: a stage whose optimizer does not
    # split per layer, or a tensor setting, makes every worker write per-stage checkpoints, whichever it holds
    from schedcomp.runtime.moves import job_splits_per_layer

    net = model()
    assert job_splits_per_layer(net, CUTS[0], adam)

    def two_groups_on_stage_0(params):  # a separate group for the first stage's biases only
        params = list(params)
        if params[0] is net[0][0].weight:
            biases = [p for p in params if p.ndim == 1]
            rest = [p for p in params if p.ndim != 1]
            return torch.optim.Adam([{"params": rest}, {"params": biases, "weight_decay": 0.0}], lr=0.01)
        return adam(params)

    assert not job_splits_per_layer(net, CUTS[0], two_groups_on_stage_0)
    assert not job_splits_per_layer(net, CUTS[0], lambda params: torch.optim.Adam(params, lr=torch.tensor(0.01)))
    tied = model()
    tied[1][0].weight = tied[0][0].weight  # two layers of stage 0 share a weight
    assert not job_splits_per_layer(tied, CUTS[0], adam)
