"""SGD with momentum (as torch.optim.SGD computes it) and a plain-data `state_dict`, for test processes.

Not torch.optim: creating the first torch optimizer in a process imports torch._dynamo, seconds
of CPU per process on a small CI box, and the tests start many processes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn


class Momentum:
    def __init__(self, params: Iterable[nn.Parameter], lr: float = 0.05, momentum: float = 0.9) -> None:
        self.params, self.lr, self.momentum = list(params), lr, momentum
        self.buffers: dict[int, Tensor] = {}

    @torch.no_grad()
    def step(self) -> None:
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            buf = self.buffers.get(i)
            self.buffers[i] = buf = p.grad.clone() if buf is None else buf.mul_(self.momentum).add_(p.grad)
            p.add_(buf, alpha=-self.lr)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def state_dict(self) -> dict[str, Any]:
        return {"buffers": dict(self.buffers)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffers = {int(k): v.clone() for k, v in state["buffers"].items()}
