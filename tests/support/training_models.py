"""A small float64 pipeline model with a gradient poison, and its single-process reference, for the
training-loop tests (`runtime.training`: LR schedules, global clipping, non-finite skip).

`reference_run` trains the whole model in one process the way the trainers must: `clip_grad_norm_`
over every parameter, skip the update (and the LR schedule's step) when the norm is not finite.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from momentum import ScheduledMomentum
from torch import Tensor, nn

H, ROWS = 6, 2  # hidden size, rows per micro-batch


class _PoisonFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad * float("inf")


class Poison(nn.Module):
    """Identity forward; while `active`, its backward makes every gradient through it inf or nan."""

    def __init__(self) -> None:
        super().__init__()
        self.active = False

    def forward(self, x: Tensor) -> Tensor:
        return _PoisonFn.apply(x) if self.active else x


def build_stage(stage: int, pp: int, poisoned: int = -1) -> nn.Module:
    torch.manual_seed(300 + stage)
    layers: list[nn.Module] = [nn.Linear(H, H)]
    if stage < pp - 1:
        layers.append(nn.Tanh())
    if stage == poisoned:
        layers.append(Poison())
    return nn.Sequential(*layers).double()


def poison(module: nn.Module, active: bool) -> None:
    for m in module.modules():
        if isinstance(m, Poison):
            m.active = active


def batch_for(iteration: int, chunks: int) -> tuple[Tensor, Tensor]:
    """Iteration i's global batch; odd iterations have large targets (so large gradients: clipped)."""
    g = torch.Generator().manual_seed(500 + iteration)
    x = torch.randn(chunks * ROWS, H, generator=g, dtype=torch.float64)
    y = torch.randn(chunks * ROWS, H, generator=g, dtype=torch.float64) * (8.0 if iteration % 2 else 0.5)
    return x, y


def step_lr(optimizer: Any) -> Any:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def warmup_lr(optimizer: Any) -> Any:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / 3) * 0.9 ** i)


SCHEDULES: dict[str, Callable[[Any], Any]] = {"step": step_lr, "warmup": warmup_lr}


def reference_run(pp: int, chunks: int, iterations: int, schedule: str | None, max_norm: float | None,
                  skip_nonfinite: bool, poisoned: tuple[int, int] = (-1, -1)) -> dict[str, Any]:
    """One process, the whole model: per-stage states, per-iteration losses, norms, clipped, skipped, lr."""
    stage_of_poison, poisoned_iteration = poisoned
    stages = [build_stage(s, pp, stage_of_poison) for s in range(pp)]
    optimizers = [ScheduledMomentum(m.parameters()) for m in stages]
    schedulers = [SCHEDULES[schedule](o) for o in optimizers] if schedule else []
    params = [p for m in stages for p in m.parameters()]
    out: dict[str, Any] = {"losses": [], "norms": [], "clipped": [], "skipped": [], "lr": []}
    for i in range(iterations):
        for m in stages:
            poison(m, i == poisoned_iteration)
        x, y = batch_for(i, chunks)
        for m in stages:
            x = m(x)
        loss = F.mse_loss(x, y)
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else float("inf")))
        skipped = skip_nonfinite and not torch.isfinite(torch.tensor(norm))
        out["losses"].append(loss.item())
        out["norms"].append(norm)
        out["clipped"].append(not skipped and max_norm is not None and max_norm / (norm + 1e-6) < 1.0)
        out["skipped"].append(bool(skipped))
        if not skipped:
            for o in optimizers:
                o.step()
            for s in schedulers:
                s.step()
        for o in optimizers:
            o.zero_grad()
        out["lr"].append(optimizers[0].param_groups[0]["lr"])
    out["states"] = [m.state_dict() for m in stages]
    return out
