"""The process of the GPU layer-move test (`test_gpu_moves.py`): a pipeline on NCCL whose plan switches
move layers and their AdamW state between GPUs (`runtime.moves`); its layers' final state as JSON.

Joined as torchrun would (`init_distributed` picks "cpu:gloo,cuda:nccl"), every torch.distributed call
audited (`dist_audit.Audit`): a move's messages must be CUDA tensors on the NCCL group.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from dist_audit import Audit
from torch import Tensor, nn

from schedcomp.ir import Plan

H, ROWS, LAYERS = 16, 4, 4
CUTS = ((2, 2), (3, 1), (1, 3))  # two steps on each: layers move both ways


def model() -> nn.Sequential:
    torch.manual_seed(11)
    return nn.Sequential(*(nn.Sequential(nn.Linear(H, H), nn.Tanh()) for _ in range(LAYERS))).double()


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01, foreach=False)


def batch(i: int, chunks: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(90 + i)
    return (torch.randn(chunks * ROWS, H, generator=g, dtype=torch.float64),
            torch.randn(chunks * ROWS, H, generator=g, dtype=torch.float64))


def reference(chunks: int, device: torch.device) -> list[dict[str, list]]:
    """The whole model trained in one process on `device` (two steps per cut)."""
    whole = model().to(device)
    optimizer = adamw(whole.parameters())
    for i in range(2 * len(CUTS)):
        x, y = (t.to(device) for t in batch(i, chunks))
        F.mse_loss(whole(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [{k: v.cpu().tolist() for k, v in layer.state_dict().items()} for layer in whole]


def train_moving(rank: int, plan_json: str, outdir: str) -> None:
    from schedcomp.runtime import PipelineTrainer

    plan = Plan.from_json(plan_json)
    chunks = plan.topology.dp * plan.microbatches
    whole = model()
    with Audit() as audit:
        trainer = PipelineTrainer(dataclasses.replace(plan, partition=CUTS[0]), whole, F.mse_loss, adamw)
        i = 0
        for cut in CUTS:
            trainer.use_plan(dataclasses.replace(plan, partition=cut))
            for _ in range(2):
                float(trainer.step(batch(i, chunks)))
                i += 1
    first = sum(trainer.partition[: trainer.worker.stage])
    layers = {str(first + k): {n: v.cpu().tolist() for n, v in layer.state_dict().items()}
              for k, layer in enumerate(trainer.stage.module)}
    devices = sorted({p.device.type for p in trainer.stage.params})
    out = {"layers": layers, "devices": devices, "calls": sorted(audit.names()),
           "mismatches": [repr(c) for c in audit.mismatches()],
           "reference": reference(chunks, trainer.device) if rank == 0 else None}
    (Path(outdir) / f"moves.{rank}.json").write_text(json.dumps(out))
    trainer.close()
