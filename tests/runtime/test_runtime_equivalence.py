"""Multi-process runtime runs (CPU, gloo) equal a single-process reference on the same global batch.

Each launch runs several configurations in one set of processes (fresh trainer each) to keep
start-up cost down; every process saves its stages' parameters (every chunk it holds, with virtual
stages) and losses, and the test compares them with one model trained on the whole batch in this
process. float64: 1e-10, float32: 1e-5.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from momentum import Momentum
from torch import Tensor, nn

from schedcomp import CostModel, Op, OpKind, Order, Plan, Topology, Worker
from schedcomp.check import check
from schedcomp.compiler import compile
from schedcomp.errors import ScheduleError
from schedcomp.ir import InstrKind
from schedcomp.lower import lower
from schedcomp.profile import profile_costs, read_trace
from schedcomp.runtime.launch import spawn
from schedcomp.schedules import fault_free_order

pytestmark = pytest.mark.slow  # every test spawns a process group

H, SEQ, ROWS, ITERATIONS = 8, 3, 2, 3  # hidden, sequence length, rows per micro-batch, steps
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


class Block(nn.Module):
    """A stage: Linear-GELU-Linear with a residual, LayerNorm and a position embedding.

    Stages pass a tuple (hidden, positions): a float tensor that gets a gradient and an integer
    one that does not. The last stage returns the hidden state alone.
    """

    def __init__(self, last: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(H, 2 * H)
        self.fc2 = nn.Linear(2 * H, H, bias=False)
        self.norm = nn.LayerNorm(H)
        self.pos = nn.Embedding(SEQ, H)
        self.last = last

    def forward(self, x: Tensor, positions: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        h = self.norm(x + self.fc2(F.gelu(self.fc1(x))) + self.pos(positions))
        return h if self.last else (h, positions)


def build_block(stage: int, pp: int, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(1000 + stage)
    return Block(stage == pp - 1).to(dtype)


def make_batch(chunks: int, dtype: torch.dtype) -> tuple[tuple[Tensor, Tensor], Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(chunks * ROWS, SEQ, H, generator=g, dtype=dtype)
    positions = torch.randint(0, SEQ, (chunks * ROWS, SEQ), generator=g)
    y = torch.randn(chunks * ROWS, SEQ, H, generator=g, dtype=dtype)
    return (x, positions), y


def make_optimizer(params: Iterable[nn.Parameter]) -> Momentum:
    return Momentum(params)


@dataclass(frozen=True)
class Config:
    """One training run: `plans[i]` is used from iteration `switch[i]` on."""

    name: str
    plans: tuple[Plan, ...]
    dtype: torch.dtype = torch.float64
    switch: tuple[int, ...] = (0,)
    profile: bool = False


def run_configs(rank: int, configs: list[Config], outdir: str) -> None:
    """In each process: train every configuration, save this stage's parameters and the losses."""
    from schedcomp.runtime import PipelineTrainer

    for config in configs:
        first = config.plans[0]
        stages, dp = first.topology.stages, first.topology.dp
        trainer = PipelineTrainer(first, functools.partial(build_block, pp=stages, dtype=config.dtype), F.mse_loss,
                                  make_optimizer, profile=config.profile)
        batch = make_batch(dp * first.microbatches, config.dtype)
        losses = []
        for i in range(ITERATIONS):
            if i in config.switch[1:]:
                trainer.use_plan(config.plans[config.switch.index(i)])
            losses.append(trainer.step(batch))
        result = {"worker": str(trainer.worker), "losses": [float(v) for v in losses],
                  "states": {s: stage.module.state_dict() for s, stage in trainer.stages.items()},
                  "active": trainer.worker in trainer.plan.streams}
        if config.profile:
            trainer.save_trace(Path(outdir) / f"{config.name}.trace.json")
        torch.save(result, Path(outdir) / f"{config.name}.{rank}.pt")


def reference(pp: int, chunks: int, dtype: torch.dtype,
              batch: tuple[tuple[Tensor, Tensor], Tensor] | None = None) -> tuple[list[float], list[dict[str, Tensor]]]:
    """Train the whole model (`pp` stages) in this process on the global batch (`make_batch`'s unless given);
    return losses and per-stage states."""
    stages = [build_block(s, pp, dtype) for s in range(pp)]
    params = [p for m in stages for p in m.parameters()]
    optimizer = make_optimizer(params)
    (x, positions), y = make_batch(chunks, dtype) if batch is None else batch
    losses = []
    for _ in range(ITERATIONS):
        out: Tensor | tuple[Tensor, Tensor] = (x, positions)
        for m in stages:
            out = m(*out) if isinstance(out, tuple) else m(out)
        assert isinstance(out, Tensor)
        loss = F.mse_loss(out, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, [m.state_dict() for m in stages]


def check_config(config: Config, outdir: Path) -> None:
    plan = config.plans[0]
    want_losses, want_states = reference(plan.topology.stages, plan.topology.dp * plan.microbatches, config.dtype)
    tol = TOLERANCE[config.dtype]
    results = [torch.load(f) for f in sorted(outdir.glob(f"{config.name}.[0-9]*.pt"))]
    assert len(results) == len(plan.workers), f"{config.name}: {len(results)} results for {len(plan.workers)} workers"
    for result in results:
        assert result["losses"] == pytest.approx(want_losses, abs=tol, rel=0), f"{config.name} {result['worker']}"
        if not result["active"]:
            continue  # a failed worker's process idles: its parameters are stale by design
        place = int(result["worker"].split(":")[1])
        assert sorted(result["states"]) == list(plan.topology.chunks_of(place))
        for stage, state in result["states"].items():
            for name, want in want_states[stage].items():
                err = (state[name] - want).abs().max().item()
                assert err <= tol, f"{config.name}: {result['worker']} stage {stage} {name} is off by {err:.3g}"


def fault_free(family: str, pp: int, dp: int, microbatches: int) -> Plan:
    return lower(fault_free_order(family, Topology.of(pp, dp), microbatches), CostModel.uniform(pp))


def launch(configs: list[Config], nprocs: int, tmp_path: Path, timeout: float = 150.0) -> None:
    spawn(run_configs, nprocs, (configs, str(tmp_path)), timeout=timeout)
    for config in configs:
        check_config(config, tmp_path)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("pp", "dp"), [(4, 1), (2, 2)])
def test_fault_free_families_match_reference(pp: int, dp: int, tmp_path: Path) -> None:
    plans = {f: fault_free(f, pp, dp, 2 * pp) for f in ("1f1b", "zb-h1", "zb-h2")}
    configs = [Config(f"{f}-f64", (plan,)) for f, plan in plans.items()]
    configs += [Config(f"{f}-f32", (plan,), dtype=torch.float32) for f, plan in plans.items()]
    # a plan switch at an iteration boundary (fused backward to split backward) changes nothing
    configs.append(Config("switch", (plans["1f1b"], plans["zb-h2"]), switch=(0, 2)))
    configs.append(Config("traced", (plans["zb-h1"],), profile=True))
    launch(configs, pp * dp, tmp_path)
    check_trace(plans["zb-h1"], tmp_path / "traced.trace.json")


def check_trace(plan: Plan, path: Path) -> None:
    """The measured trace has every instruction once per iteration, in causal order, and profiles."""
    spans = read_trace(path)
    for w, stream in plan.streams.items():
        mine = sorted((s for s in spans if s.worker == w), key=lambda s: (s.iteration, s.index))
        assert [(s.iteration, s.index) for s in mine] == [(i, k) for i in range(ITERATIONS) for k in range(len(stream))]
        assert all(s.instruction == stream[s.index] for s in mine)
        blocking = [s for s in mine if s.instruction.is_compute or s.instruction.op is None]
        for a, b in itertools.pairwise(blocking):
            assert a.start <= a.end <= b.start, f"{w}: {a.instruction} and {b.instruction} overlap"
    ends = {(s.iteration, s.instruction.kind, s.instruction.op.key): s for s in spans if s.instruction.is_compute}
    for (i, kind, (p, m, stage)), s in ends.items():  # one clock on one host: data dependencies show
        if kind is InstrKind.F and stage > 0:
            assert ends[(i, kind, (p, m, stage - 1))].end <= s.start
        if kind is InstrKind.B and stage < plan.topology.stages - 1:
            assert ends[(i, kind, (p, m, stage + 1))].end <= s.start
    for s in spans:
        if s.instruction.kind in (InstrKind.SEND_ACT, InstrKind.SEND_GRAD):
            assert s.end >= s.start
    costs = profile_costs([spans])  # with virtual stages: one entry per chunk (pp x chunks)
    assert costs.pp == plan.topology.stages
    assert all(t > 0 for t in (*costs.forward, *costs.backward_input, *costs.backward_weight))


def rerouted(pp: int, dp: int, microbatches: int, failed: tuple[int, int]) -> Plan:
    """A re-routed plan built by hand: the failed worker's micro-batches run on a peer of its stage.

    Every worker runs its ops in the order of one global sequence (each micro-batch's F down the
    pipeline, B back up, then its W), so the order cannot deadlock; B/W are split.
    """
    topology = Topology.of(pp, dp, [failed])
    runner = {(p, s): Worker(p, s) if Worker(p, s) not in topology.failed else topology.stage_group(s)[0]
              for p in range(dp) for s in range(pp)}
    ops: dict[Worker, list[Op]] = {w: [] for w in topology.live_workers}
    for m in range(microbatches):
        for p in range(dp):
            sequence = [Op(OpKind.F, p, m, s) for s in range(pp)]
            sequence += [Op(OpKind.B, p, m, s) for s in reversed(range(pp))]
            sequence += [Op(OpKind.W, p, m, s) for s in range(pp)]
            for op in sequence:
                ops[runner[(p, op.stage)]].append(op)
    plan = lower(Order(topology, microbatches, {w: tuple(o) for w, o in ops.items()}, "rerouted"),
                 CostModel.uniform(pp))
    check(plan)
    return plan


def adaptive(pp: int, dp: int, microbatches: int, failed: tuple[int, int]) -> list[Plan]:
    """The compiler's adaptive plan for this failure, when the build has one (issue 3)."""
    try:
        return [compile(pp, dp, microbatches=microbatches, failed=[failed], schedule="adaptive", time_limit=5.0)]
    except ScheduleError:
        return []


def rerouted_ops(plan: Plan) -> int:
    """How many compute ops run away from their home pipeline."""
    return sum(op.pipeline != w.pipeline for w in plan.workers for op in plan.compute_ops(w))


@pytest.mark.timeout(240)
def test_rerouted_plans_match_reference_pp4_dp2(tmp_path: Path) -> None:
    """7 processes for the 7 live workers: ranks map to live workers in sorted order."""
    pp, dp, failed = 4, 2, (1, 2)
    plans = [rerouted(pp, dp, 4, failed), *adaptive(pp, dp, 4, failed)]
    assert all(rerouted_ops(plan) > 0 for plan in plans)
    launch([Config(f"rerouted{i}", (plan,)) for i, plan in enumerate(plans)], pp * dp - 1, tmp_path)


@pytest.mark.timeout(240)
def test_switch_to_rerouted_plan_matches_reference_pp2_dp3(tmp_path: Path) -> None:
    """6 processes: fault-free for one iteration, then the failed worker's process idles on a re-routed plan
    (built by hand, compiled, or the fault-free plan repaired around the failure: `schedcomp.repair`)."""
    from schedcomp.repair import repair

    pp, dp, failed = 2, 3, (0, 1)
    before = fault_free("zb-h1", pp, dp, 4)
    plans = [rerouted(pp, dp, 4, failed), *adaptive(pp, dp, 4, failed), repair(before, failed)]
    assert all(rerouted_ops(plan) > 0 for plan in plans)
    launch([Config(f"switch{i}", (before, plan), switch=(0, 1)) for i, plan in enumerate(plans)], pp * dp, tmp_path)


@pytest.mark.timeout(240)
def test_virtual_stage_plans_match_reference(tmp_path: Path) -> None:
    """Interleaved 1F1B and ZB-V at pp 2 dp 2 and pp 4 dp 1 (four processes each, one launch): two chunks
    per process, local hand-offs at the turn of the V, one all-reduce over both chunks' gradients (dp 2),
    every chunk stepped; the same model as one process."""
    plans = {(f, pp): compile(pp, 4 // pp, 2 * pp, schedule=f, chunks=2)
             for f in ("interleaved-1f1b", "zb-v") for pp in (2, 4)}
    assert all(plan.topology.chunks == 2 for plan in plans.values())
    configs = [Config(f"{f}-pp{pp}", (plan,)) for (f, pp), plan in plans.items()]
    configs.append(Config("traced", (plans[("zb-v", 2)],), profile=True))
    launch(configs, 4, tmp_path)
    check_trace(plans[("zb-v", 2)], tmp_path / "traced.trace.json")


@pytest.mark.timeout(240)
def test_rerouted_virtual_stage_plans_match_reference(tmp_path: Path) -> None:
    """Adaptive re-routing with chunks: worker 1:0 of pp 2, dp 2 failed, two chunks per worker; the
    slots of both chunks it held run on 0:0, which holds the same chunks. Three processes for the
    three live workers, interleaved and V placements, the same model as one process."""
    plans = [compile(2, 2, 4, schedule=f, chunks=2, failed=[(1, 0)]) for f in ("interleaved-1f1b", "zb-v")]
    assert [plan.topology.placement for plan in plans] == ["loop", "v"]
    assert all(plan.topology.chunks == 2 and rerouted_ops(plan) > 0 for plan in plans)
    launch([Config(f"rerouted-{plan.topology.placement}", (plan,)) for plan in plans], 3, tmp_path)

