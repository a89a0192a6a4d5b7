"""Lowering: where loads, transfers, all-reduce and step go, FIFO per channel, re-routed ops."""

from __future__ import annotations

import sys
import types

import pytest

from schedcomp.check import check
from schedcomp.compiler import compile
from schedcomp.costs import CostModel
from schedcomp.errors import CostModelError, MemoryLimitError, ScheduleError, TopologyError
from schedcomp.ir import COMPUTE_KINDS, RECV_KINDS, SEND_KINDS, InstrKind, Op, OpKind, Order, Plan
from schedcomp.lower import lower
from schedcomp.schedules import FAMILIES, ONE_STAGE_FAMILIES, fault_free_order
from schedcomp.topology import Topology, Worker

W = Worker.parse
CASES = [(name, pp, dp) for name in ONE_STAGE_FAMILIES for pp, dp in [(1, 1), (2, 2), (4, 1), (4, 3), (6, 2)]]


def lowered(name: str, pp: int, dp: int, m: int | None = None) -> tuple[Order, Plan]:
    m = m or max(2 * pp, FAMILIES[name].min_microbatches(pp))
    order = fault_free_order(name, Topology(pp, dp), m)
    return order, lower(order, CostModel.uniform(pp), solver="s", lower_bound=1.5, meta={"k": 1})


@pytest.mark.parametrize(("name", "pp", "dp"), CASES)
def test_stream_layout(name: str, pp: int, dp: int) -> None:
    order, plan = lowered(name, pp, dp)
    check(plan)
    assert (plan.family, plan.solver, plan.lower_bound, dict(plan.meta)) == (name, "s", 1.5, {"k": 1})
    assert plan.microbatches == order.microbatches and set(plan.streams) == set(order.ops)
    for w, stream in plan.streams.items():
        kinds = [i.kind for i in stream]
        assert plan.compute_ops(w) == order.ops[w]  # the compute order is kept as is
        assert kinds[-2:] == [InstrKind.ALLREDUCE, InstrKind.STEP] and kinds.count(InstrKind.STEP) == 1
        compute = [i for i, ins in enumerate(stream) if ins.kind in COMPUTE_KINDS]
        for n, i in enumerate(compute):
            op = stream[i].op
            edge = op.stage in (0, pp - 1)
            # a LOAD right before each forward of the first and last stage, and nowhere else
            assert (op.kind is OpKind.F and edge) == (stream[i - 1].kind is InstrKind.LOAD)
            backward = op.kind in (OpKind.B, OpKind.BW)
            # sends right after their producer
            sends = [ins for ins in stream[i + 1 :][:1] if ins.kind in SEND_KINDS]
            produces = (op.kind is OpKind.F and op.stage < pp - 1) or (backward and op.stage > 0)
            assert bool(sends) == produces and all(s.op == op for s in sends)
            # the receive for this op is posted before the compute op that precedes it
            recv = [j for j, ins in enumerate(stream) if ins.kind in RECV_KINDS and ins.op == op]
            consumes = (op.kind is OpKind.F and op.stage > 0) or (backward and op.stage < pp - 1)
            assert len(recv) == int(consumes)
            if recv and n > 0:
                assert recv[0] < compute[n - 1]


def test_textbook_1f1b_streams() -> None:
    _, plan = lowered("1f1b", 2, 1, 2)
    # each receive goes before the op preceding its consumer: BW0's before F1, F1's before BW0
    assert [str(i) for i in plan.streams[W("0:0")]] == [
        "LOAD[F0.0]", "F0.0", "SEND_ACT[F0.0>0:1]", "RECV_GRAD[BW0.0<0:1]", "LOAD[F1.0]", "F1.0",
        "SEND_ACT[F1.0>0:1]", "RECV_GRAD[BW1.0<0:1]", "BW0.0", "BW1.0", "ALLREDUCE", "STEP",
    ]  # fmt: skip
    assert [str(i) for i in plan.streams[W("0:1")]] == [
        "RECV_ACT[F0.0<0:0]", "LOAD[F0.0]", "F0.0", "RECV_ACT[F1.0<0:0]", "BW0.0", "SEND_GRAD[BW0.0>0:0]",
        "LOAD[F1.0]", "F1.0", "BW1.0", "SEND_GRAD[BW1.0>0:0]", "ALLREDUCE", "STEP",
    ]  # fmt: skip


def channel_orders(plan: Plan) -> tuple[dict, dict]:
    sends: dict[tuple[Worker, Worker], list] = {}
    recvs: dict[tuple[Worker, Worker], list] = {}
    for w, stream in plan.streams.items():
        for ins in stream:
            d, m, _ = ins.op.key if ins.op else (0, 0, 0)
            if ins.kind in SEND_KINDS:
                sends.setdefault((w, ins.peer), []).append((ins.kind is InstrKind.SEND_ACT, d, m))
            elif ins.kind in RECV_KINDS:
                recvs.setdefault((ins.peer, w), []).append((ins.kind is InstrKind.RECV_ACT, d, m))
    return sends, recvs


@pytest.mark.parametrize(("name", "pp", "dp"), CASES)
def test_fifo_per_channel(name: str, pp: int, dp: int) -> None:
    sends, recvs = channel_orders(lowered(name, pp, dp)[1])
    assert sends == recvs


def test_receives_follow_the_senders_order_even_when_consumed_out_of_order() -> None:
    """Stage 1 runs F1 before F0; stage 0 sends F0 first, so stage 1 must post F0's receive first."""
    ops = {
        W("0:0"): tuple(Op(k, 0, m, 0) for k, m in [(OpKind.F, 0), (OpKind.F, 1), (OpKind.BW, 1), (OpKind.BW, 0)]),
        W("0:1"): tuple(Op(k, 0, m, 1) for k, m in [(OpKind.F, 1), (OpKind.BW, 1), (OpKind.F, 0), (OpKind.BW, 0)]),
    }
    plan = lower(Order(Topology(2), 2, ops, "hand"), CostModel.uniform(2))
    check(plan)
    stream = [str(i) for i in plan.streams[W("0:1")]]
    assert stream[:2] == ["RECV_ACT[F0.0<0:0]", "RECV_ACT[F1.0<0:0]"]
    sends, recvs = channel_orders(plan)
    assert sends == recvs


def rerouted_order(m: int = 3) -> Order:
    """pp=3, dp=2 with 1:1 failed: worker 0:1 runs stage 1 of both pipelines (GPipe-like order)."""
    topo = Topology.of(3, 2, [(1, 1)])
    ops: dict[Worker, tuple[Op, ...]] = {}
    for w in topo.live_workers:
        homes = (0, 1) if w == W("0:1") else (w.pipeline,)
        fwd = [Op(OpKind.F, d, mb, w.stage) for mb in range(m) for d in homes]
        bwd = [Op(k, d, mb, w.stage) for mb in range(m) for d in homes for k in (OpKind.B, OpKind.W)]
        ops[w] = tuple(fwd + bwd)
    return Order(topo, m, ops, "rerouted")


def test_rerouted_ops_find_their_neighbours() -> None:
    plan = lower(rerouted_order(), CostModel.uniform(3))
    check(plan)
    assert W("1:1") not in plan.streams
    s01 = [str(i) for i in plan.streams[W("0:1")]]
    assert "RECV_ACT[F2.1<1:0]" in s01 and "SEND_ACT[F2.1>1:2]" in s01 and "SEND_GRAD[B2.1>1:0]" in s01
    assert "SEND_ACT[F0.1>0:1]" in [str(i) for i in plan.streams[W("1:0")]]
    assert "RECV_GRAD[B0.1<0:1]" in [str(i) for i in plan.streams[W("1:0")]]
    sends, recvs = channel_orders(plan)
    assert sends == recvs


def test_incomplete_order_is_an_error() -> None:
    order = rerouted_order()
    ops = dict(order.ops)
    ops[W("0:1")] = tuple(op for op in ops[W("0:1")] if op.pipeline == 0)
    with pytest.raises(ScheduleError, match="no F for micro-batch 0 of pipeline 1 at stage 1"):
        lower(Order(order.topology, order.microbatches, ops, "broken"), CostModel.uniform(3))


@pytest.mark.parametrize(
    ("rows", "words"),
    [
        # Stage 1 runs F0 but no backward: stage 0's BW0 waits for a gradient nobody sends (was a KeyError).
        ([["F0", "BW0"], ["F0"]], ["0:0 runs BW0.0 of stage 0", "0:1", "does not send it the gradient"]),
        # Stage 0 runs nothing: stage 1's F0 has no producer (was a KeyError).
        ([[], ["F0"]], ["no F for micro-batch 0 of pipeline 0 at stage 0"]),
        # The F of (0, 0, 1) runs on 0:1 and again on 0:2, which takes 0:1's place as its runner: 0:0 waits
        # for a gradient from 0:2, which sends it nothing (was a KeyError).
        ([["F0", "BW0"], ["F0", "BW0"], ["F0@1", "F0", "BW0"]],
         ["0:0 runs BW0.0 of stage 0, but 0:2", "does not send"]),
        # Micro-batch 1 of a one-micro-batch job: refused before it could share another op's slot id.
        ([["F0", "BW0"], ["F1", "BW1"]], ["0:1 runs F1.0 of stage 1, outside micro-batches 0..0 and stages 0..1"]),
    ],
)
def test_an_op_whose_input_nobody_sends_is_a_schedule_error(rows: list[list[str]], words: list[str]) -> None:
    def op(text: str, s: int) -> Op:
        name, _, stage = text.partition("@")
        return Op(OpKind(name.rstrip("0123456789")), 0, int(name[-1]), int(stage) if stage else s)

    pp = len(rows)
    order = Order(Topology(pp), 1, {W(f"0:{s}"): tuple(op(t, s) for t in row) for s, row in enumerate(rows)})
    with pytest.raises(ScheduleError) as info:
        lower(order, CostModel.uniform(pp))
    for word in words:
        assert word in str(info.value), str(info.value)


# ---- the compile entry ---------------------------------------------------------------------------


def test_compile_fault_free() -> None:
    plan = compile(4, 2, 8, schedule="zb-h2", costs=CostModel.uniform(4, 2.0, 1.0, 1.0))
    check(plan)
    assert (plan.family, plan.solver, plan.lower_bound, plan.microbatches) == ("zb-h2", "", None, 8)
    assert plan.costs.forward == (2.0,) * 4 and plan.costs.memory_limit is None
    assert compile(4, microbatches=8).family == "1f1b"
    assert compile(4, microbatches=8, memory_limit=4).costs.memory_limit == 4  # overrides the model's


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"microbatches": None}, ScheduleError, ["microbatches", "positive integer"]),
        ({"microbatches": 0}, ScheduleError, ["at least 1"]),
        ({"microbatches": 3}, ScheduleError, ["at least 4"]),
        ({"schedule": "interleaved"}, ScheduleError, ["unknown schedule family"]),
        ({"costs": CostModel.uniform(3)}, CostModelError, ["3 stages but pp=4"]),
        ({"memory_limit": 3.5}, MemoryLimitError, ["1f1b needs 4 activation units at stage 0", ">= 4"]),
        ({"schedule": "zb-h2", "microbatches": 7, "memory_limit": 4},
         MemoryLimitError, ["zb-h2 needs 7", "at stage 0", "use 1f1b or zb-h1, which fit,", "adaptive"]),
        ({"pp": 0}, TopologyError, ["pp must be a positive integer"]),
    ],
)
def test_compile_errors(kwargs: dict, error: type, words: list[str]) -> None:
    args = {"pp": 4, "dp": 1, "microbatches": 8, "schedule": "1f1b", **kwargs}
    with pytest.raises(error) as info:
        compile(**args)
    for word in words:
        assert word in str(info.value)


def test_compile_hands_failures_to_the_adaptive_scheduler(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def adaptive_solution(topology, microbatches, costs, *, solver, time_limit):
        calls.append((topology, microbatches, costs.memory_limit, solver, time_limit))
        return types.SimpleNamespace(order=lambda: rerouted_order(microbatches), bound=12.5, solver="fake",
                                     timing=None)

    fake = types.SimpleNamespace(adaptive_solution=adaptive_solution, ITERATIONS=4)
    monkeypatch.setitem(sys.modules, "schedcomp.adaptive", fake)
    plan = compile(3, 2, 3, failed=[(1, 1)], schedule="zb-h1", memory_limit=50, solver="greedy", time_limit=2.0)
    check(plan)
    assert calls == [(Topology.of(3, 2, [(1, 1)]), 3, 50, "greedy", 2.0)]
    assert (plan.family, plan.solver, plan.lower_bound) == ("rerouted", "fake", 12.5)
    compile(3, 2, 3, schedule="adaptive")  # no failures, but asked for
    assert len(calls) == 2


def test_compile_without_the_adaptive_scheduler(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "schedcomp.adaptive", None)  # as if the module were absent
    with pytest.raises(ScheduleError, match="adaptive schedules"):
        compile(4, 2, 8, failed=[(0, 1)])
