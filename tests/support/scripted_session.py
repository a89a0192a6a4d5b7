"""A one-worker resilient job run in the test process: a scripted `FaultSession` (no store, no peers)
and the model it must train, trained plainly."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from momentum import Momentum
from torch import nn

from schedcomp.runtime.fault.groups import Generation
from schedcomp.runtime.fault.membership import View
from schedcomp.runtime.fault.rollback import Rollback, rollback_decision
from schedcomp.topology import Worker

ME = Worker(0, 0)


@dataclass
class ScriptedSession:
    """A `FaultSession` for one worker: commit records in a dict, each recovery agrees at once."""

    view: View = field(default_factory=lambda: View.initial(1, 1))
    store: dist.Store = field(default_factory=dist.HashStore)
    signal: threading.Event = field(default_factory=threading.Event)
    commits: dict[Worker, int] = field(default_factory=lambda: {ME: -1})
    reported: list[str] = field(default_factory=list)
    agree_timeout: float = 60.0  # bounds the record exchange of lossy recovery, as `FaultSession`'s does

    def __post_init__(self) -> None:
        self.me = ME
        self.env = SimpleNamespace(pp=1, dp=1, rejoining=False, run=0)
        self.generation = Generation(self.store, self.view, ME)  # real gloo groups of one, on the HashStore
        self.groups = SimpleNamespace(rank=0, generation=self.generation)

    def commit(self, iteration: int) -> None:
        self.commits[ME] = iteration

    def report(self, error: BaseException) -> None:
        self.reported.append(str(error))

    def recover(self) -> View:
        self.view = View(self.view.generation + 1, self.view.topology)
        return self.view

    def rollback(self) -> Rollback:
        return rollback_decision(self.commits)

    def finished(self) -> bool:
        return False

    def boundary(self, completed: int) -> None:
        return None

    def joiners(self) -> tuple[Worker, ...]:
        return ()

    def finish(self) -> None:
        pass

    def close(self) -> None:
        self.generation.close()  # group names are global: the next test builds its own


def mse_reference(model: nn.Module, batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                  iterations: int) -> dict[str, torch.Tensor]:
    """The single-process reference: `model` trained on each iteration's full batch (mean squared error,
    the mean over equal micro-batches) with `Momentum`; its final state."""
    optimizer = Momentum(model.parameters())
    for i in range(iterations):
        x, y = batch(i)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    return model.state_dict()
