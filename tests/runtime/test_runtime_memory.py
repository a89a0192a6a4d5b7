"""Activation memory measured by the runtime against what the compiler plans (issue 9, item 3)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from schedcomp.compiler import compile
from schedcomp.ir import InstrKind
from schedcomp.memory import over_plan_warnings, planned_vs_measured
from schedcomp.profile import activation_bytes, profile_costs
from schedcomp.runtime.gpt import GPTConfig, gpt, lm_loss, stage_memory, synthetic_batch
from schedcomp.runtime.memory import MemoryMeter
from schedcomp.runtime.stage import Stage, split_sequential

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_memory  # the job the benchmark runs: one definition for both

CONFIG = GPTConfig(vocab=64, context=32, n_layer=4, n_head=4, n_embd=64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_planned_gpt_activation_bytes_match_the_saved_tensors(dtype, stage):
    """Per micro-batch: what F saves and what B keeps for W, planned (a count per layer) vs measured."""
    split = (2, 2, 2)  # [Embed, Block], [Block, Block], [Block, Head]
    module = split_sequential(gpt(CONFIG, seed=0).to(dtype), stage, 3, split)
    stage_ = Stage(stage, 3, module, lm_loss if stage == 2 else None, lambda p: torch.optim.SGD(p, lr=0.1))
    meter = MemoryMeter(stage_, torch.device("cpu"))
    tokens, targets = synthetic_batch(CONFIG, rows=8, seed=1)
    inputs = (tokens,) if stage == 0 else (torch.randn(8, CONFIG.context, CONFIG.n_embd, dtype=dtype),)
    with meter.measure(InstrKind.F, "m"):
        out = stage_.forward("m", inputs, targets if stage == 2 else None)
    saved = meter.held
    with meter.measure(InstrKind.B, "m"):
        stage_.backward("m", () if stage == 2 else (torch.randn_like(out[0]),), split=True)
    kept = meter.held
    with meter.measure(InstrKind.W, "m"):
        stage_.backward_weight("m")
    planned_saved, planned_kept = stage_memory(CONFIG, 8, module, dtype)
    assert saved == pytest.approx(planned_saved, rel=0.10)
    assert kept == pytest.approx(planned_kept, rel=0.10)
    assert meter.held == 0 and 0 < kept < saved


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    folder = tmp_path_factory.mktemp("memory")
    plan, spans = bench_memory.run_job(4, torch.float32, "cpu", folder)
    return plan, spans, folder


def test_each_worker_peaks_within_20_percent_of_its_plan(job):
    plan, spans, _ = job
    rows = planned_vs_measured(plan, spans)
    assert [r["worker"] for r in rows] == [str(w) for w in sorted(plan.workers)]
    for r in rows:
        assert 0.8 <= r["ratio"] <= 1.2, r
    assert over_plan_warnings(rows) == []
    # The trace records memory on compute spans only, and every iteration ends holding nothing.
    compute = [s for s in spans if s.instruction.is_compute]
    assert all(s.memory is not None for s in compute)
    assert all(s.memory is None for s in spans if not s.instruction.is_compute)
    for w in plan.workers:
        for i in {s.iteration for s in spans}:
            last = max((s for s in compute if s.worker == w and s.iteration == i), key=lambda s: s.index)
            assert last.memory == 0


def test_profile_writes_measured_activation_bytes_into_the_cost_model(job, tmp_path):
    plan, spans, folder = job
    measured = profile_costs([spans])
    assert measured.memory_unit == "bytes"
    assert measured.activation == pytest.approx(plan.costs.activation, rel=0.10)
    per_stage = activation_bytes(spans, plan.topology.pp)
    assert per_stage is not None and per_stage[0] == measured.activation
    trace = next(Path(folder).glob("*.trace.json"))
    out = subprocess.run([sys.executable, "-m", "schedcomp.cli", "profile", str(trace), "-o",
                          str(tmp_path / "costs.json")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "B frees" in out.stdout
    written = json.loads((tmp_path / "costs.json").read_text())
    assert written["memory_unit"] == "bytes" and written["activation"] == pytest.approx(list(measured.activation))


def test_show_measured_draws_memory_and_warns_when_the_plan_underestimates(job, tmp_path):
    plan, _, folder = job
    trace = str(next(Path(folder).glob("*.trace.json")))
    (tmp_path / "bytes.json").write_text(plan.to_json())
    good = subprocess.run([sys.executable, "-m", "schedcomp.cli", "show", str(tmp_path / "bytes.json"),
                           "--measured", trace, "--color", "never"], capture_output=True, text=True, timeout=120)
    assert good.returncode == 0, good.stderr
    assert "planned | measured" in good.stdout and "warning" not in good.stderr
    # The same order planned in units with B freeing half: the GPT's B frees ~1%, so the later stages
    # (which defer W) hold more than planned.
    units = compile(4, 1, plan.microbatches, schedule="zb-h1", memory_limit=None)
    (tmp_path / "units.json").write_text(units.to_json())
    bad = subprocess.run([sys.executable, "-m", "schedcomp.cli", "show", str(tmp_path / "units.json"),
                          "--measured", trace, "--json"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 0, bad.stderr
    assert "warning: stage 3" in bad.stderr and len(bad.stderr.strip().splitlines()) >= 1
    rows = json.loads(bad.stdout)["measured"]["memory"]
    assert max(r["ratio"] for r in rows if r["stage"] == 3) > 1.2
