"""What a worker of a resilient job reports: iterations done, recoveries, the ledger of its stage."""

from __future__ import annotations

from dataclasses import dataclass, field

from schedcomp.topology import Worker


@dataclass
class Recovery:
    """One recovery as this worker saw it (seconds from the moment it noticed the failure)."""

    generation: int
    failed: tuple[str, ...]
    rerun: int
    undone: bool
    agreed: float  # new generation agreed and regrouped
    ready: float  # plan switched and communication rebuilt


@dataclass
class Report:
    """What one worker did: iterations completed, recoveries, the ledger of its stage."""

    worker: Worker
    iterations: int
    generation: int
    failed: tuple[str, ...]
    recoveries: list[Recovery] = field(default_factory=list)
    admitted: list[int] = field(default_factory=list)  # iterations at which replacements entered
    handed_over: int = 0  # stage states this worker sent to replacements
    resumed_at: int | None = None  # a replacement: the iteration it started at
    ledger: dict[int, list[float]] = field(default_factory=dict)
    losses: dict[int, float] = field(default_factory=dict)  # last stage: this worker's share of the mean loss
    completed_at: dict[int, float] = field(default_factory=dict)  # iteration -> time.time() of its STEP
