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


class ScheduledMomentum(torch.optim.Optimizer):
    """`Momentum` as a `torch.optim.Optimizer` (what LR schedulers take), learning rate from its param group.

    `Optimizer.__init__` is not called: it imports torch._dynamo (seconds per process). The fields an
    LR scheduler reads (`param_groups`, `defaults`, `state`) are set here instead.
    """

    def __init__(self, params: Iterable[nn.Parameter], lr: float = 0.05, momentum: float = 0.9) -> None:
        self.defaults = {"lr": lr, "momentum": momentum}
        self.param_groups = [{"params": list(params), "lr": lr, "momentum": momentum}]
        self.state = {}
        self.buffers: dict[int, Tensor] = {}

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        group = self.param_groups[0]
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            buf = self.buffers.get(i)
            self.buffers[i] = buf = p.grad.clone() if buf is None else buf.mul_(group["momentum"]).add_(p.grad)
            p.add_(buf, alpha=-group["lr"])

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.param_groups[0]["params"]:
            p.grad = None

    def state_dict(self) -> dict[str, Any]:
        """As torch.optim.SGD lays it out: per-parameter state by number, groups with their settings."""
        group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        group["params"] = list(range(len(self.param_groups[0]["params"])))
        return {"state": {i: {"momentum_buffer": b} for i, b in self.buffers.items()}, "param_groups": [group]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffers = {int(i): s["momentum_buffer"].clone() for i, s in state["state"].items()}
        self.param_groups[0].update({k: v for k, v in state["param_groups"][0].items() if k != "params"})
