"""Deterministic resume: training continued from a checkpoint equals uninterrupted training (float64, 1e-10).

The stage is saved and restored the way the runtime does it (`runtime.fault.checkpoint`:
`AsyncCheckpointer.save`, `latest_complete`, `restore` into a freshly built stage whose parameters and
optimizer differ), with Adam's state (moments and step count) and dropout. The checkpoint holds no
torch RNG state, so the model draws its dropout masks the way the runtime draws its data
(`runtime.gpt.synthetic_batch`): from a generator seeded by (seed, iteration), which a resumed run
rebuilds from the iteration the checkpoint records. The two control runs show each piece is needed:
a fresh optimizer state, or masks from the global RNG, do not resume to the same model.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from schedcomp.runtime.fault.checkpoint import AsyncCheckpointer, latest_complete, restore

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # single-process DCP, by design
ITERATIONS, SAVED_AFTER, SEED = 6, 2, 1234  # checkpoint after iteration 2, resume at 3


class Stage(nn.Module):
    """Two linear layers with dropout whose mask comes from an explicit generator (None: global RNG)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a, self.b = nn.Linear(8, 16).double(), nn.Linear(16, 1).double()

    def forward(self, x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        keep = torch.rand(h.shape, generator=generator, dtype=torch.float64) >= 0.25
        return self.b(h * keep / 0.75)


def batch(iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED * 1000 + iteration)
    x = torch.randn(32, 8, generator=g, dtype=torch.float64)
    return x, x.sum(dim=1, keepdim=True).sin()


def build(seed: int) -> tuple[Stage, torch.optim.Optimizer]:
    stage = Stage(seed)
    return stage, torch.optim.Adam(stage.parameters(), lr=0.05, weight_decay=0.01)


def train(stage: Stage, optimizer: torch.optim.Optimizer, iterations: range, *, masks_from_iteration: bool = True,
          saver: AsyncCheckpointer | None = None) -> None:
    for i in iterations:
        generator = torch.Generator().manual_seed(SEED * 7919 + i) if masks_from_iteration else None
        x, y = batch(i)
        loss = (stage(x, generator) - y).square().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if saver is not None:
            saver.after_step(i, stage, optimizer)
    if saver is not None:
        saver.wait()


def params(stage: Stage) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in stage.parameters()])


def resumed(tmp_path, *, restore_optimizer: bool = True, masks_from_iteration: bool = True) -> Stage:
    first, opt = build(0)
    train(first, opt, range(SAVED_AFTER + 1), masks_from_iteration=masks_from_iteration,
          saver=AsyncCheckpointer(tmp_path, stage=0, every=SAVED_AFTER + 1))
    torch.manual_seed(999)  # the process that resumes has another global RNG state
    iteration = latest_complete(tmp_path, pp=1)
    assert iteration == SAVED_AFTER
    stage, opt = build(1)  # other initial parameters: everything must come from the checkpoint
    if restore_optimizer:
        restore(tmp_path, iteration, 0, stage, opt)
    else:
        restore(tmp_path, iteration, 0, stage, torch.optim.Adam(stage.parameters(), lr=0.05, weight_decay=0.01))
    train(stage, opt, range(iteration + 1, ITERATIONS), masks_from_iteration=masks_from_iteration)
    return stage


def uninterrupted(*, masks_from_iteration: bool = True) -> Stage:
    torch.manual_seed(42)
    stage, opt = build(0)
    train(stage, opt, range(ITERATIONS), masks_from_iteration=masks_from_iteration)
    return stage


def test_resume_from_a_checkpoint_equals_uninterrupted_training(tmp_path):
    reference = params(uninterrupted())
    again = params(resumed(tmp_path))
    assert torch.allclose(again, reference, rtol=0, atol=1e-10)
    assert not torch.equal(reference, params(build(0)[0]))  # it trained


def test_the_optimizer_state_is_needed(tmp_path):
    reference = params(uninterrupted())
    without = params(resumed(tmp_path, restore_optimizer=False))
    assert (without - reference).abs().max() > 1e-6


def test_masks_from_the_global_rng_do_not_resume(tmp_path):
    reference = params(uninterrupted(masks_from_iteration=False))
    drifted = params(resumed(tmp_path, masks_from_iteration=False))
    assert (drifted - reference).abs().max() > 1e-6
