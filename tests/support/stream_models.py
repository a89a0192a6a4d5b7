"""A float64 pipeline model with dropout, and its single-process reference drawing as the runtime does.

The runtime gives each forward of a stage on a micro-batch a random stream of its own
(`runtime.rng`). `stream_reference` trains the whole model in one process the same way: each
micro-batch goes down every stage under that stage's stream for it, its loss scaled by
1 / chunks, the gradients summed over the micro-batches (in order: the runtime's order differs,
which is the point), then every stage steps. Micro-batch (p, m) is chunk p * microbatches + m.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from momentum import Momentum
from torch import Tensor, nn

from schedcomp.runtime.data import chunk_index, micro_batch
from schedcomp.runtime.rng import drawing, stream_seed

DROPOUT = 0.3
SEED = 2026


def noisy_stage(stage: int, pp: int, hidden: int = 8) -> nn.Module:
    """Linear-Tanh-Dropout (the last stage: Linear-Dropout-Linear, so the loss sees a mask too)."""
    torch.manual_seed(700 + stage)
    if stage < pp - 1:
        return nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh(), nn.Dropout(DROPOUT)).double()
    return nn.Sequential(nn.Linear(hidden, hidden), nn.Dropout(DROPOUT), nn.Linear(hidden, hidden)).double()


def stream_reference(build: Callable[[int], nn.Module], pp: int, dp: int, microbatches: int, iterations: int,
                     batch_for: Callable[[int], tuple[Tensor, Tensor]], seed: int = SEED,
                     make_optimizer: Callable[[Any], Any] = Momentum) -> list[dict[str, Tensor]]:
    """Every stage's state after `iterations` fault-free steps, each micro-batch's forward on its own stream."""
    stages = [build(s) for s in range(pp)]
    optimizers = [make_optimizer(m.parameters()) for m in stages]
    chunks = dp * microbatches
    for i in range(iterations):
        x_all, y_all = batch_for(i)
        for p in range(dp):
            for m in range(microbatches):
                index = chunk_index(p, m, microbatches)
                x = micro_batch(x_all, index, chunks)
                for s, module in enumerate(stages):
                    with drawing(stream_seed(seed, i, s, p, m), torch.device("cpu")):
                        x = module(x)
                (F.mse_loss(x, micro_batch(y_all, index, chunks)) / chunks).backward()
        for o in optimizers:
            o.step()
            o.zero_grad()
    return [m.state_dict() for m in stages]
