"""Rollback and switch decisions (pure), and rollback carried out on a real model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from schedcomp.errors import RecoveryError
from schedcomp.runtime.fault.agreement import switch_iteration
from schedcomp.runtime.fault.rollback import Rollback, rollback_decision
from schedcomp.runtime.fault.transfer import StepSnapshot
from schedcomp.topology import Worker

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


def test_switch_iteration_leaves_room_for_the_workers_ahead() -> None:
    assert switch_iteration(9) == 12
    assert switch_iteration(9, lead=1) == 11
    with pytest.raises(RecoveryError):
        switch_iteration(9, lead=0)
