"""The semantics table and the PlanIndex (issue 15): one meaning per instruction kind, read everywhere.

A test-only kind (MARK: an op-less, non-blocking marker) is registered here, in this file alone, and
the IR, the validator, the simulator, JSON and the runtime's dispatch all take it: a new kind needs
its row in `schedcomp.semantics` and a handler in `runtime.executor.HANDLERS`, nothing else.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import replace
from enum import Enum

import pytest

import schedcomp
from schedcomp.check import check, memory_profile
from schedcomp.errors import PlanFormatError, ValidationError
from schedcomp.ir import Instruction, Plan
from schedcomp.planindex import plan_index, transfer_key
from schedcomp.semantics import (
    ACT,
    GRAD,
    RECV,
    SEMANTICS,
    SEND,
    InstrKind,
    Semantics,
    kinds,
    register,
    semantics_of,
    unregister,
)
from schedcomp.simulator import simulate


class ExtraKind(str, Enum):
    MARK = "MARK"

    __hash__ = str.__hash__


@pytest.fixture
def mark() -> Iterator[ExtraKind]:
    register(Semantics(ExtraKind.MARK, blocking=False, has_op=False))
    try:
        yield ExtraKind.MARK
    finally:
        unregister(ExtraKind.MARK)


def _plan(**kw: object) -> Plan:
    return schedcomp.compile(pp=3, dp=2, microbatches=4, **kw)  # type: ignore[arg-type]


def _with_marks(plan: Plan, kind: object) -> Plan:
    """`plan` with a marker at the start and in the middle of every stream."""
    streams = {}
    for w, s in plan.streams.items():
        half = len(s) // 2
        streams[w] = (Instruction(kind), *s[:half], Instruction(kind), *s[half:])  # type: ignore[arg-type]
    return Plan(plan.topology, plan.costs, plan.microbatches, streams, plan.family)


def test_every_builtin_kind_has_one_row_and_the_classes_agree() -> None:
    assert set(SEMANTICS) >= set(InstrKind)
    assert kinds(direction=SEND) == {InstrKind.SEND_ACT, InstrKind.SEND_GRAD}
    assert kinds(direction=RECV) == {InstrKind.RECV_ACT, InstrKind.RECV_GRAD}
    assert kinds(blocking=True) == {InstrKind.F, InstrKind.B, InstrKind.W, InstrKind.BW, InstrKind.ALLREDUCE,
                                    InstrKind.STEP}
    assert semantics_of(InstrKind.SEND_ACT).channel == semantics_of(InstrKind.RECV_ACT).channel == ACT
    assert semantics_of(InstrKind.RECV_GRAD).channel == GRAD
    # a receive's peer is where its tensor's producer is: the opposite stage offset of the matching send
    assert semantics_of(InstrKind.SEND_ACT).peer_stage == -semantics_of(InstrKind.RECV_ACT).peer_stage == 1


def test_an_unknown_kind_is_an_error_everywhere() -> None:
    with pytest.raises(PlanFormatError, match="unknown instruction kind"):
        Instruction("NOPE")  # type: ignore[arg-type]
    with pytest.raises(PlanFormatError, match="unknown instruction kind"):
        Instruction.parse("NOPE[F0.0]", 0)
    plan = _plan()
    w = plan.workers[0]
    bogus = Instruction.trusted("NOPE", None, None)  # type: ignore[arg-type]
    bad = Plan(plan.topology, plan.costs, plan.microbatches, {**plan.streams, w: (bogus, *plan.streams[w])})
    with pytest.raises(ValidationError, match="unknown instruction kind 'NOPE'"):
        check(bad)
    with pytest.raises(PlanFormatError, match="unknown instruction kind 'NOPE'"):
        simulate(bad, validate=False)


def test_a_registered_kind_is_read_by_ir_check_simulator_and_json(mark: ExtraKind) -> None:
    plan = _plan()
    marked = _with_marks(plan, mark)
    check(marked)  # the validator takes it: op-less, neither ALLREDUCE nor STEP
    sim = simulate(marked)
    assert sim.period == pytest.approx(simulate(plan).period)  # it takes no time
    from schedcomp.draw.style import label

    assert {label(s) for s in sim.spans if s.instruction.kind is mark} == {"MARK"}  # drawn by its name
    assert str(Instruction(mark)) == "MARK"  # type: ignore[arg-type]
    assert Instruction.parse("MARK", 0).kind is mark
    again = Plan.from_json(marked.to_json())
    assert again.streams == marked.streams
    with pytest.raises(PlanFormatError, match="wrong fields"):
        Instruction(mark, plan.streams[plan.workers[0]][0].op)  # type: ignore[arg-type]
    # placed after STEP, the tail rule still holds it to the end of the stream
    w = plan.workers[0]
    tail = (*plan.streams[w], Instruction(mark))  # type: ignore[arg-type]
    late = Plan(plan.topology, plan.costs, plan.microbatches, {**plan.streams, w: tail})
    with pytest.raises(ValidationError, match="comes after ALLREDUCE"):
        check(late)


def test_a_registered_kind_needs_a_runtime_handler(mark: ExtraKind) -> None:
    executor = pytest.importorskip("schedcomp.runtime.executor")
    from schedcomp.errors import RuntimeSetupError

    with pytest.raises(RuntimeSetupError, match="no runtime handler"):
        executor.handler(mark)
    seen = []
    executor.HANDLERS[mark] = lambda it, ins: seen.append(ins)
    try:
        executor.handler(mark)(None, Instruction(mark))  # type: ignore[arg-type]
    finally:
        del executor.HANDLERS[mark]
    assert seen == [Instruction(mark)]  # type: ignore[arg-type]


def test_plan_index_pairs_every_send_with_the_receive_of_the_same_tensor() -> None:
    plan = _plan(failed=[(1, 1)])
    index = plan_index(plan)
    pairs = 0
    for w in plan.workers:
        for i, ins in enumerate(plan.streams[w]):
            if semantics_of(ins.kind).direction != SEND:
                continue
            y, j = index.peer_of(w, i)
            recv = plan.streams[y][j]
            assert y == ins.peer and recv.peer == w
            assert transfer_key(recv) == transfer_key(ins)
            assert semantics_of(recv.kind).channel == semantics_of(ins.kind).channel
            consumer = plan.streams[y][index.consumer(y, j)]
            assert consumer.is_compute and consumer.op is not None and consumer.op.key == recv.op.key  # type: ignore[union-attr]
            assert index.consumer(y, j) > j
            pairs += 1
    assert pairs == len(index.sent) == len(index.received) > 0
    for x in plan.workers:  # channels: each carries its sender's sends to that peer, in stream order
        for y in plan.workers:
            ids = [index.id_of(s) for s in plan.streams[x] if semantics_of(s.kind).direction == SEND and s.peer == y]
            assert list(index.channel(x, y)) == ids


def test_plan_index_order_is_deadlock_free() -> None:
    """Replay the order: no compute op runs before its input was sent, no one passes ALLREDUCE alone."""
    plan = _plan(failed=[(0, 2)])
    index = plan_index(plan)
    at = dict.fromkeys(plan.workers, 0)
    posted = set()
    for w, stop in index.order:
        stream = plan.streams[w]
        for i in range(at[w], stop):
            ins = stream[i]
            sem = semantics_of(ins.kind)
            if sem.direction == SEND:
                posted.add(index.id_of(ins))
            if sem.reads >= 0:
                for j in range(i):
                    r = stream[j]
                    if semantics_of(r.kind).direction == RECV and index.consumer(w, j) == i:
                        assert index.id_of(r) in posted, f"{w} ran {ins} before its input was sent"
            if sem.collective:
                group = [v for v in plan.workers if v.stage == w.stage]
                assert all(at[v] >= len(plan.streams[v]) - 2 or v == w for v in group), f"{w} passed {ins} alone"
            at[w] = i + 1
    assert all(at[w] == len(plan.streams[w]) for w in plan.workers)


def test_one_memory_model() -> None:
    costs = schedcomp.CostModel.uniform(3)
    costs = replace(costs, b_frees=0.5)
    plan = _plan(costs=costs, memory_limit=None)
    index = plan_index(plan)
    sim = simulate(plan, iterations=1)
    for w in plan.workers:
        profile = memory_profile(plan, w)
        assert index.memory_profile(w) == profile
        assert sim.memory[w] == pytest.approx(max(0.0, *profile))


@pytest.mark.parametrize("kw", [dict(schedule="1f1b", dp=1), dict(dp=2, failed=[(1, 1)]), dict(dp=2, schedule="zb-h1")])
def test_networkx_graph_and_critical_path_match_the_simulator(kw: dict[str, object]) -> None:
    import networkx as nx

    from schedcomp.graph import critical_path

    plan = schedcomp.compile(pp=3, microbatches=6, **kw)  # type: ignore[arg-type]
    g = plan.to_networkx()
    assert nx.is_directed_acyclic_graph(g)
    assert g.number_of_nodes() == sum(len(s) for s in plan.streams.values())
    transfers = [(a, b) for a, b, via in g.edges(data="via") if via == "transfer"]
    assert len(transfers) == len(plan_index(plan).sent)
    length, path = critical_path(plan)
    assert length == pytest.approx(simulate(plan, iterations=1).makespan)
    assert all(b in g.successors(a) or g.nodes[b]["instruction"].kind is InstrKind.ALLREDUCE
               for a, b in itertools.pairwise(path))


def test_transfer_tables_read_as_mappings() -> None:
    """`check`'s transfer tables are typed arrays read as read-only maps (`planindex.TensorTable`): in the order
    built, with plain int keys and values, and no key outside the ones given (absent, negative, past the end)."""
    import numpy as np

    from schedcomp.planindex import TensorTable

    table = TensorTable(np.array([6, 1, 3]), np.array([60, 10, (1 << 40) + 3]), 8)
    assert list(table) == [6, 1, 3] and list(table.items()) == [(6, 60), (1, 10), (3, (1 << 40) + 3)]
    assert dict(table) == {6: 60, 1: 10, 3: (1 << 40) + 3} and len(table) == len(table.items()) == 3
    assert table[1] == 10 and type(table[1]) is int and 3 in table and table.get(6) == 60
    # keys a dict of ints would match are matched (numpy ints from columns, whole floats), others are not
    assert table[np.int64(1)] == table[1.0] == table[True] == 10 and np.int64(6) in table and 3.0 in table
    for absent in (0, 7, -1, 8, 1 << 70, "1", 1.5, np.float64(0.5), None):
        assert absent not in table and table.get(absent) is None  # type: ignore[call-overload]
        with pytest.raises(KeyError):
            table[absent]  # type: ignore[index]
    assert table.has_all(np.array([3, 6])) and not table.has_all(np.array([3, 5]))
    assert not table.has_all(np.array([-1])) and not table.has_all(np.array([8]))
