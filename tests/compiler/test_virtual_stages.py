"""Virtual stages (several model chunks per worker): the placement, lowering with local hand-offs, the
validator's rules per virtual stage, serialisation, and the families' closed forms under the unit
model with each chunk costing 1/v of a stage."""

from __future__ import annotations

from dataclasses import replace

import pytest

from schedcomp.check import check
from schedcomp.cli import main
from schedcomp.compiler import compile
from schedcomp.errors import ScheduleError, TopologyError, ValidationError
from schedcomp.ir import Instruction, Plan, staged_text
from schedcomp.schedules import FAMILIES
from schedcomp.simulator import simulate
from schedcomp.topology import LOOP, Topology, V, Worker


@pytest.mark.parametrize(("placement", "chunks"), [(LOOP, 1), (LOOP, 2), (LOOP, 3), (V, 2)])
def test_every_virtual_stage_has_one_place_and_chunks_of_inverts_it(placement: str, chunks: int) -> None:
    topo = Topology.of(4, chunks=chunks, placement=placement)
    assert sorted(s for place in range(4) for s in topo.chunks_of(place)) == list(range(4 * chunks))
    for place in range(4):
        assert all(topo.place_of(s) == place for s in topo.chunks_of(place))


def test_placements_are_pytorchs_stage_to_rank() -> None:
    assert [Topology.of(4, chunks=2).place_of(s) for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [Topology.of(4, chunks=2, placement=V).place_of(s) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    with pytest.raises(TopologyError, match="exactly 2 chunks"):
        Topology.of(4, chunks=3, placement=V)


# ---- the pinned closed forms (pp = 4, v = 2, M = 8, unit model, each chunk 1/v of a stage) ----------


def test_interleaved_1f1b_has_megatrons_bubble_below_1f1b() -> None:
    sim = simulate(compile(4, microbatches=8, schedule="interleaved-1f1b", chunks=2))
    # Megatron-LM: bubble (p - 1)(F + B + W) / v = 3 * 3 / 2 over 3M = 24 of work.
    assert sim.period == 28.5
    assert sim.period < simulate(compile(4, microbatches=8, schedule="1f1b")).period == 33


def test_zb_v_has_no_steady_state_bubble_at_1f1b_memory() -> None:
    sim = simulate(compile(4, microbatches=8, schedule="zb-v"))
    one_f_one_b = simulate(compile(4, microbatches=8, schedule="1f1b"))
    assert sim.period == 24  # 3M: the paper's zero bubble with T_F = T_B = T_W
    assert sim.period < simulate(compile(4, microbatches=8, schedule="zb-h1")).period == 27
    assert sim.peak_memory == one_f_one_b.peak_memory == 4  # pp micro-batches of a whole stage
    assert set(sim.memory.values()) == {4.0}  # every worker, not only the first


@pytest.mark.parametrize("pp", [2, 3, 5])
@pytest.mark.parametrize("v", [2, 3])
def test_interleaved_bubble_is_one_vth_of_1f1bs(pp: int, v: int) -> None:
    for m in (pp, 2 * pp):
        sim = simulate(compile(pp, microbatches=m, schedule="interleaved-1f1b", chunks=v))
        assert sim.period == pytest.approx(3 * m + 3 * (pp - 1) / v, abs=1e-9)


@pytest.mark.parametrize("pp", [2, 3, 5])
def test_zb_v_is_zero_bubble_from_2pp_minus_1_microbatches(pp: int) -> None:
    for m in (2 * pp - 1, 3 * pp):
        sim = simulate(compile(pp, microbatches=m, schedule="zb-v"))
        assert sim.period == pytest.approx(3 * m, abs=1e-9)
        assert sim.peak_memory == pytest.approx(pp)


def test_zb_v_is_sound_with_few_microbatches() -> None:
    for m in range(1, 7):
        check(compile(4, microbatches=m, schedule="zb-v"))


def test_one_chunk_interleaved_is_1f1b() -> None:
    plan = compile(4, microbatches=8, schedule="interleaved-1f1b", chunks=1)
    assert plan.streams == compile(4, microbatches=8, schedule="1f1b").streams
    assert plan.topology.chunks == 1 and '"chunks"' not in plan.to_json()  # one-chunk plans are written as before


# ---- lowering and the validator --------------------------------------------------------------------


def zbv(dp: int = 1) -> Plan:
    return compile(4, dp=dp, microbatches=8, schedule="zb-v")


def test_the_v_turns_around_locally_and_nobody_sends_to_itself() -> None:
    plan = zbv()
    for w, stream in plan.streams.items():
        assert all(ins.peer != w for ins in stream if ins.peer is not None)
    last = plan.streams[Worker(0, 3)]
    # Stage 3 hands F's output to stage 4 on the same worker: no SEND_ACT of a stage-3 F there.
    assert not [i for i in last if i.kind.value == "SEND_ACT" and i.op.stage == 3]
    # Loads at the first and last virtual stage, both on worker 0 (stage 0 and stage 7).
    loads = sorted({i.op.stage for i in plan.streams[Worker(0, 0)] if i.kind.value == "LOAD"})
    assert loads == [0, 7]


def test_interleaved_transfers_go_to_the_worker_holding_the_next_chunk() -> None:
    plan = compile(4, microbatches=8, schedule="interleaved-1f1b", chunks=2)
    for i in plan.streams[Worker(0, 3)]:
        if i.kind.value == "SEND_ACT" and i.op.stage == 3:
            assert i.peer == Worker(0, 0)  # stage 4 is chunk 1 of worker 0


def swap(plan: Plan, worker: Worker, a: int, b: int) -> Plan:
    stream = list(plan.streams[worker])
    stream[a], stream[b] = stream[b], stream[a]
    return replace(plan, streams={**plan.streams, worker: tuple(stream)})


def test_a_local_hand_off_out_of_order_is_refused() -> None:
    plan = zbv()
    w = Worker(0, 3)
    texts = [staged_text(i) for i in plan.streams[w]]
    f3, f4 = texts.index("F0.0@3"), texts.index("F0.0@4")
    with pytest.raises(ValidationError, match="neighbouring chunk") as info:
        check(swap(plan, w, f3, f4))
    assert (info.value.worker, info.value.index) == (w, f3)
    # Errors and their grid name each op's chunk: F0.0 alone would not say which of the two it is.
    assert f"instruction {f3} (F0.0@4): runs before F0.0@3" in str(info.value)
    assert ">>F0.0@4<<" in info.value.grid


def test_an_op_of_a_chunk_the_worker_does_not_hold_is_refused() -> None:
    plan = zbv()
    w = Worker(0, 1)
    stream = list(plan.streams[w])
    k = next(n for n, i in enumerate(stream) if i.op is not None and i.op.stage == 6)
    stream[k] = Instruction(stream[k].kind, stream[k].op.at_stage(5), stream[k].peer)  # stage 5 is worker 2's
    with pytest.raises(ValidationError, match="runs stages 1, 6"):
        check(replace(plan, streams={**plan.streams, w: tuple(stream)}))


def test_a_send_to_oneself_is_refused() -> None:
    plan = zbv()
    w = Worker(0, 3)
    stream = list(plan.streams[w])
    k = next(n for n, i in enumerate(stream) if i.kind.value == "F" and i.op.stage == 3)
    stream.insert(k + 1, Instruction.parse("SEND_ACT[F0.0@3>0:3]", 3))
    with pytest.raises(ValidationError, match="sends to its own worker"):
        check(replace(plan, streams={**plan.streams, w: tuple(stream)}))


def test_one_allreduce_per_worker_covers_its_chunks() -> None:
    from schedcomp.costs import CostModel

    costs = CostModel.uniform(8, forward=0.5, backward_input=0.5, backward_weight=0.5, activation=0.5,
                              allreduce=1.0, optimizer=0.25)
    plan = compile(4, dp=2, microbatches=8, schedule="zb-v", costs=costs)
    for stream in plan.streams.values():
        assert [i.kind.value for i in stream[-2:]] == ["ALLREDUCE", "STEP"]
        assert sum(i.kind.value == "ALLREDUCE" for i in stream) == 1
    sim = simulate(plan, iterations=1)
    ar = next(s for s in sim.spans if s.worker == Worker(0, 0) and s.instruction.kind.value == "ALLREDUCE")
    step = next(s for s in sim.spans if s.worker == Worker(0, 0) and s.instruction.kind.value == "STEP")
    assert (ar.end - ar.start, step.end - step.start) == (2.0, 0.5)  # both chunks' reductions and steps


# ---- serialisation and the CLI -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["interleaved-1f1b", "zb-v"])
def test_chunked_plans_round_trip(name: str) -> None:
    plan = compile(4, dp=2, microbatches=8, schedule=name)
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.topology.placement == FAMILIES[name].placement
    assert Plan.from_text(plan.to_text()) == plan
    check(again)


@pytest.mark.parametrize(("name", "period"), [("interleaved-1f1b", 28.5), ("zb-v", 24.0)])
def test_show_json_gives_the_pinned_periods(capsys, name: str, period: float) -> None:
    import json

    assert main(["show", "--schedule", name, "--pp", "4", "--chunks", "2", "-m", "8", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["period"], summary["chunks"]) == (period, 2)


@pytest.mark.parametrize(("argv", "words"), [
    (["--schedule", "1f1b", "--chunks", "2", "-m", "8"], "runs one stage per worker"),
    (["--schedule", "interleaved-1f1b", "--chunks", "2", "-m", "9"], "multiple of 4 or of 2"),
    (["--schedule", "zb-v", "--chunks", "3", "-m", "8"], "exactly 2 chunks"),
])
def test_bad_chunk_requests_are_one_line(capsys, argv: list[str], words: str) -> None:
    assert main(["show", "--pp", "4", *argv]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1


def test_costs_must_cover_the_virtual_stages() -> None:
    from schedcomp.costs import CostModel
    from schedcomp.errors import CostModelError

    with pytest.raises(CostModelError, match="8 virtual stages"):
        compile(4, microbatches=8, schedule="zb-v", costs=CostModel.uniform(4))
    with pytest.raises(ScheduleError, match="runs one stage per worker"):
        compile(4, microbatches=8, schedule="zb-h1", chunks=2)


def _torch_rank_orders(class_name: str, pp: int, **fields: int) -> list[list[str]]:
    """Each rank's actions in PyTorch's schedule `class_name`, as `F3.0@5` (its `_calculate_single_rank_operations`
    reads only these fields of the schedule, so no process group is needed)."""
    from types import SimpleNamespace

    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    cls = getattr(schedules, class_name, None)
    if cls is None or not hasattr(cls, "_calculate_single_rank_operations"):
        pytest.skip(f"this torch has no {class_name}._calculate_single_rank_operations")
    kinds = {"FORWARD": "F", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W", "FULL_BACKWARD": "BW"}
    fake = SimpleNamespace(pp_group_size=pp, **fields)
    return [[f"{kinds[a.computation_type.name]}{a.microbatch_index}.0@{a.stage_index}"
             for a in cls._calculate_single_rank_operations(fake, rank) if a] for rank in range(pp)]


@pytest.mark.parametrize(("pp", "m"), [(2, 3), (4, 8), (4, 5), (5, 12)])
def test_zb_v_is_pytorchs_zbv_order(pp: int, m: int) -> None:
    """Our ZB-V is PyTorch's ScheduleZBVZeroBubble order, action for action (its rank r holds stage r and 2pp-1-r)."""
    theirs = _torch_rank_orders("ScheduleZBVZeroBubble", pp, num_stages=2 * pp, _n_microbatches=m)
    assert [[f"{op}@{op.stage}" for op in ops] for ops in FAMILIES["zb-v"].orders(pp, m, 2)] == theirs


@pytest.mark.parametrize(("pp", "v", "m"), [(2, 2, 2), (4, 2, 4), (4, 2, 8), (4, 3, 8), (3, 2, 9), (5, 3, 15),
                                            (4, 2, 6), (4, 3, 10), (5, 2, 7), (3, 2, 8)])
def test_interleaved_1f1b_is_pytorchs_interleaved_order(pp: int, v: int, m: int) -> None:
    """Our interleaved 1F1B is PyTorch's ScheduleInterleaved1F1B order, also when M is not a multiple of pp
    (equal rounds of more than pp micro-batches), and it is sound there."""
    rounds = max(1, m // pp)
    theirs = _torch_rank_orders("ScheduleInterleaved1F1B", pp, n_local_stages=v, _n_microbatches=m,
                                number_of_rounds=rounds, microbatches_per_round=m // rounds)
    check(compile(pp, microbatches=m, schedule="interleaved-1f1b", chunks=v))
    assert [[f"{op}@{op.stage}" for op in ops] for ops in FAMILIES["interleaved-1f1b"].orders(pp, m, v)] == theirs


def test_a_family_needs_a_topology_of_its_shape() -> None:
    from schedcomp.schedules import fault_free_order

    with pytest.raises(ScheduleError, match="places chunks 'v'"):
        fault_free_order("zb-v", Topology.of(4, chunks=2), 8)
    with pytest.raises(ScheduleError, match="runs one stage per worker"):
        fault_free_order("zb-h1", Topology.of(4, chunks=2), 8)


def test_drawings_name_the_later_chunk() -> None:
    from schedcomp.draw.style import label

    spans = simulate(zbv(), iterations=1).spans
    labels = {label(s) for s in spans if s.worker == Worker(0, 0) and s.instruction.is_compute}
    assert {"F0", "F0@7", "B7@7", "W7"} <= labels and not any("@0" in t for t in labels)


@pytest.mark.parametrize("name", ["interleaved-1f1b", "zb-v"])
def test_memory_and_time_are_each_chunks_own(name: str) -> None:
    """Each op costs its own chunk's time and activation (a model whose chunks all differ), not its worker's."""
    from itertools import accumulate

    from schedcomp.check import peak_memory
    from schedcomp.costs import CostModel

    stages = range(8)
    costs = CostModel(forward=[1 + s for s in stages], backward_input=[2 + s for s in stages],
                      backward_weight=[0.5 + s for s in stages], activation=[1.0 + 3 * s for s in stages], b_frees=0.25)
    plan = compile(4, microbatches=8, schedule=name, costs=costs)
    frees = {"F": -1.0, "B": 0.25, "W": 0.75, "BW": 1.0}  # of the op's own chunk's activation
    sim = simulate(plan, iterations=1)
    for w, ops in ((w, plan.compute_ops(w)) for w in plan.workers):
        held = accumulate(-frees[op.kind.value] * costs.activation[op.stage] for op in ops)
        assert peak_memory(plan)[w] == pytest.approx(max(held)) == pytest.approx(sim.memory[w])
        times = {"F": costs.forward, "B": costs.backward_input, "W": costs.backward_weight}
        want = sum(times[op.kind.value][op.stage] if op.kind.value in times
                   else costs.backward_input[op.stage] + costs.backward_weight[op.stage] for op in ops)
        assert sim.busy[w] == pytest.approx(want)
