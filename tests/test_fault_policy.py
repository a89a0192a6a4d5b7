"""Rollback, lossy-forward and switch decisions (pure), and rollback carried out on a real model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from schedcomp.costs import CostModel
from schedcomp.errors import RecoveryError
from schedcomp.ir import Instruction, Op, OpKind, Plan
from schedcomp.runtime.fault.policy import (
    Rollback,
    lossy_decision,
    rollback_decision,
    runners,
    switch_iteration,
)
from schedcomp.runtime.fault.transfer import StepSnapshot
from schedcomp.topology import Topology, Worker

# ---- rollback ------------------------------------------------------------------------------------


def test_failure_before_any_stage_stepped_reruns_the_iteration_undoing_nothing() -> None:
    commits = {Worker(0, s): 4 for s in range(4)}  # everyone stepped iteration 4, nobody 5
    assert rollback_decision(commits) == Rollback(rerun=5, undo=frozenset())


def test_failure_after_some_stages_stepped_undoes_exactly_those() -> None:
    commits = {Worker(0, 0): 4, Worker(0, 1): 4, Worker(0, 2): 5, Worker(0, 3): 5, Worker(1, 3): 5}
    decision = rollback_decision(commits)
    assert decision.rerun == 5
    assert decision.undo == {Worker(0, 2), Worker(0, 3), Worker(1, 3)}
    assert decision.stages_undone == {2, 3}


def test_a_replica_that_aborted_before_its_step_makes_its_stage_mates_undo() -> None:
    decision = rollback_decision({Worker(0, 1): 5, Worker(1, 1): 4})
    assert decision == Rollback(rerun=5, undo=frozenset({Worker(0, 1)}))


def test_rollback_refuses_a_spread_it_cannot_undo() -> None:
    with pytest.raises(RecoveryError, match="checkpoint"):
        rollback_decision({Worker(0, 0): 3, Worker(0, 1): 5})
    with pytest.raises(RecoveryError):
        rollback_decision({})


@given(st.integers(-1, 50), st.lists(st.booleans(), min_size=1, max_size=12))
def test_after_rollback_every_survivor_is_at_the_same_iteration(base: int, stepped: list[bool]) -> None:
    commits = {Worker(d, 0): base + int(s) for d, s in enumerate(stepped)}
    decision = rollback_decision(commits)
    after = {w: c - (w in decision.undo) for w, c in commits.items()}
    assert set(after.values()) == {decision.rerun - 1}
    assert decision.rerun == base + 1 + (all(stepped))


# ---- rollback on a model: staggered steps, a failure, undo, re-run = the fault-free run ----------------------


def _stages() -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
    torch.manual_seed(0)
    mods = [nn.Sequential(nn.Linear(4, 8), nn.Tanh()).double(), nn.Linear(8, 1).double()]
    return mods, [torch.optim.Adam(m.parameters(), lr=0.05) for m in mods]


def _grads(mods: list[nn.Module], i: int) -> None:
    g = torch.Generator().manual_seed(100 + i)
    x, y = torch.randn(16, 4, generator=g, dtype=torch.float64), torch.randn(16, 1, generator=g, dtype=torch.float64)
    for m in mods:
        m.zero_grad()
    nn.functional.mse_loss(mods[1](mods[0](x)), y).backward()


def _params(mods: list[nn.Module]) -> list[torch.Tensor]:
    return [p.detach().clone() for m in mods for p in m.parameters()]


@pytest.mark.parametrize("stepped_before_failure", [(), (1,), (0, 1)])
def test_undo_and_rerun_reproduces_the_fault_free_model(stepped_before_failure: tuple[int, ...]) -> None:
    iterations, failing = 4, 2
    ref_mods, ref_opts = _stages()
    for i in range(iterations):
        _grads(ref_mods, i)
        for o in ref_opts:
            o.step()

    mods, opts = _stages()
    snaps = [StepSnapshot(m, o) for m, o in zip(mods, opts, strict=True)]
    commits = {Worker(0, s): -1 for s in range(2)}
    i = 0
    while i < iterations:
        _grads(mods, i)
        # staggered: the last stage steps first; the failure hits after `stepped_before_failure`
        for s in stepped_before_failure if i == failing else (1, 0):
            snaps[s].take(i)
            opts[s].step()
            commits[Worker(0, s)] = i
        if i != failing:
            i += 1
            continue
        decision = rollback_decision(commits)
        partial = len(stepped_before_failure) == 1
        assert decision.undo == ({Worker(0, 1)} if partial else set())
        assert decision.rerun == (failing + 1 if len(stepped_before_failure) == 2 else failing)
        for w in decision.undo:
            assert snaps[w.stage].restore() == commits[w]
            commits[w] -= 1
        i, failing = decision.rerun, -1
    for a, b in zip(_params(mods), _params(ref_mods), strict=True):
        assert torch.equal(a, b)
    for o, r in zip(opts, ref_opts, strict=True):
        for p, q in zip(o.state.values(), r.state.values(), strict=True):
            assert all(torch.equal(p[k], q[k]) for k in q)


# ---- lossy forward -------------------------------------------------------------------------------------


def _home_runner(pp: int, dp: int, m: int) -> dict[tuple[int, int, int], Worker]:
    return {(p, i, s): Worker(p, s) for p in range(dp) for i in range(m) for s in range(pp)}


def test_lossy_skips_the_failed_pipelines_microbatches_and_rescales_per_stage() -> None:
    runner = _home_runner(pp=2, dp=2, m=2)
    decision = lossy_decision(runner, [Worker(1, 1)], accumulated=[(1, 0, 0)], microbatch_size=8)
    assert decision.skipped == {(1, 0), (1, 1)}
    assert decision.skipped_samples == 16
    # stage 0 already accumulated micro-batch (1, 0) on a survivor: it keeps it
    assert decision.contributors == {0: 3, 1: 2}
    assert decision.scale == {0: 4 / 3, 1: 2.0}


def test_lossy_counts_rerouted_microbatches_by_who_ran_them() -> None:
    runner = _home_runner(pp=2, dp=2, m=2)
    runner[(1, 1, 1)] = Worker(0, 1)  # re-routed: (1, 1) never touches the failed worker... except at stage 0
    decision = lossy_decision(runner, [Worker(1, 0)])
    assert decision.skipped == {(1, 0), (1, 1)}
    runner[(1, 1, 0)] = Worker(0, 0)
    assert lossy_decision(runner, [Worker(1, 0)]).skipped == {(1, 0)}


def test_lossy_refuses_a_stage_left_with_no_gradient() -> None:
    with pytest.raises(RecoveryError, match="rollback"):
        lossy_decision(_home_runner(pp=2, dp=1, m=2), [Worker(0, 1)])


@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4), st.data())
def test_lossy_properties(pp: int, dp: int, m: int, data: st.DataObject) -> None:
    runner = _home_runner(pp, dp, m)
    workers = Topology.of(pp, dp).workers
    failed = set(data.draw(st.lists(st.sampled_from(workers), max_size=dp - 1 if dp > 1 else 0)))
    accumulated = data.draw(st.lists(st.sampled_from(sorted(runner)), max_size=6))
    decision = lossy_decision(runner, failed, accumulated)
    assert decision.skipped == {(p, i) for (p, i, _), w in runner.items() if w in failed}
    for s in range(pp):
        assert decision.contributors[s] * decision.scale[s] == pytest.approx(dp * m)
        assert dp * m - len(decision.skipped) <= decision.contributors[s] <= dp * m
    if not failed:
        assert decision.skipped == frozenset() and set(decision.scale.values()) == {1.0}


def test_runners_reads_who_runs_each_slot_from_a_plan() -> None:
    topo = Topology.of(2, 1)
    streams = {
        Worker(0, 0): tuple(Instruction.compute(Op(k, 0, 0, 0)) for k in (OpKind.F, OpKind.BW)),
        Worker(0, 1): tuple(Instruction.compute(Op(k, 0, 0, 1)) for k in (OpKind.F, OpKind.BW)),
    }
    plan = Plan(topo, CostModel.uniform(2), 1, streams)
    assert runners(plan) == {(0, 0, 0): Worker(0, 0), (0, 0, 1): Worker(0, 1)}


def test_switch_iteration_leaves_room_for_the_workers_ahead() -> None:
    assert switch_iteration(9) == 12
    assert switch_iteration(9, lead=1) == 11
    with pytest.raises(RecoveryError):
        switch_iteration(9, lead=0)
