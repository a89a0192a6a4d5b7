"""Schedule families: op counts, shapes, memory peaks, replication over pipelines, errors."""

from __future__ import annotations

import pytest

from schedcomp.errors import ScheduleError
from schedcomp.ir import Op, OpKind
from schedcomp.schedules import FAMILIES, ONE_STAGE_FAMILIES, Family, fault_free_order, get_family
from schedcomp.topology import Topology, Worker

SHAPES = [(pp, m) for pp in (1, 2, 3, 4, 5, 8) for m in (2 * pp - 1, 2 * pp, 3 * pp + 1)]


def in_flight(ops: tuple[Op, ...]) -> int:
    """Most micro-batches whose F ran and whose W (or BW) did not yet, over the order."""
    held = peak = 0
    for op in ops:
        held += 1 if op.kind is OpKind.F else -1 if op.kind in (OpKind.W, OpKind.BW) else 0
        peak = max(peak, held)
    return peak


def warmup(ops: tuple[Op, ...]) -> int:
    """Forwards before the first backward."""
    return next(i for i, op in enumerate(ops) if op.kind is not OpKind.F)


def test_registry_names_and_fields() -> None:
    assert list(FAMILIES) == ["gpipe", "1f1b", "zb-h1", "zb-h2", "interleaved-1f1b", "zb-v"]
    for name, family in FAMILIES.items():
        assert isinstance(family, Family) and family.name == name
        assert family.description and "\n" not in family.description
    assert [FAMILIES[n].min_microbatches(4) for n in FAMILIES] == [1, 4, 4, 7, 4, 1]


@pytest.mark.parametrize("name", ONE_STAGE_FAMILIES)
@pytest.mark.parametrize(("pp", "m"), SHAPES)
def test_every_slot_once_in_dependency_order(name: str, pp: int, m: int) -> None:
    stages = FAMILIES[name].build(pp, m)
    assert len(stages) == pp
    fused = name in ("gpipe", "1f1b")
    for s, ops in enumerate(stages):
        assert all(op.stage == s and op.pipeline == 0 for op in ops)
        kinds = (OpKind.F, OpKind.BW) if fused else (OpKind.F, OpKind.B, OpKind.W)
        for kind in kinds:
            # each kind runs every micro-batch once, in micro-batch order
            assert [op.microbatch for op in ops if op.kind is kind] == list(range(m))
        assert len(ops) == len(kinds) * m
        pos = {(op.kind, op.microbatch): i for i, op in enumerate(ops)}
        for mb in range(m):
            if fused:
                assert pos[(OpKind.F, mb)] < pos[(OpKind.BW, mb)]
            else:
                assert pos[(OpKind.F, mb)] < pos[(OpKind.B, mb)] < pos[(OpKind.W, mb)]


@pytest.mark.parametrize(("pp", "m"), SHAPES)
def test_warmups_and_memory_peaks(pp: int, m: int) -> None:
    gpipe, f1b1, h1, h2 = (FAMILIES[n].build(pp, m) for n in ONE_STAGE_FAMILIES)
    assert [in_flight(ops) for ops in gpipe] == [m] * pp
    assert [warmup(ops) for ops in f1b1] == [pp - s for s in range(pp)]  # pp-1-s, then one F before BW
    assert [in_flight(ops) for ops in f1b1] == [pp - s for s in range(pp)]
    assert [warmup(ops) for ops in h1] == [pp - s for s in range(pp)]
    assert in_flight(h1[0]) == pp and max(in_flight(ops) for ops in h1) <= pp
    # ZB-H2: stage s runs 2(pp-s)-1 forwards before its first B, and never holds more than 2pp-1
    assert [warmup(ops) for ops in h2] == [2 * (pp - s) - 1 for s in range(pp)]
    assert in_flight(h2[0]) == 2 * pp - 1 and max(in_flight(ops) for ops in h2) <= 2 * pp - 1


@pytest.mark.parametrize(("pp", "m"), SHAPES)
def test_zb_h1_defers_w_to_the_tail(pp: int, m: int) -> None:
    """Stage s keeps s of its W passes back for the end, where 1F1B's cooldown bubble is."""
    for s, ops in enumerate(FAMILIES["zb-h1"].build(pp, m)):
        last_b = max(i for i, op in enumerate(ops) if op.kind is OpKind.B)
        assert len(ops) - 1 - last_b == s + 1  # the W of the last B, plus s held back
        assert all(op.kind is OpKind.W for op in ops[last_b + 1 :])


def test_zb_h2_tail_on_the_last_stage() -> None:
    """The parallelogram: after its last B the last stage runs that B's W plus 2pp-2 deferred ones."""
    pp, m = 4, 8
    last = FAMILIES["zb-h2"].build(pp, m)[-1]
    last_b = max(i for i, op in enumerate(last) if op.kind is OpKind.B)
    assert len(last) - 1 - last_b == 2 * pp - 1
    assert " ".join(str(op) for op in last[:6]) == "F0.0 B0.0 F1.0 B1.0 F2.0 B2.0"


def _torch_rank_ops(pp: int, m: int, rank: int, zero_bubble: bool) -> list[str]:
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    get = getattr(schedules, "_get_1f1b_rank_ops", None)
    if get is None:
        pytest.skip("this torch has no _get_1f1b_rank_ops")
    kinds = {"FORWARD": "F", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W", "FULL_BACKWARD": "BW"}
    w = min(pp - 1 - rank, m)
    ops = get(1, pp, w, m - w, w, rank, lambda _: rank, lambda _: rank, rank if zero_bubble else 0,
              enable_zero_bubble=zero_bubble)
    return [f"{kinds[a.computation_type.name]}{a.microbatch_index}.0" for a in ops if a is not None]


@pytest.mark.parametrize(("pp", "m"), [(1, 1), (2, 3), (4, 4), (4, 8), (5, 11), (8, 16)])
def test_1f1b_and_zb_h1_match_pytorch(pp: int, m: int) -> None:
    """Our 1F1B and ZB-H1 are PyTorch's Schedule1F1B and ZB1P orders (one stage per rank)."""
    for name, zero_bubble in (("1f1b", False), ("zb-h1", True)):
        stages = FAMILIES[name].build(pp, m)
        for rank in range(pp):
            assert [str(op) for op in stages[rank]] == _torch_rank_ops(pp, m, rank, zero_bubble)


def test_fault_free_order_replicates_over_pipelines() -> None:
    order = fault_free_order("zb-h1", Topology(3, 2), 5)
    assert order.family == "zb-h1" and order.microbatches == 5
    assert sorted(order.ops) == [Worker(d, s) for d in range(2) for s in range(3)]
    base = FAMILIES["zb-h1"].build(3, 5)
    for w, ops in order.ops.items():
        assert all(op.pipeline == w.pipeline and op.stage == w.stage for op in ops)
        assert [(op.kind, op.microbatch) for op in ops] == [(op.kind, op.microbatch) for op in base[w.stage]]
    assert order.runner()[(1, 4, 2)] == Worker(1, 2)


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda: fault_free_order("pipedream", Topology(4), 8), ["unknown", "gpipe, 1f1b, zb-h1, zb-h2"]),
        (lambda: get_family("ZB-H1"), ["unknown"]),
        (lambda: fault_free_order("zb-h2", Topology(4), 6), ["at least 7", "microbatches >= 7"]),
        (lambda: fault_free_order("1f1b", Topology(4), 3), ["at least 4"]),
        (lambda: fault_free_order("gpipe", Topology(4), 0), ["at least 1"]),
        (lambda: fault_free_order("1f1b", Topology.of(4, 2, [(1, 2)]), 8), ["1:2", 'schedule="adaptive"']),
    ],
)
def test_errors_say_how_to_fix(call, words: list[str]) -> None:
    with pytest.raises(ScheduleError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message
