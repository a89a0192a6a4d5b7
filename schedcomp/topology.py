"""Workers and the job's topology: pipeline depth, data-parallel width, failed workers."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from schedcomp.errors import TopologyError


@dataclass(frozen=True, order=True, slots=True)
class Worker:
    """One process of the job: stage `stage` of data-parallel pipeline `pipeline`."""

    pipeline: int
    stage: int

    def __str__(self) -> str:
        return f"{self.pipeline}:{self.stage}"

    def rank(self, pp: int) -> int:
        """Global rank in the fault-free job: `pipeline * pp + stage`."""
        return self.pipeline * pp + self.stage

    @classmethod
    def parse(cls, text: str) -> Worker:
        """Parse `d:s` (pipeline d, stage s)."""
        try:
            d, s = text.strip().split(":")
            return cls(int(d), int(s))
        except ValueError:
            raise TopologyError(f"bad worker {text!r}: write it as PIPELINE:STAGE, e.g. 1:3") from None


@dataclass(frozen=True)
class Topology:
    """`pp` stages per pipeline, `dp` pipelines holding the same weights, and the failed workers."""

    pp: int
    dp: int = 1
    failed: frozenset[Worker] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if not isinstance(self.pp, int) or self.pp < 1:
            raise TopologyError(f"pp must be a positive integer, got {self.pp!r}")
        if not isinstance(self.dp, int) or self.dp < 1:
            raise TopologyError(f"dp must be a positive integer, got {self.dp!r}")
        failed = frozenset(self.failed)
        object.__setattr__(self, "failed", failed)
        for w in failed:
            if not (0 <= w.pipeline < self.dp and 0 <= w.stage < self.pp):
                raise TopologyError(
                    f"failed worker {w} is outside the job: pipelines are 0..{self.dp - 1}, stages 0..{self.pp - 1}"
                )

    @classmethod
    def of(cls, pp: int, dp: int = 1, failed: Iterable[Worker | tuple[int, int]] = ()) -> Topology:
        """Build a topology, accepting failed workers as `Worker`s or `(pipeline, stage)` pairs."""
        return cls(pp, dp, frozenset(w if isinstance(w, Worker) else Worker(*w) for w in failed))

    @property
    def workers(self) -> tuple[Worker, ...]:
        """Every worker of the fault-free job, in rank order."""
        return tuple(Worker(d, s) for d in range(self.dp) for s in range(self.pp))

    @property
    def live_workers(self) -> tuple[Worker, ...]:
        """Workers that are not failed, in rank order."""
        return tuple(w for w in self.workers if w not in self.failed)

    def is_live(self, worker: Worker) -> bool:
        return 0 <= worker.pipeline < self.dp and 0 <= worker.stage < self.pp and worker not in self.failed

    def stage_group(self, stage: int) -> tuple[Worker, ...]:
        """Live workers of `stage`: the group that all-reduces its gradients."""
        return tuple(Worker(d, stage) for d in range(self.dp) if Worker(d, stage) not in self.failed)

    def rank(self, worker: Worker) -> int:
        return worker.rank(self.pp)

    def worker_of_rank(self, rank: int) -> Worker:
        return Worker(rank // self.pp, rank % self.pp)
