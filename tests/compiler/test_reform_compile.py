"""Re-formed pipelines timed and compiled: the per-segment all-reduce in `simulate`, and `compile(reform=...)`."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedcomp import compile
from schedcomp.check import check
from schedcomp.costs import CostModel
from schedcomp.errors import MemoryLimitError, ScheduleError, ValidationError
from schedcomp.graph import critical_path
from schedcomp.ir import InstrKind, Op, OpKind, Order, Plan
from schedcomp.layers import LayerCosts, stage_costs
from schedcomp.lower import lower
from schedcomp.simulator import simulate
from schedcomp.topology import Topology, Worker


def _two_by_two() -> Plan:
    """pp 2, dp 2, 1:1 failed, pipeline 1 re-formed (1:0 holds all four layers); one micro-batch each, F = B = W
    = 0.5 per layer, all-reduce 1 per layer. Segments: layers 0-1 over 0:0, 1:0; layers 2-3 over 0:1, 1:0."""
    layers = LayerCosts.even(CostModel.uniform(2, allreduce=2.0), 2)
    ops = {w: tuple(Op(k, w.pipeline, 0, w.stage) for k in (OpKind.F, OpKind.B, OpKind.W))
           for w in (Worker(0, 0), Worker(0, 1), Worker(1, 0))}
    order = Order(Topology.of(2, 2, ["1:1"]), 1, ops, partition=(2, 2), partitions=((2, 2), (4, 0)))
    return lower(order, stage_costs(layers, (2, 2)), pipeline_costs={1: stage_costs(layers, (4, 0))},
                 layer_allreduce=layers.costs.allreduce)


def test_an_all_reduce_is_one_collective_per_segment_in_layer_order() -> None:
    plan = _two_by_two()
    sim = simulate(plan)
    # 0:0 F 0-1, 0:1 F 1-2 B 2-3 W 3-4 (at ALLREDUCE at 4), 0:0 B 3-4 W 4-5 (at 5); 1:0 F 0-2 B 2-4 W 4-6 (at 6).
    # Layers 0-1 (0:0, 1:0): 6-8. Layers 2-3 (0:1, 1:0): 1:0 is free at 8, so 8-10. One collective per stage
    # group would have let 0:1 reduce with 1:0 at 6 instead.
    spans = {(s.worker, str(s.instruction)): (s.start, s.end) for s in sim.spans if s.iteration == 0
             and s.instruction.kind is InstrKind.ALLREDUCE}
    assert spans == {(Worker(0, 0), "ALLREDUCE"): (6.0, 8.0), (Worker(0, 1), "ALLREDUCE"): (8.0, 10.0),
                     (Worker(1, 0), "ALLREDUCE"): (6.0, 10.0)}
    assert sim.makespan == pytest.approx(10.0)
    unchecked = simulate(Plan.from_json(plan.to_json()), validate=False)  # paired by key, over the gap
    assert unchecked.iteration_ends == sim.iteration_ends
    with pytest.raises(ScheduleError, match="re-formed pipelines"):
        critical_path(plan)


def _compiled(failed: list[str], limit: object = "fault-free") -> Plan:
    return compile(pp=4, dp=4, microbatches=8, failed=failed, layers=4, reform=(3,), memory_limit=limit)


def test_compile_re_forms_a_pipeline_with_shares_by_throughput() -> None:
    plan = _compiled(["3:1"])
    assert plan.partitions is not None and plan.partitions[:3] == ((4, 4, 4, 4),) * 3
    assert plan.partitions[3][1] == 0 and sum(plan.partitions[3]) == 16
    assert Worker(3, 1) not in plan.streams and set(plan.pipeline_costs) == {3}
    shares = [plan.cut.share(d, 8) for d in range(4)]
    assert math.fsum(shares) == pytest.approx(32.0) and shares[3] < 8 < shares[0]  # the shallow one takes fewer
    assert plan.meta["reform"]["shares"] == "throughput"
    # Its period is what the simulator gives the plan as check proved it, and as read back and checked again.
    again = Plan.from_json(plan.to_json())
    check(again)
    assert simulate(again).period == simulate(plan).period
    assert simulate(plan).period < simulate(compile(pp=4, dp=4, microbatches=8, layers=4)).period * 1.25


@pytest.mark.parametrize("limit", [None, "fault-free"])
def test_re_formed_pipelines_match_or_beat_re_routing_where_failures_are_concentrated(limit: object) -> None:
    failed = ["3:1", "3:2"]  # two of pipeline 3's four workers: re-routing loads stages 1 and 2 with its work
    reformed = simulate(_compiled(failed, limit)).period
    rerouted = simulate(compile(pp=4, dp=4, microbatches=8, failed=failed, layers=4, memory_limit=limit,
                                reform="never")).period
    assert reformed <= rerouted * (1 + 1e-9)


def test_finer_pieces_fit_a_re_formed_pipeline_whose_stage_cannot_hold_a_whole_micro_batch() -> None:
    # 1:2 takes all 8 layers: under the fault-free limit its stage has room 3 for activations, less than a
    # whole micro-batch's 4 but more than a half one's: the 2x finer pieces fit.
    job = {"pp": 4, "dp": 2, "microbatches": 8, "failed": ["1:0", "1:1", "1:3"], "layers": 2, "reform": (1,)}
    plan = compile(**job, memory_limit="fault-free")  # type: ignore[arg-type]
    assert plan.meta["reform"]["finer"] == 2 and plan.partitions is not None and plan.partitions[1] == (0, 0, 8, 0)
    assert plan.pipeline_costs[1].limit_at(2) == 3.0 and max(plan.cut.sizes(1, 8)) * 4 <= 3.0
    check(plan)
    # Where not even the finest pieces fit, the refusal is compile's one line, saying what to change.
    with pytest.raises(MemoryLimitError, match=r"no re-formed plan fits the memory limit.*raise memory_limit") as exc:
        compile(**job, memory_limit=0.5)  # type: ignore[arg-type]
    assert "one piece's" in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"reform": (3,)}, "per-layer costs"),
    ({"reform": (2,), "layers": 2}, "lost no worker"),
    ({"reform": (3,), "layers": 2, "failed": ["3:1", "2:0"]}, "are not re-formed"),
    ({"reform": (3,), "layers": 2, "recut": True}, "drop recut"),
])
def test_compile_refuses_reform_it_cannot_build_in_one_line(kwargs: dict[str, object], says: str) -> None:
    args: dict[str, object] = {"pp": 4, "dp": 4, "microbatches": 8, "failed": ["3:1"], **kwargs}
    with pytest.raises(ScheduleError, match=says) as exc:
        compile(**args)  # type: ignore[arg-type]
    assert "\n" not in str(exc.value)


def test_the_cli_compiles_a_re_formed_plan(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    import json

    from schedcomp.cli import main

    out = tmp_path / "plan.json"
    assert main(["compile", "--pp", "4", "--dp", "2", "--microbatches", "4", "--failed", "1:2", "--layers", "2",
                 "--reform", "1", "--json", "-o", str(out)]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["reform"]["pipelines"] == [1] and facts["within_memory_limit"] is True
    plan = Plan.from_json(out.read_text())
    assert plan.partitions is not None and plan.partitions[1][2] == 0
    assert simulate(plan).period == pytest.approx(facts["period"])


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 4), st.integers(2, 3), st.integers(1, 3), st.data())
def test_random_re_formed_jobs_compile_to_plans_that_check_round_trip_and_time_alike(  # type: ignore[no-untyped-def]
        pp: int, dp: int, k: int, data) -> None:
    d = data.draw(st.integers(0, dp - 1))
    dead = data.draw(st.sets(st.integers(0, pp - 1), min_size=1, max_size=pp - 1))
    m = data.draw(st.integers(pp, pp + 2))
    plan = compile(pp=pp, dp=dp, microbatches=m, failed=[(d, s) for s in dead], layers=k, reform=(d,),
                   memory_limit=None)
    assert plan.partitions is not None and all(plan.partitions[d][s] == 0 for s in dead)
    again = Plan.from_json(plan.to_json())
    assert again == plan
    check(again)
    assert simulate(again, validate=False).iteration_ends == simulate(plan).iteration_ends


MEMORY_JOBS = [  # re-formed jobs under the default limit, and whether the pre-test refuses a variant of theirs
    ({"pp": 4, "dp": 2, "microbatches": 8, "failed": ["1:0", "1:1", "1:3"], "layers": 2, "reform": (1,)}, False),
    ({"pp": 4, "dp": 8, "microbatches": 8, "failed": ["3:1"], "layers": 4, "reform": (3,)}, True),
    ({"pp": 8, "dp": 4, "microbatches": 8, "failed": ["0:3", "1:3"], "layers": 4, "reform": (0, 1)}, True),
    ({"pp": 3, "dp": 3, "microbatches": 4, "failed": ["0:2", "2:0"], "layers": 2, "reform": (0, 2)}, True),
    ({"pp": 4, "dp": 2, "microbatches": 8, "failed": ["1:1"], "layers": 3, "reform": (1,)}, True),
]
"""(The first one's whole pieces have no room by the static-memory rule: refused before the pre-test.)"""


@pytest.mark.parametrize(("job", "fires"), MEMORY_JOBS)
def test_the_memory_pre_test_refuses_exactly_the_variants_check_refuses(  # type: ignore[no-untyped-def]
        job: dict[str, object], fires: bool, monkeypatch) -> None:
    # `compile_reformed` refuses a variant over the limit before lowering it (`_over_limit`): each verdict is
    # `check`'s on the lowered variant, and the kept plan is the one compiled without the pre-test.
    import schedcomp.reform as reform

    verdicts: list[tuple[Order, dict[int, CostModel], bool]] = []
    pre_test = reform._over_limit

    def spy(order: Order, costs: CostModel, own: dict[int, CostModel]) -> bool:
        verdicts.append((order, own, pre_test(order, costs, own)))
        return verdicts[-1][2]

    monkeypatch.setattr(reform, "_over_limit", spy)
    plan = compile(**job)  # type: ignore[arg-type]
    layers = LayerCosts.even(CostModel.uniform(job["pp"]), job["layers"])  # type: ignore[arg-type]
    for order, own, over in verdicts:
        lowered = lower(order, plan.costs, pipeline_costs=own, layer_allreduce=layers.costs.allreduce)
        try:
            check(lowered)
            refused = False
        except ValidationError as exc:
            assert "memory_limit" in str(exc)
            refused = True
        assert over == refused
    monkeypatch.setattr(reform, "_over_limit", lambda *args: False)
    assert compile(**job).to_json() == plan.to_json()  # type: ignore[arg-type]
    assert any(over for _, _, over in verdicts) == fires  # (where it fires, this test is not vacuous)
