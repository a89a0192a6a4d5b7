"""A scripted `FaultSession` for a one-worker resilient job run in the test process (no store, no peers)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch.distributed as dist

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
