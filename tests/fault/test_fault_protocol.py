"""The recovery protocol checked exhaustively: every interleaving, deaths at every step (see `protocol_model`).

The model (`tests/support/protocol_model.py`) runs the real steps of `runtime/fault/protocol.py` for every
worker against an in-memory store, in every order, with deaths injected at every step, and checks
agreement, termination and that nobody waits on a dead member. It explores one state per class of
states equal up to renaming the workers (symmetry), a single local step where one exists (partial
order), and forgets store keys no live worker reads again; the tests below check each reduction
against the search without it on small jobs, and that two deliberate protocol bugs are still
caught through them.

In the default run: every scenario with 3 and 4 members and up to 2 deaths (about 3 s). `slow`: 5
and 6 members with 1 death, and recovery with 5 members and 2 deaths (about 10 s). The rest of
3-6 members with up to 2 deaths (up to minutes each): `python bench/bench_protocol_model.py`.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import protocol_model
import pytest
from protocol_model import SCENARIOS, Model, Violation, equivariant, search
from protocol_states import canonical, forget

from schedcomp.runtime.fault import protocol
from schedcomp.runtime.fault.protocol import DONE, Round

FAST = [(scenario, members, 2) for members in (3, 4) for scenario in SCENARIOS]
SLOW = [*((scenario, members, 1) for members in (5, 6) for scenario in SCENARIOS), ("recovery", 5, 2)]


def _report(model: Model, scenario: str, members: int, deaths: int) -> None:
    print(f"{scenario}, {members} members, up to {deaths} deaths: {model.explored} states, "
          f"{model.quiescent} quiescent, all checked")
    assert model.quiescent > 0 and model.explored > members * 10  # the search really ran


@pytest.mark.parametrize(("scenario", "members", "deaths"), FAST)
def test_every_interleaving_agrees_and_terminates(scenario: str, members: int, deaths: int) -> None:
    _report(search(scenario, members, deaths), scenario, members, deaths)


@pytest.mark.slow
@pytest.mark.parametrize(("scenario", "members", "deaths"), SLOW)
def test_every_interleaving_agrees_and_terminates_on_larger_jobs(scenario: str, members: int, deaths: int) -> None:
    _report(search(scenario, members, deaths), scenario, members, deaths)


# ---- the reductions lose nothing ----------------------------------------------------------------


@pytest.mark.parametrize(("scenario", "members", "deaths"), [("recovery", 3, 2), ("admission", 3, 1)])
def test_steps_commute_with_renaming(scenario: str, members: int, deaths: int) -> None:
    # Premise (1) of the symmetry reduction, on the real steps: at every reachable state, the
    # successors of a renamed state are the renamed successors, for every renaming.
    full = search(scenario, members, deaths, reduced=False)
    model, _ = SCENARIOS[scenario](members)
    model.max_deaths = deaths
    checked = 0
    for state in sorted(full.visited)[::7]:
        for perm in itertools.permutations(range(members)):
            assert equivariant(model, state, perm), (state, perm)
            checked += 1
    assert checked > 100


@pytest.mark.parametrize(("scenario", "members", "deaths"),
                         [("recovery", 3, 2), ("first-agreement", 3, 1), ("admission", 3, 1), ("recovery", 4, 1)])
def test_symmetry_reduction_explores_exactly_the_orbits(scenario: str, members: int, deaths: int) -> None:
    full = search(scenario, members, deaths, reduced=False)
    reduced = search(scenario, members, deaths, symmetry=True, reduced=False)
    assert {canonical(s) for s in full.visited} == reduced.visited
    assert {canonical(s) for s in full.ends} == reduced.ends
    assert reduced.explored < full.explored


@pytest.mark.parametrize("reduction", ["partial_order", "forgetting"])
@pytest.mark.parametrize(("scenario", "members", "deaths"),
                         [("recovery", 3, 2), ("first-agreement", 3, 2), ("admission", 3, 2), ("recovery", 4, 2)])
def test_a_reduction_keeps_every_quiescent_state(reduction: str, scenario: str, members: int, deaths: int) -> None:
    without = search(scenario, members, deaths, **{reduction: False})
    reduced = search(scenario, members, deaths)
    assert {canonical(forget(s)) for s in without.ends} == reduced.ends
    assert reduced.explored < without.explored


# ---- the checker catches deliberate bugs -------------------------------------------------------


@pytest.mark.parametrize("members", [3, 4])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_an_uninterruptible_group_construction_is_caught(monkeypatch, scenario: str, members: int) -> None:
    # Issue 11's hang: a member dies after the generation is sealed, the others wait in gloo's
    # group construction for it, which nothing but the group timeout interrupts.
    real = protocol.meet_step
    monkeypatch.setattr(protocol_model, "meet_step", lambda store, m, broken: real(store, m, False))
    with pytest.raises(Violation) as caught:
        search(scenario, members, 2)
    assert caught.value.kind == "deadlock", caught.value


@pytest.mark.parametrize("members", [3, 4])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_sealing_on_the_count_alone_is_caught(monkeypatch, scenario: str, members: int) -> None:
    # A member that has seen every acknowledgement returns the generation without winning the
    # outcome key: a member that superseded it meanwhile moves on without it.
    real = protocol.step

    def trusting(store, detector, r: Round) -> Round:
        after = real(store, detector, r)
        return replace(after, phase=DONE) if after.phase == protocol.SEAL else after

    monkeypatch.setattr(protocol_model, "step", trusting)
    with pytest.raises(Violation) as caught:
        search(scenario, members, 2)
    assert caught.value.kind == "disagreement", caught.value


def test_a_step_that_noticing_disables_is_reported(monkeypatch) -> None:
    # Noticing is folded into the steps that ask the detector, which is sound only if noticing
    # never disables a step: the search checks it at every state.
    real = protocol.step

    def shy(store, detector, r: Round) -> Round:
        return r if r.phase == protocol.ACK and detector.failed() else real(store, detector, r)

    monkeypatch.setattr(protocol_model, "step", shy)
    with pytest.raises(Violation) as caught:
        search("first-agreement", 3, 1)
    assert caught.value.kind == "model", caught.value
