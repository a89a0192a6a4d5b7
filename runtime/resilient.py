"""Resilient training: `ResilientTrainer(...).run(iterations)` survives the death of any worker.

    cache = PlanCache.load("plans/")                       # precompiled: `schedcomp precompile`
    trainer = ResilientTrainer(cache, build_stage, loss_fn, make_optimizer, batch_for)
    report = trainer.run(iterations)

launched with one process per worker by `python -m schedcomp.runtime.fault.launch --pp P --dp D
[--respawn N] -- python train.py` (see `fault.launch`). `batch_for(iteration)` returns that
iteration's global batch `(inputs, targets)`; it must return the same samples whenever it is
called again for the same iteration (an iteration is re-run after a failure).

What happens (the integration of `fault.session`, the plan cache and `PipelineTrainer`):

- Start (`fault.worker_start`): join generation 0 through a `FaultSession`, take the plan for its
  topology from the plan source (`fault.plan_source`) and build the trainer on that generation's
  groups (ranks = the view's members, which are the plan's workers). Replicas start from the
  lowest rank's parameters.
- Iteration i: the executor's waits give up as soon as the generation breaks (`wait_work` on the
  session's signal; gloo cannot interrupt a blocked wait). STEP is `snapshot.take(i)`, the
  optimizer step, then `session.commit(i)`, with no network call in between, so the commit
  records are final when the survivors agree.
- Failure (`GenerationAborted`, or a transfer's `RuntimeError`): report it, drop the iteration in
  flight (activations, weight-gradient stashes, gradients), agree on the next generation and
  regroup, and let the recovery policy finish the interrupted iteration (`fault.recovery`);
  by default, and whenever it declines, roll back, deciding from the commit records
  (`rollback.rollback_decision`: the model trained is exactly the fault-free one). Workers that
  stepped the iteration being re-run restore their snapshot (and record the undo), everyone
  switches to the cached plan for the new failed set and re-runs from there. A failure during
  recovery starts recovery again.
- Every wait of a recovery (agreement, the store meeting and group construction of a new
  generation, replica transfers, the lossy finish, the final meeting) gives up as soon as the
  failure detector finds a member dead, so a second death never holds the others for a group
  timeout. The final meeting is in the store: once every member arrived, a later death
  changes nothing (`FaultSession.finish` / `finished`).
- Replacements (`--respawn`): at an iteration boundary the survivors admit them
  (`session.boundary` / `admit`), rebuild their groups, and the stage's donor replica sends its
  parameters and optimizer state with the iteration to resume at; the plan switches back.
- A plan source with `improved(topology)` (`schedcomp.improving.ImprovingPlans`) serves a failure
  set its cache lacks with a repaired plan at once and compiles it fully in the background; once
  every member holds the compiled plan (same digest), they switch to it at an agreed iteration
  boundary (`fault.better`; `Report.improved`). A new generation cancels a pending switch: its keys
  are the generation's.
- Virtual stages (a plan with `chunks` > 1: interleaved-1f1b, zb-v): a worker holds several model
  chunks, and everything above moves all of them (`fault.chunks`): the step snapshot, the
  transfer to a replacement (from a live worker at the same place, which holds the same chunks),
  and the checkpoints, one per chunk under its virtual stage. The lossy policy and logging-based
  recovery work one stage per worker and are refused with chunks (`fault.policies.refuse_chunks`).
- Layer moves: with an `nn.Sequential` model, a plan whose `partition` cuts it elsewhere (a failure plan
  that moves layers off a stage that lost workers, the fault-free plan at a rejoin, an improved plan)
  moves layers and their optimizer state among the survivors at the switch, after the rollback's undo
  (`runtime.moves`; the switches themselves are in `fault.switches`). Lossy and logging-based recovery
  refuse such plans. Checkpoints hold each layer's state (`fault.checkpoint_layers`): they are taken
  under any cut, and a restart restores them into the cut of its first plan.
- A worker declared failed while alive (`Evicted`) raises: exit non-zero and the launcher
  replaces it. When recovery cannot re-plan (a stage lost every replica), the worker asks for a
  restart of the whole job from its latest checkpoint and exits (`fault.restart`; checkpoints are
  taken with `checkpoint=CheckpointPolicy(dir, every)`, after the commit record of STEP). So does a
  wait of a change of generation that ran past the agreement timeout (`RecoveryTimeout`); without
  checkpoints either ends the worker with one line and status 1, which its launcher reports.
- Re-cut micro-batches (`precompile --recut`): rollback and restart run pieces like any micro-batch;
  lossy and logging-based recovery refuse such a source (`policies.refuse_recut`).
- Re-formed pipelines (`Plan.partitions`): rollback switches to them like to any plan that cuts the model
  elsewhere (each worker its own pipeline's layers; checkpoints under its own pipeline's partition, the ledger
  per segment); lossy and logging-based recovery refuse such a source (`policies.refuse_reformed`).

The ledger: each worker counts, per regular micro-batch, the samples whose weight gradients it accumulated
in an iteration (whole micro-batches, or the rows each re-cut piece holds of it: `Iteration.count`); the
counts ride along in the stage's gradient all-reduce, so after STEP every replica holds, for its stage, how
often each micro-batch's samples entered the update it applied (with re-formed pipelines per segment, the
worker's ledger their common count: `executor.segment_ledger`). `Report.ledger[i]` is that vector for
iteration i, in micro-batches (all ones, exactly, when every sample counted once).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from schedcomp.errors import RecoveryError
from schedcomp.ir import Instruction, Plan
from schedcomp.partition import Partition
from schedcomp.runtime.data import Tensors
from schedcomp.runtime.executor import Iteration
from schedcomp.runtime.fault import switches
from schedcomp.runtime.fault.agreement import Evicted
from schedcomp.runtime.fault.better import BetterPlan
from schedcomp.runtime.fault.boundary_log import LoggingPolicy
from schedcomp.runtime.fault.chunks import Held
from schedcomp.runtime.fault.inject import Hook
from schedcomp.runtime.fault.membership import GenerationAborted, wait_abortable
from schedcomp.runtime.fault.plan_source import PlanSource
from schedcomp.runtime.fault.policies import recovery_policy
from schedcomp.runtime.fault.protocol import RecoveryTimeout
from schedcomp.runtime.fault.recovery import OnFailure, RecoveryPolicy
from schedcomp.runtime.fault.report import Report
from schedcomp.runtime.fault.restart import CheckpointPolicy, LastResort
from schedcomp.runtime.fault.rollback import Rollback
from schedcomp.runtime.fault.session import FaultSession
from schedcomp.runtime.fault.store import WorkerEnv
from schedcomp.runtime.fault.transfer import StepSnapshot
from schedcomp.runtime.fault.worker_start import start_worker
from schedcomp.runtime.lossy import LossyPolicy
from schedcomp.runtime.stage import LossFn, OptimizerFactory, StageBuilder
from schedcomp.runtime.trainer import PipelineTrainer
from schedcomp.runtime.training import BARRIER, SchedulerFactory, TrainingOptions
from schedcomp.topology import Topology

log = logging.getLogger(__name__)

BatchFn = Callable[[int], tuple[Tensors, Tensors]]


class ResilientTrainer:
    """Train with `PipelineTrainer` under a `FaultSession`, rolling back and re-planning after failures.

    - `plans`: a `PlanCache` (or any `topology -> Plan`) with a plan for every failed set to survive.
      Plans with virtual stages (interleaved-1f1b, zb-v: `chunks` > 1) run too: the cache's
      `chunks` and `placement` are the job's, and a function gets the topology with them (those of
      its first plan once it returned one; until then a worker builds its chunks after joining).
    - `build_stage`, `loss_fn`, `make_optimizer`: as for `PipelineTrainer`; the optimizer's state
      must be plain data in `state_dict()` (snapshots and replica transfers never pickle).
    - `batch_for(iteration)`: the global batch of that iteration, the same on every call.
    - `session`: a started-or-not `FaultSession` (default: one from the launcher's environment
      with `detection_time`).
    - `before(iteration, index, instruction)`: called before each instruction (fault injection).
    - `policy`: what to do with the iteration a failure interrupts (`fault.recovery`): "rollback"
      (default: re-run it, exactly the fault-free model), "lossy" (finish it without the lost
      micro-batches, rescaled; `runtime.lossy`), "restart" (restart the job from its latest
      checkpoint on every failure), or a `RecoveryPolicy` object (one per trainer: it holds state).
    - `lr_scheduler`, `max_grad_norm`, `skip_nonfinite`, `autocast`, `seed`: as for `PipelineTrainer`;
      the global check always waits before stepping here (grad_check="barrier"), so that a step
      is final when its commit is recorded; the LR schedule moves with the stage's state (rollback
      undo, transfer to a replacement, checkpoints).
    - `checkpoint`: `CheckpointPolicy(directory, every)`: asynchronous checkpoints after STEP, resume
      from the latest complete one at start, restart the job from it when a stage is lost (`fault.restart`).
    - `logging`: `LoggingPolicy(where, budget_bytes, boundaries)`: log boundary tensors and rebuild a
      stage that lost every replica by replay instead of restarting the job (`fault.swift`; needs
      `checkpoint` and launching with `--respawn`).
    """

    def __init__(self, plans: Any, build_stage: StageBuilder | nn.Sequential, loss_fn: LossFn,
                 make_optimizer: OptimizerFactory, batch_for: BatchFn, *, session: FaultSession | None = None,
                 detection_time: float = 3.0, before: Hook | None = None,
                 after_recovery: Callable[[int], None] | None = None,
                 checkpoint: CheckpointPolicy | None = None, policy: str | RecoveryPolicy = "rollback",
                 lr_scheduler: SchedulerFactory | None = None, max_grad_norm: float | None = None,
                 skip_nonfinite: bool = False, autocast: torch.dtype | None = None,
                 logging: LoggingPolicy | None = None, seed: int | None = 0) -> None:
        self.policy = recovery_policy(policy, checkpoint, logging)
        self.seed = seed
        # the barrier: a step is final when its commit is recorded (see `training`)
        self.options = TrainingOptions(lr_scheduler, max_grad_norm, skip_nonfinite, BARRIER, autocast)
        if self.options.checks_globally and isinstance(self.policy, LossyPolicy):
            raise RecoveryError("max_grad_norm, skip_nonfinite and float16 need every stage's gradients of an "
                                "iteration, which the lossy policy drops: use policy='rollback' with them")
        if self.options.checks_globally and logging is not None:
            raise RecoveryError("max_grad_norm, skip_nonfinite and float16 are not replayed by logging-based recovery "
                                "yet (a replayed step needs its iteration's global norm): drop logging= to use them")
        # what the plan source may serve, refused up front where the policy or the options cannot run it
        self.plans = PlanSource(plans, build_stage, self.policy, self.options)
        self.build_stage, self.loss_fn, self.make_optimizer = build_stage, loss_fn, make_optimizer
        self.batch_for, self.before, self.after_recovery = batch_for, before, after_recovery
        self.session = session or FaultSession(WorkerEnv.from_env(), detection_time=detection_time)
        self.last_resort = LastResort(checkpoint, self.session)  # checkpoints, restart when a stage is lost
        # a source with `improved(topology)` (`ImprovingPlans`): switch to its better plans (`fault.better`)
        improved = getattr(plans, "improved", None)
        self.better = BetterPlan(improved, self.session.store, self.session.lead) if improved is not None else None
        self.trainer: PipelineTrainer | None = None
        self.snapshot: StepSnapshot | None = None
        self.held: Held = {}
        self.per_layer = False  # checkpoints per layer (an nn.Sequential whose optimizer splits per layer)
        self.iteration = 0
        self.iterations = 0  # to train (set by `run`)
        self.report: Report | None = None

    # ---- waiting -------------------------------------------------------------------------------------

    @property
    def checkpoint_cut(self) -> Partition | None:
        """The cut this worker's checkpoints are written and restored under, layer by layer: its own pipeline's
        partition (None: per stage)."""
        return self.trainer.own_cut if self.per_layer and self.trainer is not None else None

    def wait(self, work: Any) -> None:
        """Wait for `work`; give up (`GenerationAborted`) as soon as the generation breaks."""
        wait_abortable(work, self.session.signal)

    def plan_for(self, topology: Topology) -> Plan:
        """The plan for this topology's failed set (`PlanSource.plan_for`)."""
        return self.plans.plan_for(topology)

    # ---- start -----------------------------------------------------------------------------------------

    def start(self) -> int:
        """Join the job and build the trainer (`fault.worker_start`); returns the iteration to start at (0, a
        checkpoint's, or a replacement's resume point)."""
        return start_worker(self)

    # ---- one iteration ----------------------------------------------------------------------------------

    def step_for(self, i: int, checkpoint: bool = True) -> Callable[[Iteration], None]:
        """STEP of iteration i: the policy's scale, snapshot, optimizer step, commit record, checkpoint.

        A policy finishing an interrupted iteration passes `checkpoint=False`: a second failure may
        still roll that step back and re-run the iteration in full, and a checkpoint is never
        rewritten (`fault.restart`).
        """
        trainer, session, snapshot = self.trainer, self.session, self.snapshot
        assert trainer is not None and snapshot is not None

        def step(it: Iteration) -> None:
            decision = self.policy.on_step(it)
            if decision.scale != 1.0:
                for stage in trainer.stages.values():
                    stage.scale_grads(decision.scale)
            snapshot.take(i)
            if decision.apply:
                trainer.update(i)  # the optimizer and LR schedule, through the global check if any
                outcome = trainer.checks.outcomes.get(i) if trainer.checks is not None else None
                if outcome is not None and self.report is not None:
                    self.report.updates[i] = (outcome.grad_norm, outcome.clipped, outcome.skipped)
            else:
                for stage in trainer.stages.values():
                    stage.optimizer.zero_grad(set_to_none=True)
            session.commit(i)  # nothing touches the network between the step and its record
            # per layer under any cut (a restart may cut the model otherwise); per stage only under the base cut,
            # the one a restart builds
            if checkpoint and (self.per_layer or trainer.on_base_cut):
                self.last_resort.after_step(i, self.held, self.checkpoint_cut)

        return step

    def _run(self, i: int) -> None:
        trainer, report = self.trainer, self.report
        assert trainer is not None and report is not None
        ledger = torch.zeros(trainer.dp * trainer.plan.microbatches, dtype=torch.float64)
        before = None
        if self.before is not None:
            hook = self.before

            def before(index: int, ins: Instruction) -> None:
                hook(i, index, ins)

        trainer.iteration = i
        batch = self.batch_for(i)
        self.plans.pieces.check(batch, trainer.dp, trainer.plan.microbatches)
        self.record(i, trainer.run_iteration(batch, step=self.step_for(i), ledger=ledger, before=before,
                                             started=self.policy.on_iteration))

    def record(self, i: int, it: Iteration) -> None:
        """Iteration i is done on this worker (run, or finished after a failure): report it."""
        report = self.report
        assert report is not None and it.ledger is not None
        chunks = self.trainer.plan.topology.chunks if self.trainer is not None else 1
        # each chunk a worker holds adds its W of a micro-batch: counted once per chunk, reported once
        counted = it.counted()  # in regular micro-batches (a re-cut plan counts rows)
        report.ledger[i] = (counted / chunks if chunks > 1 else counted).tolist()
        report.completed_at[i] = time.time()
        loss = it.loss()
        if loss is not None:
            report.losses[i] = float(loss)
        self.policy.on_completed(it)

    # ---- after a failure ----------------------------------------------------------------------------------

    def drop(self) -> None:
        """Forget the iteration in flight, here and in the policy's state."""
        assert self.trainer is not None
        self.trainer.abandon()
        self.policy.on_drop()

    def roll_back(self, decision: Rollback) -> bool:
        """Undo this worker's step of `decision.rerun` if it made one (returns whether), forget what the
        report says of the iterations to re-run, and switch to the current generation's plan."""
        return switches.roll_back(self, decision)

    # ---- the loop -----------------------------------------------------------------------------------------

    def run(self, iterations: int) -> Report:
        """Train until iteration `iterations - 1` is done; returns this worker's report."""
        self.iterations = iterations
        try:
            i = self.start()
        except RecoveryTimeout as e:  # joining timed out: one line, then a restart or a clean exit
            self.last_resort.give_up(e)
        assert self.report is not None
        while True:
            try:
                while i < iterations:
                    self._run(i)
                    i += 1
                    if i < iterations:
                        switches.admit(self, i - 1)
                # Leave together: a worker that left early could not re-run a last iteration that a
                # failure in a slower stage rolls back.
                self.session.finish()
                break
            except (GenerationAborted, RuntimeError) as e:
                if self.session.finished():  # the meeting was complete: a death after it changes nothing
                    break
                action = self.policy.on_failure(e)
                if action is OnFailure.RESTART:
                    self.last_resort.give_up(e)
                try:
                    i = switches.recover(self, e, kept=action is OnFailure.KEEP)
                except Evicted:
                    raise
                except RecoveryError as lost:  # a stage lost every replica, or a wait timed out: restart
                    self.last_resort.give_up(lost)
            except RecoveryTimeout as e:  # at an admission: never retried (the final meeting has no deadline)
                self.last_resort.give_up(e)
        self.last_resort.close()
        view = self.session.view
        assert view is not None
        self.report.iterations = i
        self.report.generation = view.generation
        self.report.failed = tuple(sorted(map(str, view.failed)))
        return self.report

    def state(self) -> dict[str, Tensor]:
        """This worker's stage parameters and buffers (a state dict; with chunks, its first chunk's: see `states`)."""
        assert self.trainer is not None
        return self.trainer.stage.module.state_dict()

    def states(self) -> dict[int, dict[str, Tensor]]:
        """The parameters and buffers of every chunk this worker holds, by virtual stage."""
        assert self.trainer is not None
        return {s: stage.module.state_dict() for s, stage in self.trainer.stages.items()}

    def close(self) -> None:
        try:
            self.session.close()
        finally:
            self.plans.close()  # stops background compiles (`ImprovingPlans`)
