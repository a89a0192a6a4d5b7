"""Plans with per-pipeline partitions (re-formed pipelines): lowering over gaps, the format, and `check`'s rules."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedcomp.check import check, peak_memory
from schedcomp.check_reformed import segments_passed
from schedcomp.costs import CostModel
from schedcomp.cut import Cut
from schedcomp.errors import PlanFormatError, ValidationError
from schedcomp.ir import InstrKind, Instruction, Op, OpKind, Order, Plan
from schedcomp.layers import LayerCosts, stage_costs
from schedcomp.lower import lower
from schedcomp.topology import Topology, Worker

F, B, W = OpKind.F, OpKind.B, OpKind.W
LAYERS = LayerCosts.even(CostModel.uniform(3), 2)  # 6 layers, F = B = W = 0.5 each


def _serial(d: int, s: int, microbatches: int) -> tuple[Op, ...]:
    """F, B, W of each micro-batch in turn (valid at any stage: no op waits for a later one)."""
    return tuple(Op(k, d, m, s) for m in range(microbatches) for k in (F, B, W))


def _one_f_one_b(d: int, s: int, left: int, microbatches: int) -> tuple[Op, ...]:
    """1F1B at stage s of pipeline d, `left` held stages from s to the pipeline's end (s counted)."""
    warm = min(left, microbatches)
    out = [Op(F, d, m, s) for m in range(warm)]
    for m in range(microbatches):
        out += [Op(B, d, m, s), Op(W, d, m, s)]
        if warm + m < microbatches:
            out.append(Op(F, d, warm + m, s))
    return tuple(out)


def reformed_plan(*, cut: Cut | None = None, limit: float | None = None) -> Plan:
    """pp 3, dp 2, worker 1:1 failed; pipeline 1 re-formed as (3, 0, 3): 1:0 sends to 1:2 over the gap."""
    topo = Topology.of(3, 2, ["1:1"])
    base, reformed = (2, 2, 2), (3, 0, 3)
    counts = {d: 2 if cut is None else cut.count(d, 2) for d in range(2)}
    ops = {Worker(0, s): _one_f_one_b(0, s, 3 - s, counts[0]) for s in range(3)}
    ops |= {Worker(1, 0): _one_f_one_b(1, 0, 2, counts[1]), Worker(1, 2): _one_f_one_b(1, 2, 1, counts[1])}
    order = Order(topo, 2, ops, cut=cut or Cut(), partition=base, partitions=(base, reformed))
    costs = stage_costs(LAYERS, base)
    own = stage_costs(LAYERS, reformed)
    if limit is not None:
        costs, own = costs.with_memory_limit(limit), own.with_memory_limit(limit)
    return lower(order, costs, pipeline_costs={1: own}, layer_allreduce=LAYERS.costs.allreduce)


def test_a_re_formed_pipeline_sends_over_its_gap_and_loads_at_its_held_ends() -> None:
    plan = reformed_plan()
    check(plan)
    s10, s12 = (list(map(str, plan.streams[Worker(1, s)])) for s in (0, 2))
    assert "SEND_ACT[F0.1>1:2]" in s10 and "RECV_GRAD[B0.1<1:2]" in s10 and "LOAD[F0.1]" in s10
    assert "RECV_ACT[F0.1<1:0]" in s12 and "SEND_GRAD[B0.1>1:0]" in s12 and "LOAD[F0.1]" in s12
    assert plan.costs_of(1).forward == (1.5, 0.0, 1.5) and plan.costs_of(0) is plan.costs


def test_a_plan_with_partitions_and_shares_round_trips_as_version_4() -> None:
    cut = Cut.of({0: (0.0, 0.8, 1.6, 2.4), 1: (0.0, 0.8, 1.6)}, shares=True)  # 2.4 + 1.6 = dp x M
    plan = reformed_plan(cut=cut)
    check(plan)
    text = plan.to_json()
    data = json.loads(text)
    assert data["version"] == 4 and data["partitions"] == [[2, 2, 2], [3, 0, 3]]
    assert list(data["pipeline_costs"]) == ["1"]
    assert Plan.from_json(text) == plan and Plan.from_text(plan.to_text()) == plan
    check(Plan.from_json(text))


def test_check_refuses_an_op_at_a_stage_its_pipeline_holds_no_layers_of() -> None:
    plan = reformed_plan()
    stream = plan.streams[Worker(0, 1)]
    bad = (Instruction.compute(Op(F, 1, 0, 1)), *stream)  # pipeline 1 holds nothing at stage 1
    with pytest.raises(ValidationError, match="pipeline 1 holds no layers at stage 1"):
        check(dataclasses.replace(plan, streams={**plan.streams, Worker(0, 1): bad}))


def test_check_refuses_an_op_re_routed_to_a_worker_holding_other_layers() -> None:
    topo = Topology.of(2, 2, ["1:1"])
    # 1:0 holds layers 0..3, pipeline 0's stage 0 layers 0..1: it must not run pipeline 0's micro-batch 1 there.
    ops = {Worker(0, 0): _serial(0, 0, 1), Worker(0, 1): _serial(0, 1, 2),
           Worker(1, 0): (*_serial(1, 0, 2), *_serial(0, 0, 2)[3:])}
    order = Order(topo, 2, ops, partition=(2, 2), partitions=((2, 2), (4, 0)))
    layers = LayerCosts.even(CostModel.uniform(2), 2)
    plan = lower(order, stage_costs(layers, (2, 2)), pipeline_costs={1: stage_costs(layers, (4, 0))},
                 layer_allreduce=layers.costs.allreduce)
    with pytest.raises(ValidationError, match="holding its layers"):
        check(plan)


def test_check_refuses_a_receive_from_the_wrong_side_of_the_gap_and_a_missing_load() -> None:
    plan = reformed_plan()
    stream = list(plan.streams[Worker(1, 2)])
    at = next(i for i, ins in enumerate(stream) if str(ins) == "RECV_ACT[F0.1<1:0]")
    stream[at] = Instruction(InstrKind.RECV_ACT, stream[at].op, Worker(0, 1))
    with pytest.raises(ValidationError, match=r"producer of F0\.1's input runs on 1:0"):
        check(dataclasses.replace(plan, streams={**plan.streams, Worker(1, 2): tuple(stream)}))
    no_load = tuple(ins for ins in plan.streams[Worker(1, 2)] if str(ins) != "LOAD[F0.1]")
    with pytest.raises(ValidationError, match="needs LOAD"):
        check(dataclasses.replace(plan, streams={**plan.streams, Worker(1, 2): no_load}))


def test_check_holds_a_re_formed_worker_to_its_own_memory_limit() -> None:
    # 1:0 holds 3 layers' activations (1.5) per micro-batch, two in flight; pipeline 0's first stage 1.0 each.
    with pytest.raises(ValidationError, match=r"worker 1:0, .* above memory_limit 2\.5"):
        check(reformed_plan(limit=2.5))
    roomy = reformed_plan(limit=3.0)
    check(roomy)
    assert peak_memory(roomy)[Worker(1, 0)] == pytest.approx(3.0)
    assert peak_memory(roomy)[Worker(0, 0)] == pytest.approx(2.0)


@pytest.mark.parametrize(("change", "says"), [
    ({"partition": None}, "names plan.partition"),
    ({"pipeline_costs": {}}, "pipeline 1 has its own partition but no cost model"),
    ({"partitions": ((2, 2, 2), (2, 2, 2))}, "pipeline 1 keeps plan.partition but has a cost model"),
    ({"partitions": ((2, 2, 2), (3, 3, 0))}, "place 1"),
    ({"partitions": None}, "without plan.partitions"),
    ({"cut": Cut.of({1: (0.0, 1.0, 2.0)})}, "shares=True"),
    ({"cut": Cut.of({1: (0.0, 1.0, 1.5)}, shares=True)}, "shares total 3.5"),
    ({"layer_allreduce": (0.0,) * 5}, "one non-negative time per layer"),
    ({"layer_allreduce": (0.0,) * 5 + (1.0,)}, "stage 2 has allreduce 0 but its layers'"),
])
def test_check_refuses_inconsistent_partitions_costs_and_shares(change: dict[str, object], says: str) -> None:
    with pytest.raises(ValidationError, match=says):
        check(dataclasses.replace(reformed_plan(), **change))


def test_check_refuses_a_pipeline_cost_model_with_other_links_and_shares_without_partitions() -> None:
    plan = reformed_plan()
    other = dataclasses.replace(plan.costs_of(1), p2p=1.0)
    with pytest.raises(ValidationError, match="another p2p"):
        check(dataclasses.replace(plan, pipeline_costs={1: other}))
    plain = dataclasses.replace(plan, partitions=None, pipeline_costs={}, cut=Cut.of({1: (0.0, 2.0)}, shares=True))
    with pytest.raises(ValidationError, match="needs per-pipeline partitions"):
        check(plain)


def test_a_worker_passes_its_all_reduce_once_every_segment_before_it_can_run() -> None:
    # pp 2, dp 2, 1:1 failed, pipeline 1 re-formed: segments [0, 1] over 0:0, 1:0 and [2, 3] over 0:1, 1:0.
    topo = Topology.of(2, 2, ["1:1"])
    plan = Plan(topo, CostModel.uniform(2), 1, {}, partition=(2, 2), partitions=((2, 2), (4, 0)))
    everyone = {Worker(0, 0), Worker(0, 1), Worker(1, 0)}
    assert segments_passed(plan, everyone) == everyone
    # 0:1 late: 1:0 reduces its first segment with 0:0, then waits at the second; 0:0 is through.
    assert segments_passed(plan, {Worker(0, 0), Worker(1, 0)}) == {Worker(0, 0)}
    # 0:0 late: 1:0 waits at its first segment, so 0:1 (whose one segment 1:0 never reaches) waits too.
    assert segments_passed(plan, {Worker(0, 1), Worker(1, 0)}) == set()


def test_global_rows_keep_whole_shares_exact_and_cover_re_balanced_shares_once() -> None:
    dp, m, r = 3, 4, 5
    whole = Cut.of({1: (0.0, 0.7, 2.2, 4.0)})
    for p in range(dp):
        for i in range(whole.count(p, m)):
            start, stop = whole.rows(p, i, r)
            assert whole.global_rows(p, i, dp, m, r) == (p * m * r + start, p * m * r + stop)
    shares = Cut.of({0: (0.0, 1.45, 2.9, 4.35), 1: (0.0, 1.45, 2.9, 4.35), 2: (0.0, 1.1, 2.2, 3.3)}, shares=True)
    assert shares.problem(dp, m) is None
    rows = [shares.global_rows(p, i, dp, m, r) for p in range(dp) for i in range(shares.count(p, m))]
    assert rows[0][0] == 0 and rows[-1][1] == dp * m * r
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in itertools.pairwise(rows))


@st.composite
def share_cuts(draw: st.DrawFn) -> tuple[Cut, int, int, int]:
    """Random re-balanced shares over dp pipelines (each cut into pieces of any sizes, or left whole at M)
    totalling dp x M, and a row count per micro-batch."""
    dp, m, r = draw(st.integers(2, 5)), draw(st.integers(1, 6)), draw(st.integers(1, 9))
    weights = draw(st.lists(st.integers(1, 20), min_size=dp, max_size=dp))
    shares = [dp * m * w / sum(weights) for w in weights]
    bounds = {}
    for p, share in enumerate(shares):
        if draw(st.booleans()) or p == 0:
            inner = sorted(set(draw(st.lists(st.integers(1, 99), max_size=6))))
            bounds[p] = (0.0, *(share * x / 100 for x in inner), share)
        else:
            bounds[p] = tuple(float(i) * share / m for i in range(m + 1))
    return Cut.of(bounds, shares=True), dp, m, r


@given(share_cuts())
@settings(max_examples=300, deadline=None)
def test_global_rows_cover_every_row_once_in_order_whatever_the_shares(case: tuple[Cut, int, int, int]) -> None:
    cut, dp, m, r = case
    rows = [cut.global_rows(p, i, dp, m, r) for p in range(dp) for i in range(cut.count(p, m))]
    assert rows[0][0] == 0 and rows[-1][1] == dp * m * r
    assert all(a[1] == b[0] for a, b in itertools.pairwise(rows))  # consecutive: every row once, none twice
    # each boundary rounded once: a piece's rows are within one of its size (rounding twice could be off by
    # 1.5 and leave a piece of more than a row with none)
    sizes = [cut.size(p, i) * r for p in range(dp) for i in range(cut.count(p, m))]
    assert all(abs(stop - start - size) <= 1 + 1e-9 for (start, stop), size in zip(rows, sizes, strict=True))


@pytest.mark.parametrize(("edit", "says"), [
    (lambda d: d.pop("pipeline_costs"), "'pipeline_costs'"),
    (lambda d: d.update(version=3), "version-4"),
    (lambda d: d.update(pipeline_costs={"9": d["pipeline_costs"]["1"]}), "keyed by pipelines"),
    (lambda d: d.update(pipeline_costs={"1": [1]}), "must be a cost model"),
    (lambda d: d["pipeline_costs"]["1"].update(forward=[1.0]), "stages"),
    (lambda d: d.update(partitions=[[2, 2, 2], [3, 0]]), "3 layer counts"),
    (lambda d: d.update(partitions="x"), "list"),
    (lambda d: d.update(partitions=[[2, 2, 2], [6, 0, 0]]), "place 2"),
    (lambda d: d.update(layer_allreduce=[0, -1]), "'layer_allreduce'"),
    (lambda d: d.pop("layer_allreduce"), "'layer_allreduce'"),
])
def test_bad_version_4_files_are_refused_in_one_line(edit, says: str) -> None:  # type: ignore[no-untyped-def]
    data = json.loads(reformed_plan().to_json())
    edit(data)
    with pytest.raises(PlanFormatError) as exc:
        Plan.from_json(json.dumps(data))
    assert "\n" not in str(exc.value) and says in str(exc.value)


def test_relabelling_moves_each_pipeline_s_partition_and_costs_and_repair_refuses() -> None:
    from schedcomp.errors import ScheduleError
    from schedcomp.repair import repair
    from schedcomp.scenarios import relabel

    cut = Cut.of({0: (0.0, 1.2, 2.4), 1: (0.0, 1.6)}, shares=True)
    plan = reformed_plan(cut=cut)
    swapped = relabel(plan, (1, 0))
    assert swapped.partitions == ((3, 0, 3), (2, 2, 2)) and set(swapped.pipeline_costs) == {0}
    assert swapped.cut.shares and swapped.cut.share(0, 2) == 1.6
    check(swapped)
    with pytest.raises(ScheduleError, match="re-formed pipelines"):
        repair(reformed_plan(), Worker(0, 1))


def test_check_names_the_cycle_when_a_pipeline_deadlocks_beside_a_re_formed_one() -> None:
    # pp 2, dp 2, 0:1 failed, pipeline 0 re-formed onto 0:0; pipeline 1's two workers wait for each other
    # (1:0 runs B0 before F1, 1:1 runs F1 and B1 before F0), so 0:0 waits in ALLREDUCE for both segments.
    topo = Topology.of(2, 2, ["0:1"])
    seq = {Worker(1, 0): [(F, 0), (B, 0), (W, 0), (F, 1), (B, 1), (W, 1)],
           Worker(1, 1): [(F, 1), (B, 1), (W, 1), (F, 0), (B, 0), (W, 0)]}
    ops = {w: tuple(Op(k, 1, m, w.stage) for k, m in s) for w, s in seq.items()}
    ops[Worker(0, 0)] = _serial(0, 0, 2)
    layers = LayerCosts.even(CostModel.uniform(2), 2)
    order = Order(topo, 2, ops, partition=(2, 2), partitions=((4, 0), (2, 2)))
    plan = lower(order, stage_costs(layers, (2, 2)), pipeline_costs={0: stage_costs(layers, (4, 0))},
                 layer_allreduce=layers.costs.allreduce)
    with pytest.raises(ValidationError, match=r"deadlock: 1:0 instruction \d+ \(B0\.1\) waits for 1:1") as exc:
        check(plan)
    assert "0:0" not in str(exc.value).split("\n")[0]  # 0:0 only waits in ALLREDUCE: no part of the cycle
