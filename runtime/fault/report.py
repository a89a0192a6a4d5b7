"""What a worker of a resilient job reports: iterations done, recoveries, the ledger of its stage."""

from __future__ import annotations

from dataclasses import dataclass, field

from schedcomp.topology import Worker


@dataclass
class Recovery:
    """One recovery as this worker saw it (seconds from the moment it noticed the failure)."""

    generation: int
    failed: tuple[str, ...]
    rerun: int  # the iteration re-run (rollback) or finished by the recovery policy (e.g. lossy)
    undone: bool
    agreed: float  # new generation agreed and regrouped
    ready: float  # plan switched and communication rebuilt (lossy: and the iteration finished)
    method: str = "rollback"  # how the interrupted iteration was dealt with: "rollback" or the finishing policy's name


@dataclass
class Rejoined:
    """A replacement's way in (`time.time()` stamps, comparable across the processes of one host)."""

    announced_at: float  # it told the survivors it is here
    admitted_at: float  # the generation admitting it was sealed and its groups built
    received_at: float  # its stage's state started arriving from the donor (waiting for it included)
    loaded_at: float  # the state is in its module and optimizer
    received_bytes: int


@dataclass
class Report:
    """What one worker did: iterations completed, recoveries, the ledger of its stage."""

    worker: Worker
    iterations: int
    generation: int
    failed: tuple[str, ...]
    recoveries: list[Recovery] = field(default_factory=list)
    admitted: list[int] = field(default_factory=list)  # iterations at which replacements entered
    improved: list[int] = field(default_factory=list)  # iterations from which a better plan ran (background compile)
    handed_over: int = 0  # stage states this worker sent to replacements
    resumed_at: int | None = None  # a replacement: the iteration it started at
    rejoined: Rejoined | None = None  # a replacement: when it announced itself, entered, got its state
    ledger: dict[int, list[float]] = field(default_factory=dict)
    losses: dict[int, float] = field(default_factory=dict)  # last stage: this worker's share of the mean loss
    completed_at: dict[int, float] = field(default_factory=dict)  # iteration -> time.time() of its STEP
    skipped: dict[int, list[int]] = field(default_factory=dict)  # lossy: iteration -> global-batch chunks lost
    skipped_samples: dict[int, int] = field(default_factory=dict)  # lossy: iteration -> samples lost
    # max_grad_norm / skip_nonfinite: iteration -> (global gradient norm, clipped, update skipped)
    updates: dict[int, tuple[float, bool, bool]] = field(default_factory=dict)
    run: int = 0  # restarts of the job from a checkpoint before this run
    restored_from: int | None = None  # the checkpoint this run started from (None: none, from scratch)
    iterations_lost: int | None = None  # a restarted run: iterations the restart threw away
    restart_reason: str | None = None  # a restarted run: why the run before it asked for the restart
    replayed: list[int] = field(default_factory=list)  # logging: the iterations a rebuilt stage replayed here
    replay_seconds: float = 0.0  # logging: how long that replay took
    log_bytes: dict[int, int] = field(default_factory=dict)  # logging: iteration -> bytes this worker logged
    log_peak: int = 0  # logging: the most bytes this worker's log held
    helped: int | None = None  # logging: the lost stage this survivor helped replay (`fault.swift_parallel`)
    replay_share: list[list[int]] = field(default_factory=list)  # logging: the [pipeline, micro-batch]s replayed here
    replayed_with: list[str] = field(default_factory=list)  # logging: every worker that replayed that stage (it too)
