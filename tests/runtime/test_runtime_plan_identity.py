"""Ranks that hold different plans are refused at start-up with one clear error, instead of
exchanging mismatched tensors or hanging."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from schedcomp.compiler import compile
from schedcomp.errors import RuntimeSetupError
from schedcomp.runtime.launch import spawn
from schedcomp.runtime.trainer import PipelineTrainer

pytestmark = pytest.mark.slow  # every test spawns a process group


def _start(rank: int, schedules: tuple[str, ...], out: str) -> None:
    plan = compile(2, 1, microbatches=2, schedule=schedules[rank])
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    try:
        PipelineTrainer(plan, model, nn.functional.mse_loss, lambda p: torch.optim.SGD(p, lr=0.1))
        outcome = "started"
    except RuntimeSetupError as exc:
        outcome = str(exc)
    Path(out, f"rank{rank}").write_text(outcome)


def test_ranks_with_different_plans_are_refused(tmp_path: Path) -> None:
    spawn(_start, 2, (("1f1b", "zb-h1"), str(tmp_path)), timeout=120)
    for rank in range(2):
        text = (tmp_path / f"rank{rank}").read_text()
        assert "ranks [1] hold a different plan from rank 0" in text


def test_ranks_with_the_same_plan_start(tmp_path: Path) -> None:
    spawn(_start, 2, (("zb-h1", "zb-h1"), str(tmp_path)), timeout=120)
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["started", "started"]
