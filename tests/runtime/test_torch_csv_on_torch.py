"""Our exported CSV runs on PyTorch's own pipeline runtime (`_PipelineScheduleRuntime._load_csv`), with
several stages per rank: the interleaved 1F1B plan loaded into `ScheduleLoopedBFS` (whose own order
differs, so the CSV is what runs) and the ZB-V plan into `ScheduleZBVZeroBubble` (split backward: I
and W actions). The gradients PyTorch computes equal one process's on the whole batch (float64, 1e-10).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from schedcomp.compiler import compile
from schedcomp.runtime.launch import spawn
from schedcomp.serialize import plan_to_torch_csv

pytestmark = pytest.mark.slow  # spawns a process group

PP, CHUNKS, M, ROWS, H = 2, 2, 4, 2, 4
RUNS = {"interleaved-1f1b": "ScheduleLoopedBFS", "zb-v": "ScheduleZBVZeroBubble"}  # our plan -> their schedule


def chunk(stage: int) -> nn.Module:
    torch.manual_seed(100 + stage)
    return nn.Sequential(nn.Linear(H, H), nn.Tanh()).double()


def batch() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(3)
    return (torch.randn(M * ROWS, H, generator=g, dtype=torch.float64),
            torch.randn(M * ROWS, H, generator=g, dtype=torch.float64))


def run_on_torch(rank: int, outdir: str) -> None:
    """In each process: load our CSV into PyTorch's schedule, run one step, save each held stage's gradients."""
    from torch.distributed.pipelining import PipelineStage, schedules

    for family, schedule_name in RUNS.items():
        plan = compile(PP, microbatches=M, schedule=family, chunks=CHUNKS)
        path = Path(outdir) / f"{family}.csv"
        if rank == 0:
            path.write_text(plan_to_torch_csv(plan))
        torch.distributed.barrier()
        held = plan.topology.chunks_of(rank)
        modules = {s: chunk(s) for s in held}
        stages = [PipelineStage(modules[s], s, PP * CHUNKS, torch.device("cpu")) for s in held]
        schedule = getattr(schedules, schedule_name)(stages, M, loss_fn=nn.functional.mse_loss)
        schedule._load_csv(str(path))
        order = [str(a) for a in schedule.pipeline_order[rank] if a is not None]
        x, y = batch()
        last = PP * CHUNKS - 1 in held
        schedule.step(*((x,) if rank == 0 else ()), target=y if last else None)  # inputs at stage 0's rank
        grads = {s: {n: p.grad for n, p in m.named_parameters()} for s, m in modules.items()}
        torch.save({"order": order, "grads": grads}, Path(outdir) / f"{family}.{rank}.pt")


def reference() -> dict[int, dict[str, Tensor]]:
    modules = [chunk(s) for s in range(PP * CHUNKS)]
    x, y = batch()
    nn.functional.mse_loss(nn.Sequential(*modules)(x), y).backward()
    return {s: {n: p.grad for n, p in m.named_parameters()} for s, m in enumerate(modules)}


@pytest.mark.timeout(180)
def test_exported_chunked_csvs_run_on_pytorchs_runtime(tmp_path: Path) -> None:
    pytest.importorskip("torch.distributed.pipelining")
    spawn(run_on_torch, PP, (str(tmp_path),), timeout=150)
    want = reference()
    for family in RUNS:
        rows = (tmp_path / f"{family}.csv").read_text().splitlines()
        for rank in range(PP):
            result = torch.load(tmp_path / f"{family}.{rank}.pt")
            assert result["order"] == rows[rank].split(","), f"{family}: rank {rank} runs PyTorch's order, not ours"
            for stage, grads in result["grads"].items():
                for name, got in grads.items():
                    err = (got - want[stage][name]).abs().max().item()
                    assert err <= 1e-10, f"{family}: stage {stage} {name} is off by {err:.3g}"
