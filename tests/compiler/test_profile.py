"""`schedcomp profile`: a cost model recovered from timelines (simulated ones stand in for measured)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from schedcomp.cli import main
from schedcomp.compiler import compile
from schedcomp.costs import CostModel
from schedcomp.draw.trace import write_chrome_trace
from schedcomp.errors import CostModelError
from schedcomp.profile import MS, profile_costs
from schedcomp.simulator import simulate
from schedcomp.topology import Worker

STRAGGLER = Worker(1, 2)


def _costs(stages: int, slow: Worker = STRAGGLER) -> CostModel:
    """Distinct costs per (virtual) stage, and one straggler at half speed."""
    return CostModel(
        forward=tuple(1.0 + 0.25 * s for s in range(stages)),
        backward_input=tuple(1.5 + 0.1 * s for s in range(stages)),
        backward_weight=tuple(0.75 + 0.05 * s for s in range(stages)),
        p2p=0.3,
        allreduce=tuple(0.4 + 0.1 * s for s in range(stages)),
        optimizer=tuple(0.2 + 0.01 * s for s in range(stages)),
        speed={slow: 0.5},
    )


@pytest.mark.parametrize("schedule", ["zb-h1", "1f1b"])
def test_profile_recovers_the_simulated_costs(schedule: str) -> None:
    pp, dp = 4, 2
    truth = _costs(pp)
    plan = compile(pp, dp, microbatches=8, schedule=schedule, costs=truth)
    spans = simulate(plan, iterations=3).spans
    got = profile_costs([spans])  # simulated units are read as seconds: the model comes out x1000
    assert got.pp == pp
    assert got.forward == pytest.approx([MS * f for f in truth.forward])
    if schedule == "zb-h1":
        assert got.backward_input == pytest.approx([MS * b for b in truth.backward_input])
        assert got.backward_weight == pytest.approx([MS * w for w in truth.backward_weight])
    else:  # fused backwards only: split by b_share
        fused = [MS * (b + w) for b, w in zip(truth.backward_input, truth.backward_weight, strict=True)]
        assert [b + w for b, w in zip(got.backward_input, got.backward_weight, strict=True)] == pytest.approx(fused)
        assert got.backward_input == pytest.approx([f / 2 for f in fused])
    assert got.optimizer == pytest.approx([MS * o for o in truth.optimizer])
    assert got.allreduce == pytest.approx([MS * a for a in truth.allreduce])
    assert got.p2p == pytest.approx(MS * truth.p2p)
    assert set(got.speed) == {Worker(1, 2)}
    assert got.speed[Worker(1, 2)] == pytest.approx(0.5)


def test_profile_without_waiting_receivers_reports_no_p2p() -> None:
    plan = compile(2, 1, microbatches=4, schedule="1f1b", costs=CostModel.uniform(2))
    got = profile_costs([simulate(plan, iterations=2).spans])
    assert got.p2p == 0.0
    assert got.allreduce == (0.0, 0.0)  # one worker per stage: nothing to reduce


def test_profile_rejects_traces_missing_a_stage() -> None:
    plan = compile(2, 1, microbatches=4, schedule="1f1b")
    spans = [s for s in simulate(plan, iterations=2).spans if s.worker.stage == 1]
    with pytest.raises(CostModelError, match="stage 0"):
        profile_costs([spans])


def test_cli_profile_writes_a_cost_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    truth = _costs(2)
    plan = compile(2, 1, microbatches=4, schedule="zb-h1", costs=CostModel(
        forward=truth.forward[:2], backward_input=truth.backward_input[:2], backward_weight=truth.backward_weight[:2]))
    trace, out = tmp_path / "trace.json", tmp_path / "costs.json"
    write_chrome_trace(simulate(plan, iterations=3).spans, trace, seconds_per_unit=1e-3)  # units are ms
    assert main(["profile", str(trace), "-o", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    got = CostModel.from_dict(json.loads(out.read_text()))
    assert got.forward == pytest.approx(truth.forward[:2])
    assert got.backward_weight == pytest.approx(truth.backward_weight[:2])
    assert main(["profile", str(tmp_path / "missing.json")]) == 2


@pytest.mark.parametrize(("schedule", "pp"), [("interleaved-1f1b", 2), ("zb-v", 2), ("zb-v", 3)])
def test_profile_costs_each_chunk_of_virtual_stages(schedule: str, pp: int) -> None:
    """Traces of a plan with virtual stages give the model's pp x chunks entries, each chunk its own costs."""
    stages = 2 * pp
    truth = _costs(stages, slow=Worker(1, 1))
    plan = compile(pp, 2, microbatches=8, schedule=schedule, chunks=2, costs=truth)
    got = profile_costs([simulate(plan, iterations=3).spans])
    assert got.pp == stages
    assert got.forward == pytest.approx([MS * f for f in truth.forward])
    fused = [MS * (b + w) for b, w in zip(truth.backward_input, truth.backward_weight, strict=True)]
    assert [b + w for b, w in zip(got.backward_input, got.backward_weight, strict=True)] == pytest.approx(fused)
    if schedule == "zb-v":  # split backward: each part is measured
        assert got.backward_weight == pytest.approx([MS * w for w in truth.backward_weight])
    assert set(got.speed) == {Worker(1, 1)} and got.speed[Worker(1, 1)] == pytest.approx(0.5)
    assert got.p2p == pytest.approx(MS * truth.p2p)
    # a worker's one STEP and one all-reduce serve all its chunks: the sums per worker are exact
    for position in range(pp):
        chunks = plan.topology.chunks_of(position)
        assert len(chunks) == 2
        assert got.optimizer_of(chunks) == pytest.approx(MS * truth.optimizer_of(chunks))
        assert got.allreduce_of(chunks) == pytest.approx(MS * truth.allreduce_of(chunks))
    # and the recovered model times the plan as the true one does (both in ms)
    again = compile(pp, 2, microbatches=8, schedule=schedule, chunks=2, costs=got)
    assert simulate(again).period == pytest.approx(MS * simulate(plan).period)


def test_measured_peaks_leave_out_the_first_iteration_of_several() -> None:
    """On CUDA a process's first matmul also allocates cuBLAS's workspace (tens of MiB): each worker is read
    from its second iteration (and a replacement from its own second); a trace of one iteration is read whole."""
    from schedcomp.profile import measured_peaks
    from schedcomp.timeline import Span

    plan = compile(1, 1, 2, schedule="1f1b")
    worker = Worker(0, 0)
    forward = next(ins for ins in plan.streams[worker] if ins.op is not None)

    def span(iteration: int, peak: float) -> Span:
        return Span(worker, iteration, 0, forward, 0.0, 1.0, memory=peak / 2, memory_peak=peak)

    assert measured_peaks([span(0, 70e6), span(1, 1.8e6), span(2, 1.7e6)]) == {worker: 1.8e6}
    assert measured_peaks([span(0, 70e6)]) == {worker: 70e6}
    # A replacement (its iterations resume after a gap) starts a new process: its first is left out too; a
    # worker that joins late is read from its own second iteration.
    late = Worker(1, 0)
    spans = [span(0, 1e6), span(1, 1.5e6), span(4, 70e6), span(5, 1.6e6)]
    spans += [Span(late, i, 0, forward, 0.0, 1.0, memory_peak=p) for i, p in ((3, 70e6), (4, 1.2e6))]
    assert measured_peaks(spans) == {worker: 1.6e6, late: 1.2e6}
