"""PyTorch's compute-only CSV with several stages per rank: interleaved and ZB-V plans are written with
each action's stage, read back to the same plan (chunks and placement inferred), and pass PyTorch's own
validation; CSVs whose stages map onto ranks in no supported way are refused in one line."""

from __future__ import annotations

import pytest

from schedcomp.cli import main
from schedcomp.compiler import compile
from schedcomp.errors import PlanFormatError
from schedcomp.ir import Plan
from schedcomp.lower import lower
from schedcomp.serialize import order_from_torch_csv, plan_to_torch_csv
from schedcomp.topology import LOOP, V

CHUNKED = [("interleaved-1f1b", 4, 2, LOOP), ("interleaved-1f1b", 3, 3, LOOP), ("zb-v", 4, 2, V), ("zb-v", 2, 2, V)]


@pytest.mark.parametrize(("family", "pp", "v", "placement"), CHUNKED)
def test_chunked_plans_round_trip_through_the_csv(family: str, pp: int, v: int, placement: str) -> None:
    plan = compile(pp, dp=2, microbatches=2 * pp, schedule=family, chunks=v)
    text = plan_to_torch_csv(plan)
    rows = [row.split(",") for row in text.splitlines()]
    assert len(rows) == pp
    for rank, row in enumerate(rows):  # each rank's cells name exactly the stages it holds
        assert {int(cell[0]) for cell in row} == set(plan.topology.chunks_of(rank))
    order = order_from_torch_csv(text, pp=pp, microbatches=2 * pp, dp=2)
    assert order.topology == plan.topology and order.topology.placement == placement
    assert {w: order.ops[w] for w in plan.streams} == {w: plan.compute_ops(w) for w in plan.streams}
    assert lower(order, plan.costs).streams == plan.streams


@pytest.mark.parametrize(("family", "pp", "v", "placement"), CHUNKED)
def test_chunked_csv_passes_pytorchs_validation(family: str, pp: int, v: int, placement: str) -> None:
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    m = 2 * pp
    text = plan_to_torch_csv(compile(pp, microbatches=m, schedule=family, chunks=v))
    actions = {rank: [schedules._Action.from_str(c) for c in row.split(",")]
               for rank, row in enumerate(text.splitlines())}
    assert all(str(a) == c for rank, row in enumerate(text.splitlines())
               for a, c in zip(actions[rank], row.split(","), strict=True))
    schedules._validate_schedule(actions, pp, pp * v, m)  # raises on a bad schedule


def test_the_cli_exports_and_imports_a_zb_v_plan(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    plan = compile(4, microbatches=8, schedule="zb-v")
    src, csv, back = tmp_path / "p.json", tmp_path / "s.csv", tmp_path / "q.json"
    src.write_text(plan.to_json())
    assert main(["export-torch", str(src), "-o", str(csv)]) == 0
    assert csv.read_text().splitlines()[0].startswith("0F0,0F1,0F2,0F3,0F4,0F5,0F6,7F0")  # the turn of the V
    assert main(["import-torch", str(csv), "--microbatches", "8", "-o", str(back)]) == 0, capsys.readouterr().err
    got = Plan.from_json(back.read_text())
    assert (got.topology, got.costs, got.streams) == (plan.topology, plan.costs, plan.streams)


@pytest.mark.parametrize(("text", "pattern"), [
    ("0F0,3F0\n1F0\n", "no rank runs stage 2"),  # stage 2 is missing
    ("0F0,2F0\n1F0,3F0,4F0\n", "same number of stages"),  # 5 stages on 2 ranks: uneven
    ("0F0,1F0\n1F0\n", "runs on ranks 0 and 1"),
    ("0F0,2F0\n1F0,4F0\n3F0,5F0\n", "placements are supported"),  # 0,2 | 1,4 | 3,5: neither loop nor V
    ("0F0,5F0\n1F0,4X0\n2F0,3F0\n", "compute action"),
])
def test_chunked_csvs_that_map_onto_no_placement_are_refused(text: str, pattern: str) -> None:
    with pytest.raises(PlanFormatError, match=pattern):
        order_from_torch_csv(text)
