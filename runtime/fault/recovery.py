"""Recovery policies: what `ResilientTrainer` does with the iteration a failure interrupts.

    trainer = ResilientTrainer(..., policy="rollback")       # or "lossy", "restart", or a policy object

The trainer owns the mechanics every policy shares: joining, the commit record after STEP,
agreeing on the next generation, regrouping, handing state to replacements, checkpoints. A
policy decides, through a few hooks the trainer calls at fixed points of one worker's loop
(modelled on TorchFT's `Manager`, whose training loop calls `start_quorum`, `should_commit` and
`report_error`; ours makes no network call of its own in the fault-free path):

- `on_start(host, start)`: this worker started, was restored from a checkpoint or admitted as a
  replacement, and trains from iteration `start` on.
- `on_iteration(it)`: iteration `it.number`'s state is built, before its first instruction; the
  policy may keep `it` (its own state) and ask for what it needs of it (`it.keep_sent`).
- `on_step(it)` at STEP, before the snapshot and the optimizer step: a `StepDecision` (the scale
  to apply to the reduced gradient, and whether to step at all).
- `on_completed(it)`: iteration `it.number` is done on this worker, run or finished after a
  failure (the iteration boundary).
- `on_failure(error)`: a failure is noticed (`GenerationAborted`, a transfer's `RuntimeError`):
  `OnFailure.DROP` the iteration in flight, `OnFailure.KEEP` it for `finish`, or
  `OnFailure.RESTART` the job from its latest checkpoint.
- `on_drop()`: the trainer dropped the iteration in flight; forget what was kept of it.
- `finish(host, decision)`: the survivors agreed on a new generation (and regrouped); finish or
  redo the interrupted iteration and return the next one, or return None to roll back.

After `finish` returns None (or when the policy dropped its state), the trainer rolls back, the
fallback that is always correct: workers in `decision.undo` restore their step snapshot, and
everyone re-runs `decision.rerun` on the new generation's plan (`rollback.rollback_decision`).
A failure while recovering starts recovery over: `on_drop` then `finish` again (a policy that
finishes an iteration at most once per iteration, like lossy, sees the second `finish` and
returns None). `Report.recoveries[k].method` names the policy that finished the iteration, or
"rollback".

`finish` runs after the agreement, on the new generation's groups; `host` (`RecoveryHost`, the
trainer) is the narrow surface it may use: the session, the `PipelineTrainer`, the step
snapshot, the report, and six calls (`batch_for`, `plan_for`, `wait`, `step_for`, `record`,
`roll_back`).
A policy's state is its own: it keeps what it needs from `on_iteration` (the `Iteration`
objects), never edits the trainer's.

Policies here:
- `RollbackPolicy` (default): drop the iteration in flight, re-run it; the model trained is
  exactly the fault-free one. Every hook is a no-op: subclass it and override what you need.
- `RestartPolicy`: restart the whole job from its latest checkpoint on every failure, without
  re-planning (plain checkpoint-restart, for comparison; needs `checkpoint=CheckpointPolicy(...)`).
- `fault.swift.SwiftPolicy` (`ResilientTrainer(logging=LoggingPolicy(...))`): roll back, except
  that a stage that lost every replica is rebuilt from its checkpoint by replaying its
  neighbours' logged boundary tensors, instead of restarting the whole job.
- `runtime.lossy.LossyPolicy`: keep the iteration in flight and finish it on the survivors without
  the lost micro-batches, rescaling each stage's update (`on_step`).

Adding logging-based recovery (SWIFT: redo a lost stage's share from logged boundary tensors)
needs no change to the trainer: keep each iteration's sent tensors in `on_iteration`
(`it.keep_sent = True`) and log them in `on_completed`; on a failure keep the survivors' state
(`on_failure` -> `OnFailure.KEEP`); in `finish`, replay the logged tensors through the lost
stage on the worker that takes it over and return the next iteration; `on_start` is where a
replacement or a restarted job reloads the log it replays from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from schedcomp.runtime.fault.rollback import Rollback

if TYPE_CHECKING:
    from schedcomp.ir import Plan
    from schedcomp.partition import Partition
    from schedcomp.runtime.data import Tensors
    from schedcomp.runtime.executor import Iteration
    from schedcomp.runtime.fault.report import Report
    from schedcomp.runtime.fault.session import FaultSession
    from schedcomp.runtime.fault.transfer import StepSnapshot
    from schedcomp.runtime.trainer import PipelineTrainer
    from schedcomp.topology import Topology


class OnFailure(Enum):
    """What to do with the iteration in flight when a failure is noticed (`on_failure`)."""

    DROP = "drop"  # forget it (activations, stashes, gradients): it will be re-run
    KEEP = "keep"  # keep it: the policy's `finish` carries on from this state
    RESTART = "restart"  # do not recover: restart the whole job from its latest checkpoint


@dataclass(frozen=True)
class StepDecision:
    """What STEP does on this worker: scale the reduced gradient, then step (or only clear it)."""

    scale: float = 1.0
    apply: bool = True  # False: zero the gradient instead, so momentum or decay cannot move the stage


class RecoveryHost(Protocol):
    """What a policy's `finish` may use of the trainer (`ResilientTrainer` is one)."""

    session: FaultSession
    trainer: PipelineTrainer | None
    snapshot: StepSnapshot | None
    report: Report | None
    iterations: int  # to train
    build_stage: Any  # what the trainer builds stages with, loss_fn and make_optimizer: a helper of a replay
    loss_fn: Any  # builds a lost stage beside its own (`fault.swift_parallel`)
    make_optimizer: Any
    checkpoint_cut: Partition | None  # checkpoints hold each layer, under this cut (`fault.checkpoint_layers`)

    def batch_for(self, iteration: int) -> tuple[Tensors, Tensors]: ...

    def plan_for(self, topology: Topology) -> Plan: ...

    def wait(self, work: Any) -> None: ...  # gives up (GenerationAborted) when the generation breaks

    def step_for(self, iteration: int, checkpoint: bool = True) -> Callable[[Iteration], None]: ...

    def record(self, iteration: int, it: Iteration) -> None: ...  # the iteration is done here: report it

    def roll_back(self, decision: Rollback) -> bool: ...  # undo if stepped, forget the re-run, switch plans


@runtime_checkable
class RecoveryPolicy(Protocol):
    """The hooks `ResilientTrainer` calls (see the module docstring for when)."""

    name: str

    def on_start(self, host: RecoveryHost, start: int) -> None: ...

    def on_iteration(self, it: Iteration) -> None: ...

    def on_step(self, it: Iteration) -> StepDecision: ...

    def on_completed(self, it: Iteration) -> None: ...

    def on_failure(self, error: BaseException) -> OnFailure: ...

    def on_drop(self) -> None: ...

    def finish(self, host: RecoveryHost, decision: Rollback) -> int | None: ...


class RollbackPolicy:
    """Re-run the interrupted iteration (the default): drop it on failure, roll back after agreement."""

    name = "rollback"

    def on_start(self, host: RecoveryHost, start: int) -> None:
        pass

    def on_iteration(self, it: Iteration) -> None:
        pass

    def on_step(self, it: Iteration) -> StepDecision:
        return StepDecision()

    def on_completed(self, it: Iteration) -> None:
        pass

    def on_failure(self, error: BaseException) -> OnFailure:
        return OnFailure.DROP

    def on_drop(self) -> None:
        pass

    def finish(self, host: RecoveryHost, decision: Rollback) -> int | None:
        return None  # the trainer rolls back: undo, re-run `decision.rerun`


class RestartPolicy(RollbackPolicy):
    """Restart the job from its latest checkpoint on every failure (needs `checkpoint=CheckpointPolicy(...)`)."""

    name = "restart"

    def on_failure(self, error: BaseException) -> OnFailure:
        return OnFailure.RESTART
