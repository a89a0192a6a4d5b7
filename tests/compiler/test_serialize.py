"""Plan serialisation: JSON and text round trips, malformed input, PyTorch's compute-only CSV."""

from __future__ import annotations

import contextlib
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schedcomp.compiler import compile
from schedcomp.costs import CostModel
from schedcomp.errors import LimitError, PlanFormatError
from schedcomp.ir import Instruction, Op, OpKind, Plan
from schedcomp.lower import lower
from schedcomp.serialize import (
    order_from_torch_csv,
    order_to_torch_csv,
    plan_from_json,
    plan_from_text,
    plan_to_json,
    plan_to_text,
    plan_to_torch_csv,
    read_plan,
)
from schedcomp.simulator import simulate
from schedcomp.topology import Topology, Worker

FAMILIES = ["gpipe", "1f1b", "zb-h1", "zb-h2"]


def hand_plan(**kw) -> Plan:
    streams = {
        Worker(0, 0): "LOAD[F0.0] F0.0 SEND_ACT[F0.0>0:1] RECV_GRAD[BW0.0<0:1] BW0.0 ALLREDUCE STEP",
        Worker(0, 1): "RECV_ACT[F0.0<0:0] LOAD[F0.0] F0.0 BW0.0 SEND_GRAD[BW0.0>0:0] ALLREDUCE STEP",
    }
    parsed = {w: tuple(Instruction.parse(t, w.stage) for t in text.split()) for w, text in streams.items()}
    fields = {"topology": Topology.of(2, 2, [(1, 0), (1, 1)]), "costs": CostModel.uniform(2, p2p=0.125),
              "microbatches": 1, "streams": parsed, "family": "hand", "solver": "none", "lower_bound": 2.5,
              "meta": {"note": "x", "list": [1, 2.5, None], "nested": {"a": True}}}
    fields.update(kw)
    return Plan(**fields)


def test_json_and_text_round_trip_a_hand_plan():
    plan = hand_plan()
    assert plan_from_json(plan_to_json(plan)) == plan
    assert plan_from_json(plan_to_json(plan, indent=False)) == plan
    assert plan_from_text(plan_to_text(plan)) == plan
    assert Plan.from_json(plan.to_json()) == plan and Plan.from_text(plan.to_text()) == plan
    assert read_plan(plan.to_json()) == plan and read_plan(plan.to_text()) == plan


def test_json_format_is_versioned_and_readable():
    data = json.loads(plan_to_json(hand_plan()))
    assert data["format"] == "schedcomp-plan" and data["version"] == 1
    assert data["topology"] == {"pp": 2, "dp": 2, "failed": ["1:0", "1:1"]}
    assert data["streams"]["0:1"][0] == "RECV_ACT[F0.0<0:0]"
    assert data["costs"]["p2p"] == 0.125


def test_text_form_is_one_header_line_then_one_line_per_worker():
    lines = plan_to_text(hand_plan()).splitlines()
    assert len(lines) == 3
    assert json.loads(lines[0])["format"] == "schedcomp-plan"
    assert lines[2] == "0:1: RECV_ACT[F0.0<0:0] LOAD[F0.0] F0.0 BW0.0 SEND_GRAD[BW0.0>0:0] ALLREDUCE STEP"
    # comments and blank lines are ignored
    text = "# a plan\n\n" + "\n".join(lines) + "\n\n"
    assert plan_from_text(text) == hand_plan()


def test_changing_anything_changes_equality():
    plan = hand_plan()
    assert plan_from_json(plan_to_json(plan)) != hand_plan(family="other")
    assert plan_from_json(plan_to_json(plan)) != hand_plan(lower_bound=None)


@given(family=st.sampled_from(FAMILIES), pp=st.integers(1, 5), extra=st.integers(0, 4), dp=st.integers(1, 2),
       f=st.sampled_from([0.5, 1.0, 2.0]), b=st.sampled_from([1.0, 1.5]), w=st.sampled_from([0.5, 1.0]),
       p2p=st.sampled_from([0.0, 0.1]))
def test_compiled_plans_round_trip(family, pp, extra, dp, f, b, w, p2p):
    costs = CostModel.uniform(pp, forward=f, backward_input=b, backward_weight=w, p2p=p2p)
    plan = compile(pp, dp=dp, microbatches=2 * pp + extra, schedule=family, costs=costs)
    assert plan_from_json(plan_to_json(plan)) == plan
    assert plan_from_text(plan_to_text(plan)) == plan
    # the simulation of the copy is the simulation of the original
    assert simulate(plan_from_text(plan_to_text(plan)), iterations=2).period == simulate(plan, iterations=2).period


MALFORMED_JSON = [
    "", "not json", "[]", "{}", '{"format": "other"}',
    '{"format": "schedcomp-plan", "version": 2}',
    '{"format": "schedcomp-plan", "version": 1}',
]


@pytest.mark.parametrize("text", MALFORMED_JSON)
def test_malformed_json_is_a_plan_format_error(text):
    with pytest.raises(PlanFormatError) as info:
        plan_from_json(text)
    assert "\n" not in str(info.value)


def _mutations():
    good = json.loads(plan_to_json(hand_plan()))
    edits = [
        ("topology", {"pp": 0, "dp": 1, "failed": []}),
        ("topology", {"pp": 2, "dp": 1, "failed": ["5:5"]}),
        ("topology", {"pp": 2, "dp": 1, "failed": [1]}),
        ("topology", {"pp": "2", "dp": 1, "failed": []}),
        ("topology", {"pp": 3, "dp": 2, "failed": []}),  # costs have 2 stages
        ("microbatches", 0), ("microbatches", True), ("microbatches", "4"),
        ("costs", {"forward": [1]}), ("costs", []), ("costs", {"forward": "ab", "backward_input": [1, 1],
                                                              "backward_weight": [1, 1]}),
        ("lower_bound", "x"), ("meta", []), ("family", 3),
        ("streams", []), ("streams", {"0:0": "F0.0"}), ("streams", {"0:0": [1]}),
        ("streams", {"0:0": ["F0.0", "NOPE"]}), ("streams", {"zero": []}), ("streams", {"1:0": []}),
        ("streams", {"0:0": ["SEND_ACT[F0.0<0:1]"]}), ("streams", {"0:0": ["LOAD[F0.0>0:1]"]}),
        ("streams", {"0:0": ["B[F0.0]"]}), ("streams", {"0:0": ["ALLREDUCE[F0.0]"]}),
        ("streams", {"0:0": ["SEND_ACT[F0.0>x:1]"]}),
    ]
    for key, value in edits:
        yield {**good, key: value}
    for key in ("topology", "costs", "streams", "microbatches", "meta"):
        yield {k: v for k, v in good.items() if k != key}


@pytest.mark.parametrize("data", list(_mutations()))
def test_malformed_plans_are_plan_format_errors(data):
    text = json.dumps(data)
    with pytest.raises(PlanFormatError) as info:
        plan_from_json(text)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("text", [
    "", "# only a comment\n", "not a header\n0:0: F0.0",
    plan_to_text(hand_plan()) + "garbage line\n",
    plan_to_text(hand_plan()) + "0:0: F0.0\n",  # a second line for 0:0
    plan_to_text(hand_plan()).replace("F0.0 BW0.0", "F0.0 XX0.0"),
])
def test_malformed_text_is_a_plan_format_error(text):
    with pytest.raises(PlanFormatError):
        plan_from_text(text)


@given(st.text(max_size=200))
def test_random_text_never_escapes_as_another_error(text):
    for reader in (plan_from_json, plan_from_text, read_plan):
        with contextlib.suppress(PlanFormatError):
            reader(text)


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                    max_leaves=10),
       st.sampled_from(["topology", "costs", "streams", "microbatches", "meta", "lower_bound", "version"]))
def test_random_field_values_never_escape_as_another_error(value, key):
    data = {**json.loads(plan_to_json(hand_plan())), key: value}
    with contextlib.suppress(PlanFormatError, LimitError):  # a huge count is refused by its limit
        plan_from_json(json.dumps(data))


def test_meta_that_is_not_json_is_a_plan_format_error():
    with pytest.raises(PlanFormatError, match="meta"):
        plan_to_json(hand_plan(meta={"x": object()}))


# ---- PyTorch CSV ---------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_torch_csv_round_trips_through_an_order(family):
    plan = compile(4, dp=2, microbatches=8, schedule=family)
    text = plan_to_torch_csv(plan)
    rows = text.splitlines()
    assert len(rows) == 4
    assert rows[0].split(",")[0] == "0F0"
    order = order_from_torch_csv(text, pp=4, microbatches=8, dp=2)
    assert order.microbatches == 8 and order.topology == plan.topology
    assert {w: order.ops[w] for w in plan.streams} == {w: plan.compute_ops(w) for w in plan.streams}
    assert lower(order, plan.costs).streams == plan.streams


def test_torch_csv_uses_torch_action_names_and_passes_torch_validation():
    torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    plan = compile(4, microbatches=8, schedule="zb-h1")
    text = plan_to_torch_csv(plan)
    actions = {rank: [torch_schedules._Action.from_str(c) for c in row.split(",")]
               for rank, row in enumerate(text.splitlines())}
    assert all(str(a) == c for rank, row in enumerate(text.splitlines())
               for a, c in zip(actions[rank], row.split(","), strict=True))
    kinds = {a.computation_type.value for row in actions.values() for a in row}
    assert kinds == {"F", "I", "W"}
    torch_schedules._validate_schedule(actions, 4, 4, 8)  # raises on a bad schedule
    fused = plan_to_torch_csv(compile(4, microbatches=8, schedule="1f1b"))
    assert {c[1] for c in fused.replace("\n", ",").split(",") if c} == {"F", "B"}


def test_torch_csv_import_reads_what_torch_writes():
    # torch writes None (an idle step) as an empty cell, and rows of different lengths
    text = "0F0,0F1,,0B0,0B1\n,1F0,1B0,1F1,1B1\n"
    order = order_from_torch_csv(text)
    assert order.topology.pp == 2 and order.microbatches == 2
    assert [str(op) for op in order.ops[Worker(0, 1)]] == ["F0.0", "BW0.0", "F1.0", "BW1.0"]
    assert order.ops[Worker(0, 0)][0] == Op(OpKind.F, 0, 0, 0)
    assert order_to_torch_csv(order) == "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n"


@pytest.mark.parametrize(("text", "kw", "pattern"), [
    ("", {}, "empty"),
    ("0F0,0SEND_F0\n", {}, "compute action"),
    ("0F0,1F0\n1F0\n", {}, "runs on ranks 0 and 1"),
    ("0F0,0UNSHARD\n", {}, "compute action"),
    ("0F0,0B0\n", {"pp": 2}, "rows"),
    ("0F3,0B3\n", {"microbatches": 2}, "micro-batch 3"),
    ("0X1\n", {}, "compute action"),
    ("0F\n", {}, "compute action"),
    ("\n\n", {}, "empty"),
    (",,\n", {}, "empty"),
])
def test_bad_torch_csv_is_a_plan_format_error(text, kw, pattern):
    with pytest.raises(PlanFormatError, match=pattern):
        order_from_torch_csv(text, **kw)


def test_torch_csv_export_needs_a_fault_free_plan_of_own_stages_and_pipelines():
    plan = compile(2, dp=2, microbatches=4, schedule="1f1b")
    with pytest.raises(PlanFormatError, match="fault-free"):
        plan_to_torch_csv(Plan(Topology.of(2, 2, [(1, 1)]), plan.costs, 4,
                               {w: s for w, s in plan.streams.items() if w != Worker(1, 1)}))
    # a re-routed op (pipeline 1's micro-batch on pipeline 0) has no place in the format
    streams = dict(plan.streams)
    streams[Worker(0, 0)] = (*streams[Worker(0, 0)], Instruction.compute(Op(OpKind.F, 1, 9, 0)))
    with pytest.raises(PlanFormatError, match="own stages and pipeline"):
        plan_to_torch_csv(Plan(plan.topology, plan.costs, 4, streams))


@given(st.lists(st.text(st.characters(max_codepoint=0x3000)) | st.sampled_from(['", "', "a\\b", "F1.0", ""])),
       st.sampled_from([", ", ","]))
def test_stream_lines_are_what_json_writes(texts: list[str], sep: str) -> None:
    """The writer's fast path (texts joined as they are) gives `json.dumps`'s bytes, whatever the texts."""
    from schedcomp.serialize import _json_list

    assert _json_list(texts, sep) == json.dumps(texts, separators=(sep, ":"))


def test_json_pieces_are_the_json() -> None:
    """`plan_json_pieces` (what the CLI writes a plan with) joins to `plan_to_json`, a piece per stream."""
    from schedcomp.serialize import plan_json_pieces

    plan = compile(pp=3, dp=2, microbatches=4, failed=[(1, 2)])
    pieces = list(plan_json_pieces(plan))
    assert "".join(pieces) == plan.to_json() and len(pieces) == 2 + len(plan.streams)
